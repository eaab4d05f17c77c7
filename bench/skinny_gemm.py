"""Batch-16 decode GEMMs at the official projection shapes: achieved bandwidth per kernel choice.

    python bench/skinny_gemm.py --json bench/results/skinny_gemm-2026-12-02.json [--sweep]

A decode step at batch 16 multiplies 16 rows by each weight ``N × K`` once: the weight's bytes set
the time. For every projection of Nanbeige4.2-3B and Huginn-0125 (shapes read from the official
configs in ``tests/fixtures/official-models``), in the decode dtype (bf16) and the RL precision
(Nanbeige fp32, Huginn fp16), this times

- ``cublas``: ``torch.nn.functional.linear`` as the engine ran it (cuBLAS's default choice);
- ``cublaslt``: the same under ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``cublas swapped`` / ``cublaslt swapped``: ``(w @ x.T).T``, the operands' roles exchanged (and the
  result copied to rows, as the engine needs it);
- ``triton``: :mod:`hobson.models.skinny` with its fixed plan (what the engine now runs);
- with ``--sweep``, the best of a few other tile/split choices for the same kernel (16-bit only).

Timing: a CUDA graph of back-to-back products over enough copies of the weight that none stays in
the 60 MB L2 (as in a decode step, where each weight is read once), replayed; the median of 5.
GB/s counts the weight, the 16 input rows and the output once each; "% peak" is against the
device-to-device copy measured first (bytes read + written) and against the datasheet's 4.8 TB/s.
Each choice is checked against a float64 product of the same inputs (relative Frobenius error),
and the Triton kernel twice on the same inputs for bit-identical output.
The last table sums the shapes over one decode step of each model (44 layer applications plus
the LM head for Nanbeige; 4 + 32 × 4 blocks, 33 adapter halves and the LM head for Huginn).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import commit, environment, log, write_json

from hobson.models import skinny

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "official-models"
DATASHEET_TBS = 4.8
ROWS = 16
L2_BYTES = 60e6


def shapes() -> dict[str, list[tuple[str, int, int, int]]]:
    """Per model: (name, N, K, uses per decode step), as the engine runs them (stacked q/k/v, gate/up)."""
    nb = json.loads((FIXTURES / "nanbeige4.2-3b.config.json").read_text())
    hg = json.loads((FIXTURES / "huginn-0125.config.json").read_text())
    e, heads, kv, hd = nb["hidden_size"], nb["num_attention_heads"], nb["num_key_value_heads"], nb["head_dim"]
    apps = nb["num_hidden_layers"] * nb["num_loops"]
    nan = [
        ("q|k|v", (heads + 2 * kv) * hd, e, apps),
        ("o", e, heads * hd, apps),
        ("gate|up", 2 * nb["intermediate_size"], e, apps),
        ("down", e, nb["intermediate_size"], apps),
        ("lm_head", nb["vocab_size"], e, 1),
    ]
    E, inter, r = hg["n_embd"], hg["intermediate_size"], hg["mean_recurrence"]
    blocks = hg["n_layers_in_prelude"] + hg["n_layers_in_coda"] + r * hg["n_layers_in_recurrent_block"]
    hug = [
        ("Wqkv", 3 * E, E, blocks),
        ("attn.proj", E, E, blocks),
        ("mlp.fc", 2 * inter, E, blocks),
        ("mlp.proj", E, inter, blocks),
        # adapter(cat([s, e])) = W_s·s + (W_e·e + b): the state's half in each recurrence step, the
        # injected half once per forward (HuginnRaven.injected), each an E × E product
        ("adapter", E, E, r + 1),
        ("lm_head", hg["vocab_size"], E, 1),
    ]
    return {"nanbeige": nan, "huginn": hug}


def copy_tbs() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (TB/s), median of 10."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        t.record()
        t.synchronize()
        times.append(s.elapsed_time(t) / 1000)
    times.sort()
    return 2 * a.numel() / times[len(times) // 2] / 1e12


def time_us(fn, ws: list[torch.Tensor], x: torch.Tensor) -> float:
    """Median µs per product: a graph of products over the rotating weights ``ws``, replayed."""
    for w in ws[:2]:
        fn(x, w)  # compile / pick algorithms outside the capture
    torch.cuda.synchronize()
    reps = max(1, 24 // len(ws))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for w in ws:
                fn(x, w)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        t.record()
        t.synchronize()
        times.append(s.elapsed_time(t) * 1000 / (reps * len(ws)))
    del g
    times.sort()
    return times[2]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("nan")
    return float((y.double() - ref).norm() / ref.norm())


def cublas(x, w):
    return torch.nn.functional.linear(x, w)


def swapped(x, w):
    """The same product asked for as ``(w @ x.T).T``: cuBLAS sees 16 as its M, not its N, and picks
    from other kernels; then made contiguous, as the engine's route does (the layers need it)."""
    return torch.mm(w, x.T).T.contiguous()


def sweep_plans(k: int, base: skinny.Plan, dtype: torch.dtype) -> list[skinny.Plan]:
    """16-bit: other tiles (64 or 128 weight rows) and K splits at the plan's depth; the plan's tile
    at other pipeline depths and with 32 rows. fp32: tiles and splits in 3xTF32, and the plan's
    tile in the other fp32-accurate products (bf16x6, plain FMAs)."""
    out = [skinny.Plan(bn, base.block_k, split, base.warps, base.stages)
           for bn in (64, 128) for split in (1, 2, 4, 8, 16) if k // split >= 2 * base.block_k]
    if dtype == torch.float32:
        out += [skinny.Plan(base.block_n, base.block_k, base.split, base.warps, base.stages, prec)
                for prec in ("bf16x6", "ieee")]
    else:
        out += [skinny.Plan(base.block_n, base.block_k, base.split, base.warps, st) for st in (3, 6)]
        out.append(skinny.Plan(32, base.block_k, base.split, base.warps, base.stages))
    return [p for p in out if p != base]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--sweep", action="store_true", help="also time other tile/split choices (16-bit)")
    p.add_argument("--models", default="nanbeige,huginn")
    p.add_argument("--dtypes", default="bfloat16,float32,float16",
                   help="of each model's decode dtype (bf16) and RL precision (Nanbeige fp32, Huginn fp16)")
    p.add_argument("--sweep-deadline", type=float, default=240.0, help="seconds after which no shape is swept")
    args = p.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = copy_tbs()
    log(f"copy {peak:.2f} TB/s; {sms} SMs")
    res: dict = {"bench": "skinny_gemm", "command": ["python", "bench/skinny_gemm.py", *sys.argv[1:]],
                 "commit": commit(), "machine": environment("cuda"), "copy_tbs": peak,
                 "datasheet_tbs": DATASHEET_TBS, "rows": ROWS, "shapes": []}
    dtypes = {"nanbeige": (torch.bfloat16, torch.float32), "huginn": (torch.bfloat16, torch.float16)}
    t_start = time.perf_counter()
    for model, rows in shapes().items():
        if model not in args.models.split(","):
            continue
        for dtype in dtypes[model]:
            if str(dtype).removeprefix("torch.") not in args.dtypes.split(","):
                continue
            for name, n, k, uses in rows:
                esize = torch.finfo(dtype).bits // 8
                wbytes = n * k * esize
                copies = max(2, int(4 * L2_BYTES // wbytes) + 1)
                ws = [torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(copies)]
                x = torch.randn(ROWS, k, device="cuda", dtype=dtype)
                ref = x.double() @ ws[0].double().T
                nbytes = wbytes + (ROWS * k + ROWS * n) * esize
                plan = skinny.tile_plan(n, k, dtype, sms)
                engine_runs = "triton" if skinny.plan(n, k, dtype, sms) else "cublas"
                entry = {"model": model, "name": name, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."),
                         "uses_per_step": uses, "bytes": nbytes, "plan": plan.__dict__, "engine_runs": engine_runs,
                         "kernels": {}}
                choices = [("cublas", cublas, None)]
                choices.append(("cublaslt", cublas, "cublaslt"))
                choices.append(("cublas swapped", swapped, None))
                choices.append(("cublaslt swapped", swapped, "cublaslt"))
                choices.append(("triton", lambda x, w, pl=plan: skinny.linear(x, w, pl), None))
                # not fp16: it runs bf16's code; stop sweeping past the deadline (compiles cost ~1 s each)
                if args.sweep and dtype != torch.float16 and time.perf_counter() - t_start < args.sweep_deadline:
                    for sp in sweep_plans(k, plan, dtype):
                        prec = f" {sp.precision}" if dtype == torch.float32 else ""
                        choices.append((f"triton {sp.block_n}x{sp.block_k} s{sp.split} st{sp.stages}{prec}",
                                        lambda x, w, pl=sp: skinny.linear(x, w, pl), None))
                for label, fn, lib in choices:
                    prev = torch.backends.cuda.preferred_blas_library()
                    if lib:
                        torch.backends.cuda.preferred_blas_library(lib)
                    try:
                        y = fn(x, ws[0])
                        err = rel_err(y, ref)
                        same = bool(torch.equal(y, fn(x, ws[0]))) if label.startswith("triton") else None
                        us = time_us(fn, ws, x)
                    except Exception as e:  # a choice that fails is reported, the others still run
                        entry["kernels"][label] = {"error": repr(e)[:300]}
                        log(f"{model} {name} {dtype} {label}: {e!r}"[:300])
                        continue
                    finally:
                        torch.backends.cuda.preferred_blas_library(prev)
                    gbs = nbytes / us / 1e3
                    entry["kernels"][label] = {"us": us, "gb_s": gbs, "pct_copy": gbs / 1e3 / peak,
                                               "pct_datasheet": gbs / 1e3 / DATASHEET_TBS, "rel_err": err,
                                               "repeat_identical": same}
                timed_triton = [(v["us"], k2) for k2, v in entry["kernels"].items()
                                if "us" in v and k2.startswith("triton")]
                best = min(timed_triton, default=(float("nan"), "triton"))
                entry["best_triton"] = best[1]
                res["shapes"].append(entry)
                del ws
                torch.cuda.empty_cache()
                log(f"{model} {name} {dtype}: " + ", ".join(
                    f"{k2} {v['us']:.1f}us" for k2, v in list(entry["kernels"].items())[:3] if "us" in v)
                    + f"; best {best[1]} {best[0]:.1f}us ({time.perf_counter() - t_start:.0f} s)")
                if args.json:
                    write_json(args.json, res)
    print_tables(res)
    if args.json:
        write_json(args.json, res)


def print_tables(res: dict) -> None:
    peak = res["copy_tbs"]
    gpu = res["machine"].get("gpu")
    print(f"\n### Batch-{ROWS} GEMMs, {gpu}: µs, GB/s, % of the measured copy ({peak:.2f} TB/s) | "
          f"% of {DATASHEET_TBS} TB/s\n")
    print("| model | weight (N × K) | dtype | cuBLAS | cuBLASLt | cuBLAS swapped | cuBLASLt swapped | "
          "Triton (plan) | best Triton swept | cuBLAS / Triton time | rel. err cuBLAS, Triton | "
          "Triton repeat identical | engine runs |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")

    def cell(v: dict | None) -> str:
        if not v or "us" not in v:
            return "error" if v else ""
        return f"{v['us']:.1f} µs, {v['gb_s']:.0f} GB/s, {v['pct_copy']:.0%} \\| {v['pct_datasheet']:.0%}"

    for e in res["shapes"]:
        ks = e["kernels"]
        best = ks.get(e["best_triton"]) if e["best_triton"] != "triton" else None
        ratio = ks["cublas"]["us"] / ks["triton"]["us"] if "us" in ks.get("triton", {}) else float("nan")
        nan = float("nan")
        errs = f"{ks['cublas'].get('rel_err', nan):.1e}, {ks.get('triton', {}).get('rel_err', nan):.1e}"
        same = ks.get("triton", {}).get("repeat_identical")
        print(f"| {e['model']} | {e['name']} {e['n']} × {e['k']} | {e['dtype']} | {cell(ks['cublas'])} | "
              f"{cell(ks.get('cublaslt'))} | {cell(ks.get('cublas swapped'))} | {cell(ks.get('cublaslt swapped'))} | "
              f"{cell(ks.get('triton'))} | "
              f"{(e['best_triton'] + ': ' + cell(best)) if best else '(the plan)'} | {ratio:.2f}× | "
              f"{errs} | {same} | {e.get('engine_runs', '')} |")
    print("\n### One decode step's GEMMs (sum over the shapes × uses per step)\n")
    print("| model | dtype | weight GB per step | cuBLAS ms | cuBLASLt ms | cuBLAS swapped ms | "
          "best of all per shape ms | Triton (plan) ms | floor at the copy speed ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    groups: dict = {}
    for e in res["shapes"]:
        groups.setdefault((e["model"], e["dtype"]), []).append(e)
    res["per_step"] = []
    for (model, dtype), es in groups.items():
        def total(label: str, es=es) -> float:
            return sum(e["uses_per_step"] * e["kernels"].get(label, {}).get("us", float("nan")) for e in es) / 1000

        gb = sum(e["uses_per_step"] * e["bytes"] for e in es) / 1e9
        row = {"model": model, "dtype": dtype, "gb": gb, "cublas_ms": total("cublas"),
               "cublaslt_ms": total("cublaslt"), "swapped_ms": total("cublas swapped"), "triton_ms": total("triton"),
               "best_ms": sum(e["uses_per_step"] * min((v["us"] for v in e["kernels"].values() if "us" in v),
                                                      default=float("nan")) for e in es) / 1000,
               "floor_ms": gb / peak}
        res["per_step"].append(row)
        print(f"| {model} | {dtype} | {gb:.1f} | {row['cublas_ms']:.2f} | {row['cublaslt_ms']:.2f} | "
              f"{row['swapped_ms']:.2f} | {row['best_ms']:.2f} | "
              f"{row['triton_ms']:.2f} | {row['floor_ms']:.2f} |")


if __name__ == "__main__":
    main()
