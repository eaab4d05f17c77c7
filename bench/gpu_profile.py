"""A torch.profiler window summarised as the few numbers that name a bottleneck.

Used by ``bench/recipe_gpu.py train --profile N`` and ``bench/rl_gpu.py --profile``: the figures
say whether the GPU waits for the host (busy share, kernels per step) or the host waits for the
GPU, and which kernels and host-side ops take the time.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

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
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
    with profile(activities=acts, record_shapes=False) as prof:
        yield prof


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def summarize(prof: profile, *, steps: int, wall_s: float, top: int = 12) -> dict[str, Any]:
    """Per-step figures of a profiled window of ``steps`` steps that took ``wall_s`` seconds."""
    events = list(prof.events())
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
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
    self_cpu: dict[str, list[float]] = {}
    for e in ops:
        self_cpu.setdefault(e.name, []).append(e.self_cpu_time_total)
    cpu_total = sum(sum(v) for v in self_cpu.values())
    out["aten_self_cpu_ms_per_step"] = round(cpu_total / 1000 / per, 3)
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
    p("\n| host op | self ms/step | count/step |")
    p("| --- | ---: | ---: |")
    for r in s["top_host_ops"]:
        p(f"| `{r['name']}` | {r['self_cpu_ms_per_step']} | {r['count_per_step']} |")
