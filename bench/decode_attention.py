"""One decode step's attention at the official head shapes: the kernel's launch choices against SDPA.

    python bench/decode_attention.py --json bench/results/decode_attention-<date>.json [--sweep]

Per layer of a batch-16 decode step, one query token attends over a fixed-capacity KV cache
filled up to ``S - 1`` positions (``S`` = 176, the rollout bench's 128 prompt + 48 new tokens, and
1024, a longer rollout). This times

- ``sdpa``: the path before session 25: ``cache.update`` (two ``index_copy_``) then
  :func:`hobson.models.common.attend` (SDPA over the whole capacity with the key mask);
- ``kernel``: :mod:`hobson.models.decode_attention` with its plan (what the engine runs);
- ``kernel + rope`` (Nanbeige): the same with RoPE inside the kernel, against
  ``rope_qk`` compiled + the kernel (``rope_qk + kernel``): what fusing RoPE saves;
- with ``--sweep``, the cache split over several programs per KV head (``x3``: three, combined by
  a second kernel), other blocks of cache positions, warps, pipeline stages, and ``tl.dot``
  against elementwise products.

Timing: a CUDA graph of one call per layer over that many distinct caches (as in a decode step,
where each layer's cache is read once), replayed; µs per call, the median of 5 replays. GB/s
counts the keys and values read once (``2 × B × Hkv × (S - 1) × D``). Each choice is checked
against the SDPA path (the largest difference relative to the largest output).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import commit, environment, log, write_json

from hobson.models import decode_attention
from hobson.models.common import StaticKVCache, attend, fused_kernels
from hobson.models.nanbeige import rope_cos_sin, rope_qk

B = 16
# (query heads, KV heads, head size, layer applications per decode step, RoPE in the kernel)
SHAPES = {"nanbeige": (48, 8, 128, 44, True), "huginn": (55, 55, 96, 132, False)}
DTYPES = {"nanbeige": (torch.bfloat16, torch.float32), "huginn": (torch.bfloat16,)}


def time_us(fn, layers: int) -> float:
    """Median µs per call of a graph of ``fn(i)`` for every layer ``i``, replayed."""
    for i in range(min(2, layers)):
        fn(i)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        t.record()
        t.synchronize()
        times.append(s.elapsed_time(t) * 1000 / layers)
    del g
    times.sort()
    return times[2]


def sweep_plans(group: int) -> list[decode_attention.Plan]:
    """The cache split over 2-8 programs per KV head (first: a deadline cuts the end of the list);
    blocks of 32-128 positions at 4 or 8 warps and 2-4 stages with ``tl.dot``; the elementwise
    form at small blocks (its (rows × block × half-head) product lives in registers)."""
    out = [decode_attention.Plan(block, warps, stages, True, split)
           for split in (2, 3, 4, 6, 8) for block in (32, 64) for warps in (4, 8) for stages in (2, 3)]
    out += [decode_attention.Plan(block, warps, stages, True)
            for block in (32, 64, 128) for warps in (4, 8) for stages in (2, 3, 4)]
    gp = 1 << (group - 1).bit_length()
    out += [decode_attention.Plan(block, 4, stages, False)
            for block in (16, 32, 64) if gp * block <= 512 for stages in (2, 3)]
    return out


def label(p: decode_attention.Plan) -> str:
    return f"{'dot' if p.dot else 'ew'} b{p.block} w{p.warps} s{p.stages}" + (f" x{p.split}" if p.split > 1 else "")


def run_case(model: str, dtype: torch.dtype, S: int, sweep: bool, deadline: float = float("inf")) -> dict:
    """Every choice for one model, dtype and cache length: µs per call, TB/s, error against SDPA."""
    H, hkv, D, apps, rope = SHAPES[model]
    esize = torch.finfo(dtype).bits // 8
    layers = max(4, min(apps, int(4 * 60e6 // (2 * B * hkv * S * D * esize)) + 1))  # 4× the L2 apart
    cache = StaticKVCache(B, S, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i in range(layers):
        cache.streams[i] = (torch.randn(B, hkv, S, D, device="cuda", dtype=dtype, generator=gen),
                            torch.randn(B, hkv, S, D, device="cuda", dtype=dtype, generator=gen))
    cache.write_pos.fill_(S - 1)
    cache.length = S - 1
    cache.key_mask[:, :S] = True
    cache.prepare(torch.ones(B, 1, dtype=torch.long), B, 1, None)
    mask = cache.mask()
    q = torch.randn(B, H, 1, D, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(B, hkv, 1, D, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(B, hkv, 1, D, device="cuda", dtype=dtype, generator=gen)
    cos, sin = rope_cos_sin(torch.full((B, 1), S - 1, device="cuda"), D, 70_000_000.0)
    G = H // hkv
    base = decode_attention.plan(G, D, dtype)
    nbytes = 2 * B * hkv * (S - 1) * D * esize

    def sdpa(i: int) -> torch.Tensor:
        kb, vb = cache.update(i, k, v)
        return attend(q, kb, vb, mask)

    def kernel(i: int, p: decode_attention.Plan | None = None, with_rope: bool = False) -> torch.Tensor:
        return decode_attention.attend(q, k, v, *cache.streams[i], cache.key_mask, cache._new,
                                       rope=(cos, sin) if with_rope else None, p=p)

    def rope_then_kernel(i: int) -> torch.Tensor:
        qr, kr = rope_qk(q, k, cos, sin)
        return decode_attention.attend(qr, kr, v, *cache.streams[i], cache.key_mask, cache._new)

    choices = [("sdpa", sdpa), (f"kernel ({label(base)})", kernel)]
    if rope:
        choices += [("rope_qk + kernel", rope_then_kernel), ("kernel + rope", lambda i: kernel(i, None, True))]
    if sweep:
        choices += [(label(p), lambda i, p=p: kernel(i, p)) for p in sweep_plans(G) if p != base]
    ref = sdpa(0).float()
    case = {"model": model, "dtype": str(dtype).removeprefix("torch."), "S": S, "layers": layers,
            "bytes": nbytes, "plan": base.__dict__, "times": {}}
    for name, fn in choices:
        if name not in dict(choices[:4]) and time.perf_counter() > deadline:
            case["times"][name] = {"error": "not run: the sweep's deadline had passed"}
            continue
        try:
            with fused_kernels():
                err = float("nan") if "rope" in name else float((fn(0).float() - ref).abs().max() / ref.abs().max())
                us = time_us(fn, layers)
        except Exception as e:  # a launch that fails (registers, shared memory) is reported
            case["times"][name] = {"error": repr(e)[:200]}
            continue
        case["times"][name] = {"us": us, "tb_s": nbytes / us / 1e6, "rel_err": err}
        log(f"  {model} {case['dtype']} S={S} {name}: {us:.2f} us")
    timed = sorted((v["us"], n) for n, v in case["times"].items()
                   if "us" in v and n not in ("sdpa", "rope_qk + kernel", "kernel + rope"))
    case["best"] = timed[0][1] if timed else None
    t = case["times"]
    log(f"{model} {dtype} S={S}: sdpa {t['sdpa'].get('us', 0):.1f} us, kernel "
        f"{t[choices[1][0]].get('us', 0):.1f} us, best {case['best']} {timed[0][0] if timed else 0:.1f} us")
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--lengths", default="176,1024")
    ap.add_argument("--models", default="nanbeige,huginn")
    ap.add_argument("--sweep-deadline", type=float, default=200.0,
                    help="seconds after which no further launch choice is timed (the plan's rows always are)")
    args = ap.parse_args()
    res: dict = {"bench": "decode_attention", "command": ["python", "bench/decode_attention.py", *sys.argv[1:]],
                 "commit": commit(), "machine": environment("cuda"), "batch": B, "cases": []}
    t0 = time.perf_counter()
    for model in args.models.split(","):
        for dtype in DTYPES[model]:
            for S in (int(s) for s in args.lengths.split(",")):
                res["cases"].append(run_case(model, dtype, S, args.sweep, t0 + args.sweep_deadline))
                torch.cuda.empty_cache()
                if args.json:
                    write_json(args.json, res)
    print("\n### Decode attention per layer, batch 16 (µs per call; TB/s of keys and values read)\n")
    print("| model | dtype | S | SDPA path | kernel (plan) | best swept | plan × SDPA | rope_qk + kernel | "
          "kernel + rope | max rel. err |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in res["cases"]:
        t = c["times"]
        plan_name = next(n for n in t if n.startswith("kernel ("))

        def cell(n, t=t):
            v = t.get(n, {})
            return f"{v['us']:.2f} µs, {v['tb_s']:.2f}" if "us" in v else ("error" if v else "")

        errs = [v["rel_err"] for v in t.values() if "rel_err" in v and v["rel_err"] == v["rel_err"]]
        ratio = t["sdpa"]["us"] / t[plan_name]["us"] if "us" in t[plan_name] else float("nan")
        print(f"| {c['model']} | {c['dtype']} | {c['S']} | {cell('sdpa')} | {cell(plan_name)} | "
              f"{c['best']}: {cell(c['best'])} | {ratio:.2f}× | {cell('rope_qk + kernel')} | "
              f"{cell('kernel + rope')} | {max(errs, default=float('nan')):.1e} |")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
