"""Pieces both looped models share: RMSNorm, the KV cache, masked attention, checkpoint files.

Shapes in comments: ``B`` batch, ``T`` new tokens, ``S`` all positions in the cache
(past + new), ``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim, ``E`` model width.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from hobson import tensorfile
from hobson.errors import DataError
from hobson.io import atomic_dir

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class CheckpointError(DataError):
    """A model directory is unreadable or inconsistent; the message names the file and tensor."""


class Linear(nn.Linear):
    """``nn.Linear`` without its default init: providers always initialise or load every weight,
    and skipping it keeps builds of multi-billion-parameter models fast (on meta, too). Inside
    :class:`fused_kernels` a product of at most 16 rows runs :func:`linear`'s decode kernel."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, input: Tensor) -> Tensor:
        if self.bias is None:
            return linear(input, self.weight)
        return nn.functional.linear(input, self.weight, self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without its default init (``normal_`` on meta tensors is slow to trace)."""

    def reset_parameters(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Fused elementwise kernels for decoding on a GPU
#
# A decode step of these models is thousands of tiny elementwise kernels (a Huginn step runs 132
# blocks); under CUDA-graph replay their launch cost is gone but each still costs a few µs of GPU
# time. Inside ``fused_kernels()`` the norm, RoPE and gated-MLP chains run as torch.compile'd
# kernels (one kernel per chain; a decode step's residual add and norms as one Triton program per
# row, hobson.models.rownorm), products of at most 16 rows run a weight-streaming GEMM
# (linear()), and a one-token step's cache write and attention run as one kernel (cache_attend()).
# Only the rollout engine turns it on, on CUDA; training and every CPU path stay eager (the
# engine/trainer log-prob agreement bound covers the rounding). HOBSON_FUSED_KERNELS=0 turns the
# compiled chains off (a failed compile falls back to the eager kernels), HOBSON_SKINNY_GEMM=0 the
# GEMM, HOBSON_DECODE_ATTENTION=0 the attention kernel, HOBSON_ROW_NORMS=0 the row-norm kernel.

_FUSED: dict[str, bool] = {"on": False, "dynamic": False}


class fused_kernels:  # noqa: N801 (a context manager used like a function)
    """``dynamic``: compile for any length (training, where every update's length differs) rather
    than per shape (decoding: a few batch sizes, captured in CUDA graphs)."""

    def __init__(self, on: bool = True, dynamic: bool = False) -> None:
        self.state: dict[str, bool] = {"on": on, "dynamic": dynamic}
        self.prev: dict[str, bool] = {}

    def __enter__(self) -> None:
        self.prev = dict(_FUSED)
        _FUSED.update(self.state)

    def __exit__(self, *exc: object) -> None:
        _FUSED.update(self.prev)


_COMPILED: dict[Any, Any] = {}


def fused_on() -> bool:
    """Whether this code runs inside :class:`fused_kernels` (the rollout engine's decode on a GPU)."""
    return _FUSED["on"]


def checkpointed(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` under activation checkpointing, its recompute in the backward running the
    kernels its forward ran: the backward runs after the caller's ``fused_kernels`` block has
    ended, and an eager recompute of a compiled forward saves other tensors, which torch refuses
    (CheckpointError at the first backward of an RL update on a GPU, 2026-12-04)."""
    from torch.utils.checkpoint import checkpoint

    state = dict(_FUSED)

    def run(*a: Any) -> Any:
        with fused_kernels(on=state["on"], dynamic=state["dynamic"]):
            return fn(*a)

    return checkpoint(run, *args, use_reentrant=False)


def fused(fn: Any) -> Any:
    """``fn``, or its compiled version inside :class:`fused_kernels` (compiled once, lazily)."""

    def call(*args: Any) -> Any:
        if not _FUSED["on"] or os.environ.get("HOBSON_FUSED_KERNELS", "1") == "0":
            return fn(*args)
        key = (fn, _FUSED["dynamic"])
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(fn, dynamic=_FUSED["dynamic"], fullgraph=True)
        try:
            return _COMPILED[key](*args)
        except Exception as e:  # no compiler toolchain on this host, say: the eager kernels are right too
            # a checkpoint's recompute stops itself by raising through the kernels: not a failure
            if _COMPILED[key] is fn or type(e).__name__ == "_StopRecomputationError":
                raise
            warnings.warn(f"torch.compile of {fn.__name__} failed ({e!r}); using eager kernels", stacklevel=2)
            _COMPILED[key] = fn
            return fn(*args)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T``. Inside :class:`fused_kernels`, on CUDA, with at most 16 rows (a decode step
    at batch ≤ 16), the weight-streaming kernel of :mod:`hobson.models.skinny`: cuBLAS's kernels
    for these shapes read the weights at well under the memory bandwidth. Everywhere else (training,
    prefill, CPU) ``torch.nn.functional.linear``, unchanged. The Triton kernels have no backward, so
    a product whose gradient is wanted (an RL update's forward, which runs inside ``fused_kernels``
    too, at ≤ 16 rows for a tiny batch) stays with torch as well."""
    if _FUSED["on"] and x.is_cuda and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        from hobson.models import skinny

        if skinny.usable(x, weight):
            return skinny.linear(x, weight)
        r = skinny.route(x, weight)
        if r is not None:
            return skinny.routed(x, weight, r)
    return nn.functional.linear(x, weight)


@fused
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@fused
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return nn.functional.silu(gate) * up


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(x + y, rms_norm(x + y))``: a residual add and the norm after it, one kernel when fused
    (a decode step's few rows: :mod:`hobson.models.rownorm`; eager: exactly the add then
    :func:`rms_norm`, as the layers wrote them before)."""
    if fused_on():
        from hobson.models import rownorm

        if rownorm.usable(x, y, weight):
            return rownorm.add_norm(x, y, weight, eps)
    return _add_rms_norm(x, y, weight, eps)


@fused
def _add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + y
    return s, rms_norm.__wrapped__(s, weight, eps)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight``, normalised in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class KVCache:
    """Keys and values per attention stream, for incremental decoding.

    A stream is any hashable slot id: Huginn uses one per (recurrence step × core layer) plus one
    per prelude/coda layer; Nanbeige uses ``layer_idx + loop_idx * num_layers``. ``length`` counts
    the positions already stored (the same in every stream); ``key_mask`` ``(B, length)`` marks
    keys that may be attended to (None: all). ``meta`` holds model facts a cache must keep
    constant (e.g. Huginn's recurrence depth).
    """

    def __init__(self) -> None:
        self.streams: dict[Any, tuple[Tensor, Tensor]] = {}
        self.length = 0
        self.key_mask: Tensor | None = None
        self.meta: dict[str, Any] = {}

    def update(self, slot: Any, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``, ``v`` ``(B, Hkv, T, D)`` to ``slot``; return the whole stream ``(B, Hkv, S, D)``."""
        if slot in self.streams:
            pk, pv = self.streams[slot]
            if pk.shape[2] != self.length:
                raise RuntimeError(f"KV stream {slot!r} holds {pk.shape[2]} positions, cache has {self.length}")
            k = torch.cat([pk, k], dim=2)
            v = torch.cat([pv, v], dim=2)
        elif self.length:
            raise RuntimeError(f"KV stream {slot!r} is new but the cache already holds {self.length} positions")
        self.streams[slot] = (k, v)
        return k, v

    def check_meta(self, **facts: Any) -> None:
        """Record ``facts`` on first use; later calls must repeat the same values."""
        for key, value in facts.items():
            if key in self.meta and self.meta[key] != value:
                raise ValueError(f"cache was filled with {key}={self.meta[key]!r}, this call uses {value!r}")
            self.meta[key] = value


class StaticKVCache:
    """A KV cache of fixed capacity whose every index lives on the device, for CUDA-graph decoding.

    Each stream is one preallocated ``(B, Hkv, capacity, D)`` buffer pair; a forward writes its
    ``T`` new keys at ``write_pos .. write_pos+T`` (``write_pos`` a device tensor) and attends over
    the whole capacity under ``key_mask`` ``(B, capacity)``. Nothing in a forward reads a Python
    number that changes between decode steps, so one captured step replays for every later step:
    the caller only advances ``write_pos`` and the step's input buffers. Slots never written are
    masked, so the result equals attending over the filled prefix (the masked keys get weight 0).
    """

    def __init__(self, batch: int, capacity: int, device: str | torch.device) -> None:
        self.batch = batch
        self.capacity = capacity
        self.device = torch.device(device)
        self.streams: dict[Any, tuple[Tensor, Tensor]] = {}
        self.length = 0  # host-side count, for checks outside graph replay
        self.write_pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.meta: dict[str, Any] = {}
        self._new: Tensor | None = None  # this forward's write indices (T,)
        self._mask: Tensor | None = None  # this forward's attention mask, once a layer asked for it

    check_meta = KVCache.check_meta

    def reserve(self, new: int) -> None:
        if self.length + new > self.capacity:
            raise ValueError(f"KV cache of capacity {self.capacity} cannot take {new} more after {self.length}")

    def update(self, slot: Any, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` ``(B, Hkv, T, D)`` at the current positions; return the full buffers."""
        if slot not in self.streams:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.streams[slot] = (k.new_zeros(shape), v.new_zeros(shape))
        kb, vb = self.streams[slot]
        kb.index_copy_(2, self._new, k)
        vb.index_copy_(2, self._new, v)
        return kb, vb

    def prepare(
        self, attention_mask: Tensor | None, batch: int, new: int, position_ids: Tensor | None
    ) -> Tensor:
        """Positions ``(B, T)`` of one forward; its new keys are marked live (or not) in ``key_mask``."""
        self.reserve(new)  # host numbers only (a graph replay moves write_pos, not this check)
        dev = self.device
        idx = self.write_pos + torch.arange(new, device=dev)  # (T,) cache slots of the new tokens
        self._new = idx
        self._mask = None
        live = (
            torch.ones(batch, new, dtype=torch.bool, device=dev)
            if attention_mask is None
            else attention_mask.to(device=dev, dtype=torch.bool)
        )
        self.key_mask.index_copy_(1, idx, live)
        return idx.expand(batch, new) if position_ids is None else position_ids.to(dev)

    def mask(self) -> Tensor:
        """This forward's bool mask ``(B, 1, T, capacity)`` (True = may attend), built when a layer
        first asks: the engine's decode step reads ``key_mask`` in its attention kernel instead, and
        a step whose every layer does so launches none of the mask's kernels."""
        if self._mask is None:
            idx = self._new
            k_idx = torch.arange(self.capacity, device=self.device)[None, :]
            causal = k_idx <= idx[:, None]  # (T, S)
            self._mask = (causal[None] & (self.key_mask[:, None, :] | (k_idx == idx[:, None])[None]))[:, None]
        return self._mask

    def advance(self, new: int) -> None:
        self.write_pos.add_(new)
        self.length += new

    def reset(self) -> None:
        """Empty, for a new prompt batch; the buffers stay where they are (a captured decode graph
        reads them). Old keys need no clearing: every slot below the write position is rewritten
        before it is attended to, and the causal mask hides the rest."""
        self.write_pos.zero_()
        self.key_mask.zero_()
        self.length = 0
        self.meta.clear()


def prepare_attention(
    cache: KVCache | None,
    attention_mask: Tensor | None,
    batch: int,
    new: int,
    device: torch.device,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Positions of the new tokens and the attention mask for one forward.

    ``attention_mask`` ``(B, T)``: 1 for real new tokens, 0 for padding (None: all real). Returns
    ``(positions (B, T), attn_mask, key_mask)``: ``attn_mask`` is a bool ``(B, 1, T, S)`` (True =
    may attend) or None for a plain causal prefill or a fixed-capacity cache (whose
    :meth:`StaticKVCache.mask` :func:`cache_attend` asks for), and ``key_mask`` ``(B, S)`` the mask
    to store in the cache. A query always sees itself, so a padded query never has an empty row (no NaN).
    """
    if isinstance(cache, StaticKVCache):  # its mask comes from cache.mask(), when a layer needs it
        return cache.prepare(attention_mask, batch, new, position_ids), None, cache.key_mask
    past = cache.length if cache is not None else 0
    if position_ids is None:
        positions = torch.arange(past, past + new, device=device).expand(batch, new)
    else:
        positions = position_ids.to(device)
    key_mask = None
    if attention_mask is not None or (cache is not None and cache.key_mask is not None):
        old = cache.key_mask if cache is not None and cache.key_mask is not None else None
        if old is None:
            old = torch.ones(batch, past, dtype=torch.bool, device=device)
        cur = (
            torch.ones(batch, new, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.bool)
        )
        key_mask = torch.cat([old, cur], dim=1)
    if past == 0 and key_mask is None:
        return positions, None, None
    q_idx = torch.arange(past, past + new, device=device)[:, None]
    k_idx = torch.arange(past + new, device=device)[None, :]
    causal = k_idx <= q_idx  # (T, S)
    if key_mask is None:
        return positions, causal[None, None], None
    allowed = causal[None] & (key_mask[:, None, :] | (k_idx == q_idx)[None])
    return positions, allowed[:, None], key_mask


def finish_step(cache: KVCache | None, new: int, key_mask: Tensor | None) -> None:
    """Advance the cache by ``new`` positions once every stream has been updated."""
    if isinstance(cache, StaticKVCache):
        cache.advance(new)
    elif cache is not None:
        cache.length += new
        cache.key_mask = key_mask


class CachedDecoding:
    """``prefill`` and ``decode_step`` (what the rollout engines call) over a model whose forward
    takes ``cache=``: the same two methods for Huginn, Nanbeige and the transformers wrapper. Mixed
    in before ``nn.Module``."""

    def prefill(self, input_ids: Tensor, cache: Any, **kwargs: Any) -> Tensor:
        """Run the prompt ``(B, T)`` into an empty ``cache``; returns the output for every position."""
        if cache.length:
            raise ValueError("prefill needs an empty cache")
        return self(input_ids, cache=cache, **kwargs)

    def decode_step(self, token_ids: Tensor, cache: Any, **kwargs: Any) -> Tensor:
        """Append one token per row ``(B,)``; returns the output for that position ``(B, V)`` or ``(B,)``."""
        return self(token_ids.view(-1, 1), cache=cache, **kwargs)[:, -1]


def decode_streams(cache: KVCache | StaticKVCache | None, slot: Any, q: Tensor) -> tuple[Tensor, Tensor] | None:
    """The cache tensors of ``slot`` when this attention runs as the one-kernel decode step
    (:mod:`hobson.models.decode_attention`): inside :class:`fused_kernels`, on CUDA, one token, a
    fixed-capacity cache, the kernel switched on and able to take these shapes. None otherwise."""
    if not (_FUSED["on"] and q.is_cuda and isinstance(cache, StaticKVCache) and slot in cache.streams
            and cache._new is not None and cache._new.numel() == 1):
        return None
    from hobson.models import decode_attention

    kb, vb = cache.streams[slot]
    return (kb, vb) if decode_attention.enabled() and decode_attention.usable(q, kb) else None


def cache_attend(
    cache: KVCache | StaticKVCache | None, slot: Any, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None
) -> Tensor:
    """Store this forward's ``k``, ``v`` in ``cache`` (if any) and attend ``q`` over the cache.

    A decode step of the engine (:func:`decode_streams`) does both in one kernel per layer;
    everything else writes with ``cache.update`` and attends with :func:`attend`, as before.
    """
    if cache is None:
        return attend(q, k, v, attn_mask)
    streams = decode_streams(cache, slot, q)
    if streams is not None:
        from hobson.models import decode_attention

        return decode_attention.attend(q, k, v, *streams, cache.key_mask, cache._new)
    if isinstance(cache, StaticKVCache):
        attn_mask = cache.mask()
    k, v = cache.update(slot, k, v)
    return attend(q, k, v, attn_mask)


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention ``(B, H, T, D) × (B, Hkv, S, D) -> (B, H, T, D)``.

    GQA: a decode step (``T == 1``) folds the ``H / Hkv`` query heads of each KV head into query
    rows of it, so the cache is read where it lies; other calls repeat K and V. Repeating in a
    decode step copied the whole KV cache twice per layer, 30% of the GPU time of a Nanbeige
    decode step on an H200 (``bench/rl_gpu.py --profile``).
    """
    # the fold reuses one mask row for every folded head: only a mask shared across heads allows it
    if k.shape[1] != q.shape[1] and q.shape[2] == 1 and attn_mask is not None and attn_mask.shape[1] == 1:
        B, H, _, D = q.shape
        hkv = k.shape[1]
        rows = q.reshape(B, hkv, H // hkv, D)
        mask = attn_mask.expand(attn_mask.shape[0], attn_mask.shape[1], H // hkv, attn_mask.shape[-1])
        return torch.nn.functional.scaled_dot_product_attention(rows, k, v, attn_mask=mask).reshape(B, H, 1, D)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if attn_mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def generator_normal_(tensors: Iterable[tuple[Tensor, float]], seed: int) -> None:
    """Fill each ``(tensor, std)`` with N(0, std²) from one CPU generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t, std in tensors:
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std)


# ---------------------------------------------------------------------------------------------
# Checkpoint directories (HF layout: config.json + model.safetensors or shards + index)


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / CONFIG_FILE
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a model directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None


class SafetensorsDir:
    """The tensors of a model directory by name: ``model.safetensors`` or shards with an index."""

    def __init__(self, model_dir: str | os.PathLike, tensors: dict[str, Tensor] | None = None) -> None:
        self.dir = Path(model_dir)
        # tensors already read from these files (a verified publication): served instead of a re-read
        self._preloaded = tensors or {}
        self._handles: dict[Path, Any] = {}
        index = self.dir / INDEX_FILE
        single = self.dir / SINGLE_FILE
        self.files: dict[str, Path] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            for name, fname in weight_map.items():
                self.files[name] = self.dir / fname
            for path in sorted(set(self.files.values())):
                if not path.exists():
                    raise CheckpointError(f"{index}: names shard {path.name}, which is missing")
                with _open_safetensors(path) as f:
                    stored = set(f.keys())
                listed = {n for n, p in self.files.items() if p == path}
                if listed - stored:
                    raise CheckpointError(f"{path}: lacks {sorted(listed - stored)[:5]} that {index.name} lists")
        elif single.exists():
            with _open_safetensors(single) as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            raise CheckpointError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}")

    @classmethod
    def of_tensors(cls, where: str | os.PathLike, tensors: dict[str, Tensor]) -> SafetensorsDir:
        """Tensors that arrived without files (a weight transport); ``where`` names them in errors."""
        self = cls.__new__(cls)
        self.dir = Path(where)
        self._preloaded = dict(tensors)
        self._handles = {}
        self.files = dict.fromkeys(tensors, self.dir)
        return self

    def names(self) -> list[str]:
        return sorted(self.files)

    def path(self, name: str) -> Path:
        return self.files[name]

    def get(self, name: str) -> Tensor:
        if name in self._preloaded:
            return self._preloaded[name]
        return self._handle(self.files[name]).get_tensor(name)

    def _handle(self, path: Path) -> Any:
        # one memory map per shard, not one per tensor
        if path not in self._handles:
            self._handles[path] = _open_safetensors(path)
        return self._handles[path]

    def shape(self, name: str) -> list[int]:
        if name in self._preloaded:
            return list(self._preloaded[name].shape)
        return list(self._handle(self.files[name]).get_slice(name).get_shape())


def _open_safetensors(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, OSError: a truncated, empty or foreign file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it is truncated or damaged: "
                              "copy it again from its source, or write the model again") from None


def check_names(ckpt: SafetensorsDir, expected: set[str], optional: set[str] = frozenset()) -> None:
    """Refuse a checkpoint whose tensor names differ from the model's, naming the differences."""
    have = set(ckpt.names())
    missing = sorted(expected - have - optional)
    unexpected = sorted(have - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}")
        hint = ""
        if unexpected and len(missing) > len(expected) / 2:  # little in common: another architecture's weights
            hint = ("; most names differ, so these weights are of another architecture than config.json's "
                    "model_type: pass a directory whose config.json and weights belong together")
        raise CheckpointError(f"{ckpt.dir}: names do not match the model: {'; '.join(parts)}{hint}")


def copy_into(model: nn.Module, ckpt: SafetensorsDir, names: Iterable[str]) -> None:
    """Copy checkpoint tensors into the model's parameters/buffers of the same name (cast to their dtype)."""
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in names:
            target = state[name]
            src = ckpt.get(name)
            if list(src.shape) != list(target.shape):
                raise CheckpointError(
                    f"{ckpt.path(name)}: {name} has shape {list(src.shape)}, the config implies {list(target.shape)}"
                )
            target.copy_(src.to(target.dtype))


def write_checkpoint(
    out_dir: str | os.PathLike,
    tensors: dict[str, Tensor],
    config: dict[str, Any],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write ``config.json`` and the tensors (one file, or shards + index) atomically as a directory.

    Everything goes to a temporary sibling directory that is renamed to ``out_dir`` at the end,
    so a failure leaves no partial directory. ``out_dir`` must not exist or be empty. Tensors
    are written in name order; shard names follow HF (``model-00001-of-00002.safetensors``).
    Returns the written files.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty directory; refusing to overwrite")
    with atomic_dir(out) as tmp:  # out is absent or empty (checked above)
        names = sorted(tensors)
        shards: list[list[str]] = [[]]
        size = 0
        for name in names:
            nbytes = tensors[name].numel() * tensors[name].element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        written = []
        if len(shards) == 1:
            files = [SINGLE_FILE]
        else:
            files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for fname, shard in zip(files, shards, strict=True):
            # threaded pwrites (hobson.tensorfile): a 16.7 GB publication is written on every update
            tensorfile.save({n: tensors[n] for n in shard}, tmp / fname, metadata={"format": "pt"})
            written.append(out / fname)
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {n: f for f, shard in zip(files, shards, strict=True) for n in shard}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            written.append(out / INDEX_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(out / CONFIG_FILE)
    return sorted(written)


DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_from_name(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    for dtype, n in DTYPE_NAMES.items():
        if n == name:
            return dtype
    raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPE_NAMES.values())}")
