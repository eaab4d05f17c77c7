"""What the bench scripts share: logging, timing, tables, JSON results, and torch.profiler summaries.

Every script runs as ``python bench/<name>.py``, so this folder is ``sys.path[0]`` and ``import
common`` finds this file (nothing edits ``sys.path``). torch is imported inside the functions
that need it: the launcher benchmarks (``submit.py``, ``merge.py``) never load it.

The profiler part (``profiled``, ``summarize``, ``print_summary``; ``bench/recipe_gpu.py train
--profile N`` and ``bench/rl_gpu.py --profile``) gives the few numbers that name a bottleneck:
whether the GPU waits for the host (busy share, kernels per step) or the host waits for the GPU,
and which kernels and host-side ops take the time.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hobson.io import write_json_atomic

if TYPE_CHECKING:
    from torch import nn
    from torch.profiler import profile

T = TypeVar("T")
GiB = 1024 ** 3


# --- logging, results ----------------------------------------------------------------------------
def log(msg: str) -> None:
    """Progress on stderr (stdout is for the tables), stamped with the script and the time."""
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    """A two-column markdown table (figure, value) under a ``###`` title."""
    print(f"\n### {title}\n\n| figure | value |\n| --- | --- |")
    for k, v in rows:
        print(f"| {k} | {v} |")
    sys.stdout.flush()


def write_json(path: str | os.PathLike, result: Any) -> None:
    """The figures, atomically (a reader never sees half a file); values JSON lacks become strings."""
    import json

    write_json_atomic(path, json.loads(json.dumps(result, default=str)))


def commit(root: Path | None = None) -> str | None:
    """``$HOBSON_BENCH_COMMIT`` where set, else the checkout's ``git rev-parse HEAD`` with
    ``+dirty`` where tracked files differ from it, else None. A lent GPU machine's copy carries a
    ``.git`` of the session's first commit beside a newer tree: without the mark its runs were
    recorded as that commit (session 32), with it they say the tree was not that commit."""
    import subprocess

    if os.environ.get("HOBSON_BENCH_COMMIT"):
        return os.environ["HOBSON_BENCH_COMMIT"]
    cwd = root if root is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=30)
        return out.stdout.strip() + ("+dirty" if dirty.returncode != 0 or dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def gib(n: float) -> float:
    return round(n / GiB, 3)


def environment(device: str) -> dict[str, Any]:
    """Versions, date, host CPUs and (CUDA) the GPUs: what a result needs to be compared with another."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                           "host_cpus": os.cpu_count()}
    try:  # which tree's code ran (bench/ab_trees.py runs another commit's src/ beside this one's)
        import hobson

        env["hobson_src"] = str(Path(hobson.__file__).resolve().parent.parent)
    except ImportError:
        env["hobson_src"] = None
    for name in ("transformers", "peft", "triton", "fla", "tilelang", "vllm"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # absent or broken: say so rather than fail the bench
            env[name] = None
    if str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    return env


# --- timing --------------------------------------------------------------------------------------
def sync(device: str) -> None:
    """Wait for the device, so a clock read after it counts the work and not only its launch."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def release(device: str) -> None:
    """Free what the last part left (Python garbage, then CUDA's cached blocks)."""
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def dense_peak(device: str, size: int) -> dict[str, Any]:
    """TFLOP/s of ``A @ B`` on ``size``-square operands: 3 warm-ups, 10 timed (bf16 on CUDA, fp32 on CPU)."""
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    s = time.perf_counter() - start
    del a, b
    return {"size": size, "dtype": str(dtype).replace("torch.", ""), "seconds_10": round(s, 4),
            "tflops": round(10 * 2 * size ** 3 / s / 1e12, 2)}


def timed(fn: Callable[[], T], device: str | None = None) -> tuple[float, T]:
    """``(seconds, fn())`` of one call; with ``device``, the device's work is waited for on both sides."""
    if device:
        sync(device)
    start = time.perf_counter()
    out = fn()
    if device:
        sync(device)
    return time.perf_counter() - start, out


def best(fn: Callable[[], Any], repeat: int, device: str | None = None) -> float:
    """The fastest of ``repeat`` calls, in seconds (the least disturbed by the rest of the machine)."""
    return min(timed(fn, device)[0] for _ in range(repeat))


def best_ms(fn: Callable[[], Any], repeat: int = 3) -> float:
    return 1000 * best(fn, repeat)


# --- torch.profiler ------------------------------------------------------------------------------
# Kernel families by name fragment, first match wins. Enough to tell matmuls from the rest.
FAMILIES = (
    ("triangular solve", ("trsm", "trsv")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "ampere_", "hopper_", "gemv", "dot_kernel")),
    ("attention", ("flash", "fmha", "attention", "efficient_attention")),
    ("convolution", ("conv", "cudnn")),
    ("triton (compiled)", ("triton_",)),
    ("reduction", ("reduce", "softmax", "norm", "cumsum", "scan", "argmax", "sum_")),
    ("copy / cast / cat", ("copy", "cat", "memcpy", "memset", "fill", "index", "gather", "scatter")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


@contextlib.contextmanager
def profiled(device: str) -> Iterator[profile]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
    with profile(activities=acts, record_shapes=False) as prof:
        yield prof


MODULE_RANGE = "module::"
BACKWARD_RANGE = "autograd::engine::evaluate_function: "


@contextlib.contextmanager
def module_ranges(model: nn.Module) -> Iterator[None]:
    """Open a profiler range named for each submodule's class around its forward, so
    :func:`summarize` can say which module's Python issues the host's ops (the step is host-bound:
    the op count is what to cut, and where it comes from is the question)."""
    from torch.autograd.profiler import record_function

    stack: list[Any] = []

    def pre(m: nn.Module, args: Any) -> None:
        r = record_function(MODULE_RANGE + type(m).__name__)
        r.__enter__()
        stack.append(r)

    def post(m: nn.Module, args: Any, out: Any) -> None:
        stack.pop().__exit__(None, None, None)

    handles = [h for m in model.modules()
               for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _owner(event: Any) -> str:
    """The innermost module range, or the autograd node whose backward ran, above a host op."""
    e = event.cpu_parent
    while e is not None:
        if e.name.startswith(MODULE_RANGE):
            return e.name[len(MODULE_RANGE):]
        if e.name.startswith(BACKWARD_RANGE):
            return "backward: " + e.name[len(BACKWARD_RANGE):]
        e = e.cpu_parent
    return "outside modules (loss, optimizer, copies in)"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def kernel_events(events: list[Any]) -> list[Any]:
    """The GPU's kernels and copies among a profile's events. A ``record_function`` range (those of
    :func:`module_ranges`, or torch's own) also shows on the GPU's timeline, as an annotation that
    spans its kernels: counted as a kernel, it counts their time again (session 23's first profile
    read 552 ms of "other" kernels in a 402 ms step)."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and not e.name.startswith(MODULE_RANGE)]


KERNELS_KEPT = 120


def summarize(prof: profile, *, steps: int, wall_s: float, top: int = 30) -> dict[str, Any]:
    """Per-step figures of a profiled window of ``steps`` steps that took ``wall_s`` seconds."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    kernels = kernel_events(events)
    ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    per = max(steps, 1)
    out: dict[str, Any] = {"steps": steps, "wall_ms_per_step": round(wall_s * 1000 / per, 3),
                           "kernels_per_step": round(len(kernels) / per, 1),
                           "aten_ops_per_step": round(len(ops) / per, 1)}
    if kernels:
        spans = [(e.time_range.start, e.time_range.end) for e in kernels]
        total = sum(e - s for s, e in spans)
        busy = _busy_us(spans)
        out["kernel_ms_per_step"] = round(total / 1000 / per, 3)
        out["gpu_busy_ms_per_step"] = round(busy / 1000 / per, 3)
        out["gpu_busy_share"] = round(busy / 1e6 / wall_s, 4) if wall_s > 0 else None
        out["mean_kernel_us"] = round(total / len(kernels), 2)
        fams: dict[str, list[float]] = {}
        names: dict[str, list[float]] = {}
        for e in kernels:
            d = e.time_range.end - e.time_range.start
            fams.setdefault(family(e.name), []).append(d)
            names.setdefault(e.name, []).append(d)
        out["kernel_families"] = sorted(
            ({"family": f, "ms_per_step": round(sum(v) / 1000 / per, 3), "share": round(sum(v) / total, 4),
              "count_per_step": round(len(v) / per, 1)} for f, v in fams.items()),
            key=lambda r: -r["ms_per_step"])
        out["top_kernels"] = [
            {"name": n[:120], "ms_per_step": round(sum(v) / 1000 / per, 3), "share": round(sum(v) / total, 4),
             "count_per_step": round(len(v) / per, 1), "mean_us": round(sum(v) / len(v), 2)}
            for n, v in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]]
        # the JSON keeps the long tail too: the small kernels a step launches by the hundred are
        # what is left to cut once the GEMMs read near the bandwidth
        out["kernels"] = [
            {"name": n[:160], "ms_per_step": round(sum(v) / 1000 / per, 4), "count_per_step": round(len(v) / per, 2),
             "mean_us": round(sum(v) / len(v), 2)}
            for n, v in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:KERNELS_KEPT]]
    self_cpu: dict[str, list[float]] = {}
    for e in ops:
        self_cpu.setdefault(e.name, []).append(e.self_cpu_time_total)
    cpu_total = sum(sum(v) for v in self_cpu.values())
    out["aten_self_cpu_ms_per_step"] = round(cpu_total / 1000 / per, 3)
    # ops Python called (not those an op runs inside itself), by the module or backward node
    owners: dict[str, list[float]] = {}
    for e in ops:
        if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"):
            owners.setdefault(_owner(e), []).append(e.cpu_time_total)
    out["host_ops_by_owner"] = [
        {"owner": n, "ops_per_step": round(len(v) / per, 1), "cpu_ms_per_step": round(sum(v) / 1000 / per, 3)}
        for n, v in sorted(owners.items(), key=lambda kv: -len(kv[1]))[:2 * top]]
    out["top_host_ops"] = [
        {"name": n, "self_cpu_ms_per_step": round(sum(v) / 1000 / per, 3), "count_per_step": round(len(v) / per, 1)}
        for n, v in sorted(self_cpu.items(), key=lambda kv: -sum(kv[1]))[:top]]
    return out


def print_summary(title: str, s: dict[str, Any], file=None) -> None:
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    p(f"\n### profile: {title}\n")
    p("| figure | per step |")
    p("| --- | ---: |")
    p(f"| wall ms | {s['wall_ms_per_step']} |")
    if "gpu_busy_ms_per_step" in s:
        p(f"| GPU busy ms (share of wall) | {s['gpu_busy_ms_per_step']} ({s['gpu_busy_share']:.1%}) |")
        p(f"| kernels (mean µs each) | {s['kernels_per_step']} ({s['mean_kernel_us']}) |")
    p(f"| aten ops (host self ms) | {s['aten_ops_per_step']} ({s['aten_self_cpu_ms_per_step']}) |")
    if s.get("kernel_families"):
        p("\n| kernel family | ms/step | share | kernels/step |")
        p("| --- | ---: | ---: | ---: |")
        for r in s["kernel_families"]:
            p(f"| {r['family']} | {r['ms_per_step']} | {r['share']:.1%} | {r['count_per_step']} |")
        p("\n| kernel | ms/step | share | count/step | mean µs |")
        p("| --- | ---: | ---: | ---: | ---: |")
        for r in s["top_kernels"]:
            p(f"| `{r['name'][:90]}` | {r['ms_per_step']} | {r['share']:.1%} | {r['count_per_step']} "
              f"| {r['mean_us']} |")
    if s.get("host_ops_by_owner"):
        p("\n| ops called from | ops/step | host ms/step (with their inner ops) |")
        p("| --- | ---: | ---: |")
        for r in s["host_ops_by_owner"]:
            p(f"| {r['owner']} | {r['ops_per_step']} | {r['cpu_ms_per_step']} |")
    p("\n| host op | self ms/step | count/step |")
    p("| --- | ---: | ---: |")
    for r in s["top_host_ops"]:
        p(f"| `{r['name']}` | {r['self_cpu_ms_per_step']} | {r['count_per_step']} |")
