"""Rewards of completions, looked up by name (``--reward``).

- ``math``: 1.0 when the last ``\\boxed{...}`` answer of the completion equals ``label`` under
  math-verify (fractions, expressions), else 0.0. A completion without ``\\boxed{}`` gets 0.
- ``test-token-value``: TEST ONLY. The mean of ``(token id mod 16) / 15`` over the response. A tiny
  random model almost never solves arithmetic, so under ``math`` every group's rewards are equal
  and every advantage is zero; this reward varies within a group whenever the sampled tokens
  differ, which the end-to-end tests need (non-zero advantages, weights that change). It says
  nothing about the quality of an answer: never train a real model with it.
- ``test-constant``: TEST ONLY. 1.0 for everything (all-equal group rewards: zero advantages).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hobson.errors import ConfigError

RewardFn = Callable[[str, list[int], str], float]
_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    try:
        return _REWARDS[name]
    except KeyError:
        raise ConfigError(f"unknown reward {name!r}; supported: {', '.join(sorted(_REWARDS))}") from None


def supported_rewards() -> list[str]:
    return sorted(_REWARDS)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


@register_reward("math")
def math_reward(text: str, tokens: list[int], label: str) -> float:
    """1.0 if the last ``\\boxed{}`` answer verifies against ``label`` (math-verify), else 0.0."""
    del tokens
    answer = last_boxed(text)
    if answer is None:
        return 0.0
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ConfigError("the math reward needs math-verify: pip install torch==2.13.0 math-verify") from e
    # math-verify's timeouts use signal.alarm, which works on the main thread only
    on_main = threading.current_thread() is threading.main_thread()
    parse_kw = {} if on_main else {"parsing_timeout": None}
    verify_kw = {} if on_main else {"timeout_seconds": None}
    gold = parse(f"\\boxed{{{label}}}", **parse_kw)
    pred = parse(f"\\boxed{{{answer}}}", **parse_kw)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, **verify_kw) else 0.0


@register_reward("test-token-value")
def token_value_reward(text: str, tokens: list[int], label: str) -> float:
    """TEST ONLY: mean of (token id mod 16) / 15 over the response tokens (see the module docstring)."""
    del text, label
    return sum((t % 16) / 15 for t in tokens) / len(tokens) if tokens else 0.0


@register_reward("test-constant")
def constant_reward(text: str, tokens: list[int], label: str) -> float:
    """TEST ONLY: 1.0 for every completion (all-equal group rewards)."""
    del text, tokens, label
    return 1.0
