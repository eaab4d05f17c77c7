"""Which chunked gated-delta-rule kernel a torso's Gated DeltaNet layers (Qwen3.5, Qwen3-Next) call.

transformers decides once, at import: fla's chunked kernel when ``fla`` imports, else its
reference torch function, both behind one dispatch function that every layer looks up by name
(``torch_chunk_gated_delta_rule``) in its modeling module at call time. There is no per-model
setting, so :func:`select_gated_delta_rule` sets that name for as long as its context is open
(the training recipe holds it from setup to cleanup) and puts the original back on exit. The
setting (``gated_delta_rule`` in the training config):

- ``auto``: transformers' choice; but fla whose forward + backward fails a small probe on this
  device (fla 0.6 + triton 3.6 on Hopper, any fla on a CPU) is replaced by the torch function.
  Beside fla's rule, the layers' causal convolution is fla's too (where transformers would run
  its grouped ``conv1d`` fallback) when it passes its own probe against that fallback
  (``HOBSON_FLA_CONV=0``: transformers' convolution regardless).
- ``torch``: the reference torch function.
- ``compiled``: the reference torch function under ``torch.compile``.

Every call goes through a counter, so :attr:`KernelChoice.calls` proves the layers ran the path
the choice names. A torso without such layers is left alone (the context yields ``None``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hobson.decider.config import GATED_DELTA_RULES
from hobson.errors import ConfigError

FUNCTION = "torch_chunk_gated_delta_rule"  # the name each Gated DeltaNet layer calls
CONV = "causal_conv1d_fn"  # the depthwise conv's dispatch (causal-conv1d or torch; fla's beside fla's rule)


@dataclass
class KernelChoice:
    """What :func:`select_gated_delta_rule` chose; ``calls`` counts the layers' calls since."""

    setting: str  # auto | torch | compiled
    chunk_gated_delta_rule: str  # "fla" or "torch": what the layers call
    compiled: bool  # the torch function runs under torch.compile
    causal_conv1d: str  # "causal_conv1d" or "torch" (transformers' choice), or "fla" (with fla's rule)
    fla_backward_error: str | None = None  # auto: why fla was not used, when it imports but fails
    fla_conv_error: str | None = None  # why fla's convolution was not used beside its rule
    compile_backend: str | None = None
    calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gated_deltanet_modules(model: torch.nn.Module) -> list[ModuleType]:
    """The modeling modules whose layers in ``model`` call the chunked rule by name (none for other models)."""
    names = set()
    for layer in model.modules():
        forward = inspect.unwrap(type(layer).forward)  # past transformers' decorators, to the code itself
        if FUNCTION in getattr(getattr(forward, "__code__", None), "co_names", ()):
            names.add(type(layer).__module__)
    return [sys.modules[n] for n in sorted(names) if hasattr(sys.modules.get(n), FUNCTION)]


def _dispatch_function(obj: Any) -> Any:
    """transformers' dispatch wrapper itself. With the ``kernels`` package installed (transformers
    5.25 requires it), a modeling module holds the wrapper inside a ``Func`` module
    (``kernels._internals.layer._create_func_module``) whose forward calls it as ``func``; without
    it, the module holds the wrapper."""
    if isinstance(obj, torch.nn.Module):
        try:
            inner = inspect.getclosurevars(type(obj).forward).nonlocals.get("func")
        except (TypeError, ValueError):
            inner = None
        if inner is not None:
            return inner
    return obj


def _implementation(dispatch: Callable) -> Callable | None:
    """The kernel transformers' dispatch wrapper calls (its closure's ``implementation``), or None."""
    fn: Callable | None = dispatch
    while fn is not None:
        try:
            found = inspect.getclosurevars(fn).nonlocals.get("implementation")
        except (TypeError, ValueError):
            found = None
        if found is not None:
            return found
        fn = getattr(fn, "__wrapped__", None)
    return None


def _kernel_name(impl: Callable | None, torch_fn: Callable) -> str:
    if impl is None or impl is torch_fn:
        return "torch"
    return (getattr(impl, "__module__", "") or "unknown").split(".")[0]


def probe_backward(fn: Callable, device: torch.device | str) -> str | None:
    """None when a small chunked gated-delta-rule forward + backward runs on ``device``, else the error."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, 128, 2, 64)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        with torch.enable_grad():  # whatever mode the caller is in: the backward is what is probed
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
            decay = -torch.rand(shape[:3], device=device, generator=g)
            beta = torch.rand(shape[:3], device=device, dtype=dtype, generator=g)
            out = fn(q, k, v, g=decay, beta=beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=True)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # a kernel fault surfaces here, not later in training
        return None
    except Exception as e:  # any failure means: do not train on it
        return f"{type(e).__name__}: {str(e)[:300]}"


def fla_causal_conv1d() -> Callable | None:
    """fla's causal depthwise convolution (triton, forward and backward) in the call shape of
    transformers' ``causal_conv1d_fn`` (``(B, D, T)`` in and out; positional ``hidden_states`` as
    transformers >= 5.25 calls it, ``x=`` as earlier versions' layers call theirs); None without fla.

    transformers takes its fast path only from the ``causal_conv1d`` package (a CUDA build, not on
    the GPU image), else a grouped ``conv1d`` whose kernels took 7.5% of a Qwen3.5 step.
    """
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # no fla, or one that does not import here
        return None

    def conv(hidden_states: torch.Tensor | None = None, weight: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, activation: str | None = None, x: torch.Tensor | None = None,
             **kwargs: Any) -> torch.Tensor:
        h = hidden_states if hidden_states is not None else x
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError("packed sequences reached the causal convolution; hobson pads rows")
        # the layer transposed (B, T, D) to (B, D, T) for this call: back to fla's layout, a view
        y, _ = causal_conv1d(h.transpose(1, 2).contiguous(), weight, bias, activation=activation)
        return y.transpose(1, 2)

    return conv


def torch_causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        activation: str | None = None) -> torch.Tensor:
    """transformers' fallback: a grouped ``conv1d`` padded on the left, then the activation."""
    T = hidden_states.shape[-1]
    out = torch.nn.functional.conv1d(hidden_states.to(weight.dtype), weight.unsqueeze(1), bias,
                                     padding=weight.shape[-1] - 1, groups=hidden_states.shape[1])[..., :T]
    if activation is not None:
        out = torch.nn.functional.silu(out)
    return out.to(hidden_states.dtype)


def probe_conv(fn: Callable, device: torch.device | str, reference: Callable = torch_causal_conv1d) -> str | None:
    """None when ``fn`` gives ``reference``'s convolution and input gradient on a small bf16 input."""
    g = torch.Generator(device=device).manual_seed(0)
    try:
        with torch.enable_grad():
            x = torch.randn(2, 48, 40, device=device, dtype=torch.bfloat16, generator=g)
            w = torch.randn(48, 4, device=device, dtype=torch.bfloat16, generator=g)
            outs = []
            for f in (fn, reference):
                xi = x.clone().requires_grad_()
                y = f(xi, w, None, activation="silu")
                y.float().pow(2).sum().backward()
                outs.append((y.float(), xi.grad.float()))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
        return None
    except Exception as e:  # any failure means: keep transformers' convolution
        return f"{type(e).__name__}: {str(e)[:300]}"


def _reference(torch_fn: Callable, *, compiled: bool, backend: str) -> Callable:
    """The torch function called as transformers' wrapper calls it (unknown kwargs dropped)."""
    params = frozenset(inspect.signature(torch_fn).parameters)
    fn = torch_fn
    if compiled:
        from hobson.decider.compiling import allow_recompiles

        allow_recompiles()  # one graph per distinct length / grad mode
        fn = torch.compile(torch_fn, backend=backend)

    def reference(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seqlens") is not None:  # the torch function would mix packed rows
            raise ValueError("packed sequences (cu_seqlens) need fla's kernel; set gated_delta_rule: auto")
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})
    return reference


@contextlib.contextmanager
def select_gated_delta_rule(model: torch.nn.Module, setting: str, device: torch.device | str,
                            *, compile_backend: str = "inductor",
                            opaque: bool = False) -> Iterator[KernelChoice | None]:
    """Set the chunked rule ``model``'s Gated DeltaNet layers call, for the block; yields the choice.

    ``opaque``: the call is a graph break for a compiled layer (``compile_layers``): the rule runs
    as this setting says (fla's kernels, or the torch function, itself compiled for ``compiled``)
    and dynamo compiles only the work around it, never tracing into fla's triton code."""
    if setting not in GATED_DELTA_RULES:
        raise ConfigError(f"gated_delta_rule {setting!r} is not one of {', '.join(GATED_DELTA_RULES)}")
    modules = gated_deltanet_modules(model)
    if not modules:
        yield None
        return
    first = _dispatch_function(getattr(modules[0], FUNCTION))
    torch_fn = inspect.unwrap(first)  # functools.wraps: the wrapper's __wrapped__ is the torch function
    kernel = _kernel_name(_implementation(first), torch_fn)
    conv = _dispatch_function(getattr(modules[0], CONV, None))
    choice = KernelChoice(setting=setting, chunk_gated_delta_rule=kernel, compiled=setting == "compiled",
                          causal_conv1d=_kernel_name(_implementation(conv), inspect.unwrap(conv)) if conv else "torch",
                          compile_backend=compile_backend if setting == "compiled" else None)
    if setting == "auto" and kernel != "torch":
        choice.fla_backward_error = probe_backward(first, device)
        if choice.fla_backward_error is not None:
            choice.chunk_gated_delta_rule = "torch"
    if setting != "auto":
        choice.chunk_gated_delta_rule = "torch"
    originals = {m: getattr(m, FUNCTION) for m in modules}
    conv_originals: dict[Any, Any] = {}
    # HOBSON_FLA_CONV=0 keeps transformers' convolution beside fla's rule (a bench's comparison)
    if (choice.chunk_gated_delta_rule == "fla" and choice.causal_conv1d == "torch"
            and os.environ.get("HOBSON_FLA_CONV", "1") != "0"):
        fla_conv = fla_causal_conv1d()
        error = probe_conv(fla_conv, device) if fla_conv is not None else "fla has no causal_conv1d"
        if error is None:
            choice.causal_conv1d = "fla"
            # transformers >= 5.25 looks the name up in its module at call time; earlier versions'
            # layers hold it from their __init__ (None without the causal-conv1d package)
            conv_originals = {m: getattr(m, CONV) for m in modules if hasattr(m, CONV)}
            conv_originals.update({layer: layer.__dict__.get(CONV) for layer in model.modules()
                                   if CONV in vars(layer)})
        else:
            choice.fla_conv_error = error

    def counted(target: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            choice.calls += 1
            return target(*args, **kwargs)
        return call

    try:
        for m, dispatch in originals.items():
            # transformers' own path where it stands (auto, the same numbers as without this context)
            keep = choice.chunk_gated_delta_rule == kernel and not choice.compiled
            target = dispatch if keep else _reference(inspect.unwrap(_dispatch_function(dispatch)),
                                                      compiled=choice.compiled, backend=compile_backend)
            call = counted(target)
            setattr(m, FUNCTION, torch.compiler.disable(call) if opaque else call)
        for owner in conv_originals:
            setattr(owner, CONV, torch.compiler.disable(fla_conv) if opaque else fla_conv)
        yield choice
    finally:
        for m, dispatch in originals.items():
            setattr(m, FUNCTION, dispatch)
        for owner, original in conv_originals.items():
            setattr(owner, CONV, original)


__all__ = ["KernelChoice", "fla_causal_conv1d", "gated_deltanet_modules", "probe_backward", "probe_conv",
           "select_gated_delta_rule", "torch_causal_conv1d"]
