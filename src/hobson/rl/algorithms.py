"""The four algorithms as data: which objective, which estimator, critic or not, how many steps.

The one RL loop (:mod:`hobson.rl.loop`) looks an :class:`Algorithm` up by name and never branches
on the name itself. What differs between algorithms is spelled out here:

- ``freeze``: what is computed from the policy *before* the update, from its logits on the
  rollout sequences (``(B, T, V)``, already shifted so ``logits[:, t]`` scores ``actions[:, t]``):
  DPPO's proximal log-probs, Flow-DPPO's full-vocabulary old log-probs; PPO and GRPO need none.
- ``inputs``: the objective's keyword arguments from the current logits, the frozen tensors and
  the batch.
- ``minibatches``: optimizer steps per rollout, each on an equal share of the completions
  (Flow-DPPO: two, each on half).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from hobson.errors import ConfigError
from hobson.rl.objectives import DEFAULT_ADVANTAGE, tempered_logprobs, token_logprobs

Freeze = Callable[[Tensor, Any, float], dict[str, Tensor]]
Inputs = Callable[[Tensor, dict[str, Tensor], Any, float], dict[str, Tensor]]


@dataclass(frozen=True)
class Algorithm:
    name: str
    objective: str
    advantage: str
    minibatches: int
    freeze: Freeze
    inputs: Inputs
    params: Callable[[Any], dict[str, Any]]

    @property
    def critic(self) -> bool:
        # a critic exists exactly when the estimator needs values (GAE); GRPO has none
        return self.advantage == "gae"


def _nothing(logits: Tensor, batch: Any, temperature: float) -> dict[str, Tensor]:
    return {}


def _freeze_prox(logits: Tensor, batch: Any, temperature: float) -> dict[str, Tensor]:
    return {"prox": token_logprobs(logits, batch.actions, temperature)}


def _freeze_full(logits: Tensor, batch: Any, temperature: float) -> dict[str, Tensor]:
    return {"old_full": tempered_logprobs(logits, temperature)}


def _clip_inputs(logits: Tensor, frozen: dict[str, Tensor], batch: Any, temperature: float) -> dict[str, Tensor]:
    return {
        "logprobs": token_logprobs(logits, batch.actions, temperature),
        "old_logprobs": batch.behav,
        "advantages": batch.advantages,
        "mask": batch.mask,
    }


def _dppo_inputs(logits: Tensor, frozen: dict[str, Tensor], batch: Any, temperature: float) -> dict[str, Tensor]:
    return {
        "logprobs": token_logprobs(logits, batch.actions, temperature),
        "prox_logprobs": frozen["prox"],
        "behav_logprobs": batch.behav,
        "advantages": batch.advantages,
        "mask": batch.mask,
    }


def _flow_inputs(logits: Tensor, frozen: dict[str, Tensor], batch: Any, temperature: float) -> dict[str, Tensor]:
    return {
        "logprobs_full": tempered_logprobs(logits, temperature),
        "old_logprobs_full": frozen["old_full"],
        "actions": batch.actions,
        "advantages": batch.advantages,
        "mask": batch.mask,
    }


def _clip_params(cfg: Any) -> dict[str, Any]:
    return {"clip_eps": cfg.clip_eps}


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("ppo", "ppo", DEFAULT_ADVANTAGE["ppo"], 1, _nothing, _clip_inputs, _clip_params),
        Algorithm("grpo", "grpo", DEFAULT_ADVANTAGE["grpo"], 1, _nothing, _clip_inputs, _clip_params),
        Algorithm("dppo", "dppo", DEFAULT_ADVANTAGE["dppo"], 1, _freeze_prox, _dppo_inputs, _clip_params),
        Algorithm(
            "flow-dppo",
            "flow-dppo",
            DEFAULT_ADVANTAGE["flow-dppo"],
            2,
            _freeze_full,
            _flow_inputs,
            lambda cfg: {"kl_budget": cfg.kl_budget},
        ),
    )
}

# keyword parameters of each advantage estimator, from the run's settings
ADVANTAGE_PARAMS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "gae": lambda cfg: {"gamma": cfg.gamma, "lam": cfg.lam, "masked": cfg.gae_masked},
    "grpo": lambda cfg: {},
}


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; supported: {', '.join(sorted(ALGORITHMS))}") from None
