"""RL on GPUs at the official model shapes (random weights): rollout engine, publication, end to end.

    python bench/rl_gpu.py --kind huginn_raven --work /tmp/rlb --json out.json [--parts rollout,publish,e2e]
    python bench/rl_gpu.py --kind nanbeige --size tiny --device cpu ...        # a quick CPU check

One process per model kind. Each part prints a markdown table and the JSON file is rewritten
after every part (a run cut short keeps what finished):

- ``model``: a random checkpoint of the official config (``tests/fixtures/official-models``),
  drawn on the GPU and written with the official names (Huginn fp16, Nanbeige fp32).
- ``rollout``: generated tokens/s of the native engine (static KV cache, CUDA-graph decode, GPU
  sampling) against plain HF-style generation of the same model, prompts and lengths (growing
  cache, ``torch.multinomial`` sampling, an all-finished check every step: what
  ``transformers.generate`` does) and against the native engine without CUDA graphs; bf16, batch
  16, 128-token prompts, 48 new tokens, T=0.8, no early stop. Prefill tokens/s and ms per decode
  step are split out. For Huginn also a forward+backward with 24 no-grad + 8 grad recurrences on
  16 × 176 tokens, the reference's third figure.
- ``publish``: seconds and GB/s to publish one version (trainer on the first GPU) and to load it
  into the engine (last GPU), against a raw copy of the same safetensors bytes (copy + fsync, the
  same durability the publication gets) and a plain read of them.
- ``e2e``: ``python -m jobs.rl`` per algorithm with one training GPU and one rollout GPU, 3
  updates, the default batch, then ``--stop-after 2`` + ``--resume`` in a fresh process and
  ``verify-resume`` (deterministic mode is on whenever a device is CUDA). Per update: seconds of
  rollout, reward, recompute, optimizer, publication (write, engine load), checkpoint; rollout
  tokens/s; peak memory per GPU. ``--deadline`` stops starting new runs near the time limit.
  ``--via-record``: the full run is reduced to its digests (``verify-resume --record``) and deleted
  before the stopped run starts in its place, which is then compared with the record (two
  official-size Huginn runs do not fit one 64 GiB disk).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
import torch
from common import best, log, release, sync, write_json

from hobson.models import PROVIDERS, tiny_config
from hobson.models.common import KVCache
from hobson.models.logprobs import token_logprobs
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine, forward_kwargs

ROOT = Path(__file__).resolve().parent.parent

FIXTURES = ROOT / "tests" / "fixtures" / "official-models"
OFFICIAL = {"huginn_raven": "huginn-0125.config.json", "nanbeige": "nanbeige4.2-3b.config.json"}
RL_DTYPE = {"huginn_raven": torch.float16, "nanbeige": torch.float32}
RL_PRECISION = {"huginn_raven": "fp16", "nanbeige": "fp32"}
REFERENCE_HUGINN = {"prefill_tok_s": 3163, "decode_tok_s": 69, "decode_ms": 231, "fwd_bwd_tok_s": 2634}
ALGORITHMS = ("grpo", "ppo", "dppo", "flow-dppo")


def config_for(kind: str, size: str):
    if size == "official":
        return PROVIDERS[kind].config(json.loads((FIXTURES / OFFICIAL[kind]).read_text()))
    return tiny_config(kind, **({"block_size": 512} if kind == "huginn_raven" else {}))


def random_model(kind: str, cfg, dtype: torch.dtype, device: str, seed: int = 0):
    """Random weights drawn on ``device`` (the provider's CPU init would take minutes at 4B)."""
    provider = PROVIDERS[kind]
    model = provider._build(cfg, False, dtype, device, seed, init=False)
    std = cfg.init_std if kind == "huginn_raven" else cfg.initializer_range
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
    return model.eval()


def part_model(args, res: dict) -> Path:
    out = Path(args.work) / f"{args.kind}-{args.size}"
    if (out / "config.json").exists():
        return out
    t0 = time.perf_counter()
    cfg = config_for(args.kind, args.size)
    model = random_model(args.kind, cfg, RL_DTYPE[args.kind], args.device)
    PROVIDERS[args.kind].export(model, out, dtype=RL_DTYPE[args.kind])
    n = sum(p.numel() for p in model.parameters())
    del model
    res["model"] = {"dir": str(out), "parameters": n, "seconds": round(time.perf_counter() - t0, 1)}
    log(f"model {out}: {n:,} parameters in {res['model']['seconds']} s")
    return out


# ------------------------------------------------------------------------------------ rollout
def hf_style_generate(model, prompts: torch.Tensor, seeds: list[int], new_tokens: int, temperature: float) -> None:
    """What ``transformers.generate`` does: growing cache, multinomial sampling, a finished check per step."""
    B = prompts.shape[0]
    kw = forward_kwargs(model, seeds)
    cache = KVCache()
    logits = model.prefill(prompts, cache, **kw)[:, -1]
    unfinished = torch.ones(B, dtype=torch.bool, device=prompts.device)
    for _ in range(new_tokens - 1):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1)[:, 0]
        unfinished &= nxt != -1
        if not bool(unfinished.any()):  # the stopping-criteria check HF makes every step
            break
        logits = model.decode_step(nxt, cache, **kw)


@contextlib.contextmanager
def kernels(skinny: bool, attention: bool):
    """The engine's decode kernels on or off: the batch-16 GEMM (off: cuBLAS, as before session 12)
    and the one-kernel decode attention (off: cache writes and SDPA, as before session 25)."""
    flags = {"HOBSON_SKINNY_GEMM": skinny, "HOBSON_DECODE_ATTENTION": attention}
    prev = {k: os.environ.get(k) for k in flags}
    os.environ.update({k: "1" if on else "0" for k, on in flags.items()})
    try:
        yield
    finally:
        for k, v in prev.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def logprob_gap(e: NativeEngine, model, plist: list[list[int]], seeds: list[int], N: int, T: float) -> float:
    """The largest |engine log-prob − trainer log-prob| over one generate's tokens: the trainer's
    forward is the eager full-sequence one (separate projections, torch's GEMMs), as in RL."""
    outs = e.generate(plist, seeds, T, N)
    P = len(plist[0])  # the bench's prompts all have one length, and no row stops early
    ids = torch.tensor([p + c.tokens for p, c in zip(plist, outs, strict=True)], device=e.device)
    if hasattr(model, "fuse_projections"):
        model.fuse_projections(False)  # training never stacks
    try:
        with torch.no_grad():
            logits = model(ids, **forward_kwargs(model, seeds))[:, P - 1 : -1]
            trainer = token_logprobs(logits, ids[:, P:], T).cpu()
    finally:
        if hasattr(model, "fuse_projections"):
            model.fuse_projections(True)
    del logits
    behaviour = torch.tensor([c.logprobs for c in outs])
    return float((trainer - behaviour).abs().max())


def part_rollout(args, res: dict) -> None:
    dev = args.engine_device
    dtype = getattr(torch, args.rollout_dtype)
    cfg = config_for(args.kind, args.size)
    model = random_model(args.kind, cfg, dtype, dev)
    provider = PROVIDERS[args.kind]
    B, P, N, T = args.batch, args.prompt_tokens, args.new_tokens, 0.8
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, cfg.vocab_size, (B, P), generator=g)
    seeds = list(range(B))
    rows = {}

    def engine(graphs: bool, warm_start: bool = True, keep: bool = True) -> NativeEngine:
        e = NativeEngine(provider, dtype=dtype, device=dev, eos_id=-1, pad_id=0, model_revision="bench",
                         engine_revision="bench", cuda_graphs=graphs, warm_start=warm_start, keep_decode=keep)
        e.serve(model, 0, "bench")  # a bench shortcut: no publication needed
        return e

    plist = prompts.tolist()
    gaps = {}
    # the engine as it was before session 12, in the same run: cuBLAS for every decode GEMM (the
    # fp32 kernel off) and an eager first decode step in every generate (no warm start)
    before = "native engine (CUDA graphs), before session 12"
    # and as it was before session 25: the decode graph captured again in every generate (now the
    # engine keeps it for the next generate of the same shape, as a rollout GPU of its own does),
    # and attention through cache writes and SDPA (now one kernel per layer); then the kept graph
    # alone, to tell the two apart
    recapture = "native engine (CUDA graphs), before session 25"
    sdpa = "native engine (CUDA graphs), kept graph, SDPA attention"
    # name: (graphs, warm start, keep the decode, skinny GEMM, decode-attention kernel)
    engines = {"native engine (CUDA graphs)": (True, True, True, True, True),
               recapture: (True, True, False, True, False),
               sdpa: (True, True, True, True, False),
               before: (True, False, False, False, False),
               "native engine (eager)": (False, False, False, False, False)}
    if args.engines != "all":  # a shorter run: the engine now and the HF-style baseline only
        engines = {k: v for k, v in engines.items() if k == "native engine (CUDA graphs)"}
    for name, (graphs, warm, keep, skinny, attention) in engines.items():
        e = engine(graphs, warm_start=warm, keep=keep)
        with kernels(skinny, attention):
            e.generate(plist[:2], seeds[:2], T, 4)  # warm-up
            prefill = best(lambda e=e: e.generate(plist, seeds, T, 1), 2, dev)
            total = best(lambda e=e: e.generate(plist, seeds, T, N), 2, dev)
            rows[name] = {"seconds": total, "prefill_s": prefill}
            if graphs:
                # a generate's decode includes the graph's capture (and before session 12 an eager
                # step); the difference of two lengths is what one more replayed step costs
                half = best(lambda e=e: e.generate(plist, seeds, T, N // 2), 2, dev)
                rows[name]["replay_ms_per_step"] = (total - half) / (N - N // 2) * 1000
                gaps[name] = logprob_gap(e, model, plist, seeds, N, T)
        log(f"{name}: {B * N / total:.1f} tok/s")
    ids = prompts.to(dev)
    if not args.native_only:
        if hasattr(model, "fuse_projections"):
            model.fuse_projections(False)  # the baseline keeps the model's own separate projections
        with torch.no_grad():
            hf_style_generate(model, ids[:2], seeds[:2], 4, T)
            prefill = best(lambda: hf_style_generate(model, ids, seeds, 1, T), 2, dev)
            total = best(lambda: hf_style_generate(model, ids, seeds, N, T), 2, dev)
        rows["plain HF-style generate"] = {"seconds": total, "prefill_s": prefill}
    base = rows.get("plain HF-style generate")
    for r in rows.values():
        decode_ms = (r["seconds"] - r["prefill_s"]) / (N - 1) * 1000
        r.update(
            tokens_per_s=B * N / r["seconds"],
            decode_ms_per_step=decode_ms,
            decode_tokens_per_s=B / (decode_ms / 1000),
            prefill_tokens_per_s=B * P / r["prefill_s"],
        )
        if base is not None:
            r["ratio_vs_hf_style"] = base["seconds"] / r["seconds"]
    out = {"dtype": args.rollout_dtype, "batch": B, "prompt_tokens": P, "new_tokens": N, "engines": rows,
           "engine_vs_trainer_logprob_gap": gaps}
    if args.profile:
        out["profile"] = profile_rollout(engine(True), model, plist, ids, seeds, N, T, dev)
    print(f"\n### rollout: {args.kind} ({args.size}), {args.rollout_dtype}, batch {B}, {P} prompt + {N} new tokens, "
          f"T={T}\n")
    print("| engine | tokens/s | decode ms/step | replayed step ms | decode tok/s | prefill tok/s | × HF-style | "
          "engine − trainer log-prob, max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        replay = f"{r['replay_ms_per_step']:.2f}" if "replay_ms_per_step" in r else ""
        gap = f"{gaps[name]:.1e}" if name in gaps else ""
        hf_ratio = f"{r['ratio_vs_hf_style']:.2f}" if "ratio_vs_hf_style" in r else ""
        print(f"| {name} | {r['tokens_per_s']:.0f} | {r['decode_ms_per_step']:.2f} | {replay} | "
              f"{r['decode_tokens_per_s']:.0f} | {r['prefill_tokens_per_s']:.0f} | {hf_ratio} | "
              f"{gap} |")
    fast = rows["native engine (CUDA graphs)"]
    out["decode_ms_per_step"] = fast["decode_ms_per_step"]
    if before in rows:
        old = rows[before]
        out["vs_before_session_12"] = old["decode_ms_per_step"] / fast["decode_ms_per_step"]
        out["vs_before_session_25"] = rows[recapture]["decode_ms_per_step"] / fast["decode_ms_per_step"]
        out["vs_sdpa_attention"] = rows[sdpa]["decode_ms_per_step"] / fast["decode_ms_per_step"]
        print(f"\nthe engine before session 12 -> now, same run: {old['decode_ms_per_step']:.2f} -> "
              f"{fast['decode_ms_per_step']:.2f} ms/step ({out['vs_before_session_12']:.2f}x); before session 25 "
              f"-> now: {rows[recapture]['decode_ms_per_step']:.2f} -> {fast['decode_ms_per_step']:.2f} ms/step "
              f"({out['vs_before_session_25']:.2f}x), of which the attention kernel "
              f"{rows[sdpa]['decode_ms_per_step']:.2f} -> {fast['decode_ms_per_step']:.2f} "
              f"({out['vs_sdpa_attention']:.2f}x)")
    if args.kind == "huginn_raven":
        ref = REFERENCE_HUGINN
        nat = rows["native engine (CUDA graphs)"]
        out["vs_reference"] = {
            "reference": ref,
            "decode_ratio": nat["decode_tokens_per_s"] / ref["decode_tok_s"],
            "prefill_ratio": nat["prefill_tokens_per_s"] / ref["prefill_tok_s"],
            "floor_ms": weights_floor_ms("huginn") if args.size == "official" and dev.startswith("cuda") else None,
        }
        floor = out["vs_reference"]["floor_ms"]
        print(f"\nreference decode {ref['decode_tok_s']} tok/s ({ref['decode_ms']} ms/step): native "
              f"{nat['decode_tokens_per_s']:.0f} tok/s = {out['vs_reference']['decode_ratio']:.1f}x, "
              f"{nat['decode_ms_per_step']:.1f} ms/step"
              + (f" against {floor:.1f} ms to read a step's weights once at this card's copy speed" if floor else ""))
        if (args.size == "official" or args.fwd_bwd) and not args.native_only:
            out["fwd_bwd"] = huginn_fwd_bwd(model, dev, B, 176)
            print(f"forward+backward 24 no-grad + 8 grad recurrences, {B}x176 tokens: "
                  f"{out['fwd_bwd']['tokens_per_s']:.0f} tok/s (reference {ref['fwd_bwd_tok_s']})")
    res["rollout"] = out
    model = None
    release(dev)


def weights_floor_ms(model: str) -> float:
    """Milliseconds to read one decode step's 16-bit weights once (every GEMM's weight times its uses
    a step: Huginn reads its core block in each of 32 recurrences) at this card's device-to-device
    copy speed: no decode step of this batch can be faster (the datasheet's speed is not reached)."""
    import skinny_gemm

    nbytes = sum(2 * n * k * uses for _, n, k, uses in skinny_gemm.shapes()[model])
    return nbytes / (skinny_gemm.copy_tbs() * 1e12) * 1000


def profile_rollout(e: NativeEngine, model, plist, ids, seeds, N: int, T: float, dev: str) -> dict:
    """Where a generate's time goes (per generated token: one prefill + N - 1 decode steps)."""
    e.generate(plist, seeds, T, N)  # capture the graph outside the window
    out = {}
    for name, fn in (("native engine (CUDA graphs)", lambda: e.generate(plist, seeds, T, N)),
                     ("plain HF-style generate", lambda: hf_style_generate(model, ids, seeds, N, T))):
        sync(dev)
        with torch.no_grad(), common.profiled(dev) as prof:
            t0 = time.perf_counter()
            fn()
            sync(dev)
            wall = time.perf_counter() - t0
        out[name] = common.summarize(prof, steps=N, wall_s=wall)
        common.print_summary(f"rollout, {name}, per generated token ({N} steps incl. prefill)", out[name])
    return out


def huginn_fwd_bwd(model, dev: str, B: int, T: int, latents: str = "drawn", profile: bool = False) -> dict:
    """Seconds and tokens/s of one training forward+backward (24 no-grad + 8 grad recurrences).

    ``latents``: ``drawn`` draws the initial states inside the forward (the host draws 16 x 176
    vectors while the GPU waits), ``given`` passes states drawn beforehand, as the RL update does
    (once per update for all its forwards), and ``given+fused`` also runs the norm and RoPE chains
    as compiled kernels for any length, as the RL update does on a GPU with ``--compiled-chains``.
    """
    import contextlib

    from hobson.models import huginn
    from hobson.models.common import fused_kernels

    model.train()
    ids = torch.randint(1, model.config.vocab_size, (B, T), device=dev)
    seeds = list(range(B))
    steps = min(8, model.config.mean_recurrence)
    given = None
    if latents.startswith("given"):
        given = huginn.initial_state(seeds, torch.arange(T).expand(B, T), model.config.n_embd).to(dev)
    ctx = fused_kernels(dynamic=True) if latents.endswith("+fused") else contextlib.nullcontext()

    def once() -> None:
        if given is None:
            huginn.latent_cache().clear()  # drawn cold, as a forward on new rows would
        logits = model(ids, num_steps_no_grad=model.config.mean_recurrence - steps, num_steps_with_grad=steps,
                       seed=seeds, latent_state=given)
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    with ctx:
        once()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(3):
            once()
        sync(dev)
    secs = (time.perf_counter() - t0) / 3
    out = {"seconds": secs, "tokens_per_s": B * T / secs, "no_grad_steps": model.config.mean_recurrence - steps,
           "grad_steps": steps, "latents": latents}
    if latents == "given":
        # the matmul FLOPs of one forward+backward, counted by torch (eager: the compiled rows run
        # the same products, which a FlopCounterMode cannot see inside a compiled graph)
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            once()
        out["flops"] = counter.get_total_flops()
    if profile:
        with ctx, common.profiled(dev) as prof:
            sync(dev)
            t0 = time.perf_counter()
            once()
            sync(dev)
            wall = time.perf_counter() - t0
        out["profile"] = common.summarize(prof, steps=1, wall_s=wall)
        common.print_summary(f"Huginn forward+backward, latents {latents}", out["profile"])
    model.eval()
    return out


def part_fwd_bwd(args, res: dict) -> None:
    """Huginn's training forward+backward alone, three ways of drawing the latents, against the reference."""
    if args.kind != "huginn_raven":
        raise SystemExit("--parts fwd-bwd is Huginn's (the reference figure is Huginn's)")
    dev = args.engine_device
    model = random_model(args.kind, config_for(args.kind, args.size), getattr(torch, args.rollout_dtype), dev)
    ref = REFERENCE_HUGINN["fwd_bwd_tok_s"]
    rows = {how: huginn_fwd_bwd(model, dev, args.batch, 176, how, profile=args.profile and how != "drawn")
            for how in ("drawn", "given", "given+fused")}
    # what the goal asks of the hardware: the same run's dense bf16 matmul speed (8192^3, as the
    # training bench's MFU) against the matmul FLOPs of one forward+backward at the goal's speed
    peak = common.dense_peak(dev, 8192)
    flops = rows["given"]["flops"]
    print(f"\n### Huginn forward+backward, {args.rollout_dtype}, {args.batch} x 176 tokens, "
          f"24 no-grad + 8 grad recurrences (reference {ref} tok/s)\n")
    print(f"matmul FLOPs per forward+backward {flops / 1e12:.1f} T; dense bf16 matmul peak in this run "
          f"{peak['tflops']} TFLOP/s\n")
    print("| latents | s per fwd+bwd | tokens/s | vs reference | TFLOP/s | share of the dense peak |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    for how, r in rows.items():
        r["vs_reference"] = r["tokens_per_s"] / ref
        r["tflops"] = flops / r["seconds"] / 1e12
        r["peak_share"] = r["tflops"] / peak["tflops"]
        print(f"| {how} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | {r['vs_reference']:.2f}x | "
              f"{r['tflops']:.0f} | {r['peak_share']:.1%} |")
    goal_tflops = flops * 1.5 * ref / (args.batch * 176) / 1e12
    print(f"| the goal, 1.5x the reference | {args.batch * 176 / (1.5 * ref):.3f} | {1.5 * ref:.0f} | 1.50x | "
          f"{goal_tflops:.0f} | {goal_tflops / peak['tflops']:.1%} |")
    res["fwd_bwd"] = {"reference_tok_s": ref, "rows": rows, "tokens_per_s": rows["given"]["tokens_per_s"],
                      "matmul_flops": flops, "dense_peak": peak, "goal_tflops": goal_tflops}
    model = None
    release(dev)


# ------------------------------------------------------------------------------------ publish
def part_publish(args, res: dict, model_dir: Path) -> None:
    provider = PROVIDERS[args.kind]
    dtype = RL_DTYPE[args.kind]
    work = Path(args.work) / "publish"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = provider.load(model_dir, dtype=dtype, device=args.device)
    sync(args.device)
    t0 = time.perf_counter()
    man = publication.publish(provider, model, work / "pubs", 0, model_revision="bench", engine_revision="bench",
                              dtype=dtype)
    sync(args.device)
    t_pub = time.perf_counter() - t0
    del model
    pub = publication.version_dir(work / "pubs", 0)
    files = sorted(p for p in pub.iterdir() if p.suffix == ".safetensors")
    nbytes = sum(p.stat().st_size for p in files)
    engine = NativeEngine(provider, dtype=dtype, device=args.engine_device, eos_id=-1, pad_id=0,
                          model_revision="bench", engine_revision="bench")
    t0 = time.perf_counter()
    engine.load_publication(pub)
    sync(args.engine_device)
    t_load = time.perf_counter() - t0
    assert engine.digest == man.digest
    engine.close()
    (work / "copy").mkdir()
    t0 = time.perf_counter()
    for p in files:
        dst = work / "copy" / p.name
        shutil.copyfile(p, dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())
    t_copy = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    t_read = time.perf_counter() - t0
    gb = nbytes / 1e9
    out = {
        "bytes": nbytes,
        "publish_s": t_pub, "load_s": t_load, "raw_copy_s": t_copy, "raw_read_s": t_read,
        "publish_gb_s": gb / t_pub, "load_gb_s": gb / t_load,
        "raw_copy_gb_s": gb / t_copy, "raw_read_gb_s": gb / t_read,
        "publish_vs_copy": t_copy / t_pub, "load_vs_copy": t_copy / t_load,
    }
    res["publish"] = out
    print(f"\n### publication: {args.kind} ({args.size}), {dtype}, {gb:.2f} GB of safetensors\n")
    print("| step | seconds | GB/s | share of raw copy speed |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| publish (export, digest, manifest, fsync, rename) | {t_pub:.2f} | {gb / t_pub:.2f} | "
          f"{t_copy / t_pub:.0%} |")
    print(f"| engine load (digest of bytes read, checks, to GPU) | {t_load:.2f} | {gb / t_load:.2f} | "
          f"{t_copy / t_load:.0%} |")
    print(f"| raw copy + fsync | {t_copy:.2f} | {gb / t_copy:.2f} | 100% |")
    print(f"| raw read | {t_read:.2f} | {gb / t_read:.2f} | |")
    shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------ e2e
def rl_cmd(args, model_dir: Path, alg: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "jobs.rl", "--algorithm", alg, "--model", str(model_dir), "--output", str(out),
        "--updates", str(args.updates), "--precision", precision(args),
        "--device", args.device,
        "--engine-device", args.engine_device, "--reward", args.reward, "--keep-checkpoints", "1",
        "--keep-publications", "1", *(["--recompute"] if args.size == "official" else []),
        "--transport", args.transport, "--checkpoint-every", str(args.checkpoint_every),
        *(["--compiled-chains"] if args.compiled_chains else []), *extra,
    ]


def precision(args) -> str:
    # DeepSpeed's CPU accelerator has no fp16: a CPU check of this script trains in fp32
    return RL_PRECISION[args.kind] if args.device != "cpu" else "fp32"


def run(cmd: list[str], log_path: Path) -> int:
    with open(log_path, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


E2E_STEPS = ("full", "record", "stop", "resume", "compare")


def part_e2e(args, res: dict, model_dir: Path, t_start: float) -> None:
    """Per algorithm: the uninterrupted run (``full``), its digests (``record``, with ``--via-record``:
    the run is then deleted), ``--stop-after 2`` (``stop``), ``--resume`` (``resume``) and
    ``verify-resume`` (``compare``). ``--e2e-steps`` runs some of them, so one pair can span several
    calls of a time-limited GPU host; each step finds what the earlier ones left in ``--work``/``--shm``."""
    work = Path(args.work) / "e2e"
    work.mkdir(parents=True, exist_ok=True)
    res.setdefault("e2e", {})
    steps = args.e2e_steps.split(",")
    for alg in args.algorithms.split(","):
        if time.perf_counter() - t_start > args.deadline:
            log(f"deadline: {alg} not started")
            res["e2e"][alg] = {"skipped": "deadline"}
            continue
        # the uninterrupted run goes to RAM when it fits: two official-size checkpoints (fp16 keeps
        # fp32 master weights: 21 GB for Huginn) do not fit beside each other on a 64 GB disk
        shm = Path(args.shm)
        where = work / f"{alg}.run-dir"  # chosen by the call that ran "full"; later calls find the runs there
        if "full" in steps or not where.exists():
            in_ram = shm.parent.is_dir() and _free_gb(shm.parent) > args.shm_min_gb
            where.write_text(str(shm / f"{alg}-a" if in_ram else work / f"{alg}-a"))
        a = Path(where.read_text())
        b = a if args.via_record else work / f"{alg}-b"
        rec_path = work / f"{alg}-a.record.json"
        log(f"{alg}: steps {','.join(steps)}; full run in {a}, stop/resume in {b}; free GB: work "
            f"{_free_gb(work):.0f}, {shm.parent} {_free_gb(shm.parent) if shm.parent.is_dir() else 0:.0f}")
        entry: dict = {"steps": steps, "run_dirs": [str(rec_path) if args.via_record else str(a), str(b)]}
        res["e2e"][alg] = entry
        if "full" in steps and not _e2e_full(args, model_dir, alg, a, work, entry):
            continue
        if "updates" in entry:
            print_e2e(args, alg, entry)
        write(args, res)  # the full run's figures survive a stop/resume cut short by the time limit
        if "record" in steps and args.via_record and not _e2e_record(a, rec_path, alg, entry):
            continue
        if time.perf_counter() - t_start > args.deadline and {"stop", "resume"} & set(steps):
            log(f"deadline: {alg} stop/resume not started")
            continue
        if args.via_record and {"stop", "resume", "compare"} & set(steps) and not rec_path.exists():
            entry["error"] = f"no record {rec_path}: run the full and record steps first"
            log(entry["error"])
            continue
        t0 = time.perf_counter()
        if "stop" in steps:
            if args.via_record or "full" not in steps:
                shutil.rmtree(b, ignore_errors=True)
            entry["rc_stop"] = run(rl_cmd(args, model_dir, alg, b, "--stop-after", "2"), work / f"{alg}-b1.log")
        if "resume" in steps:
            entry["rc_resume"] = run(rl_cmd(args, model_dir, alg, b, "--resume"), work / f"{alg}-b2.log")
        if {"stop", "resume"} & set(steps):
            entry["wall_stop_resume_s"] = round(time.perf_counter() - t0, 1)
            write(args, res)
        if "compare" in steps:
            _e2e_compare(str(rec_path) if args.via_record else str(a), b, alg, work, entry)
            print_resume(entry)
            write(args, res)
        if "compare" in steps:  # the pair is done; a partial call leaves its runs to the next
            shutil.rmtree(a, ignore_errors=True)
            shutil.rmtree(b, ignore_errors=True)


def _e2e_full(args, model_dir: Path, alg: str, a: Path, work: Path, entry: dict) -> bool:
    shutil.rmtree(a, ignore_errors=True)
    t0 = time.perf_counter()
    entry["rc_full"] = run(rl_cmd(args, model_dir, alg, a), work / f"{alg}-a.log")
    entry["wall_full_s"] = round(time.perf_counter() - t0, 1)
    if entry["rc_full"] != 0:
        entry["log_tail"] = (work / f"{alg}-a.log").read_text()[-3000:]
        log(f"{alg}: full run failed rc={entry['rc_full']}")
        return False
    entry["updates"] = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    # "checkpoint" in the metrics is what the update waited; a background write's own seconds are events
    events = json.loads((a / "run.json").read_text())["rl"]["sessions"][-1]["events"]
    written = {e["update"]: e["seconds"] for e in events if e["event"] == "checkpoint_written"}
    for u in entry["updates"]:
        u["seconds"]["checkpoint_write"] = written.get(u["update"], float("nan"))
    return True


def _e2e_record(a: Path, rec_path: Path, alg: str, entry: dict) -> bool:
    """The full run's digests (verify-resume --record); then the run goes, and the stopped run
    takes its place (two official-size runs do not fit one 64 GiB disk, nor one RAM disk)."""
    t0 = time.perf_counter()
    with open(rec_path, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "jobs.verify_resume", "--record", str(a)], cwd=ROOT,
                            stdout=f, stderr=subprocess.PIPE, text=True)
    entry["record_rc"], entry["record_s"] = rc.returncode, round(time.perf_counter() - t0, 1)
    entry["record_bytes"] = rec_path.stat().st_size
    log(f"{alg}: record rc {rc.returncode} in {entry['record_s']} s ({entry['record_bytes']:,} bytes)")
    if rc.returncode:
        entry["record_stderr"] = rc.stderr[-3000:]
        rec_path.unlink()
        return False
    shutil.rmtree(a, ignore_errors=True)
    return True


def _e2e_compare(first: str, b: Path, alg: str, work: Path, entry: dict) -> None:
    t0 = time.perf_counter()
    vr = subprocess.run([sys.executable, "-m", "jobs.verify_resume", first, str(b)], cwd=ROOT,
                        capture_output=True, text=True)
    entry["verify_resume_s"] = round(time.perf_counter() - t0, 1)
    entry["verify_resume_rc"] = vr.returncode
    entry["verify_resume"] = vr.stdout.strip().splitlines()
    # a stop or resume of an earlier call left no exit code here: its run's records decide, via the compare
    entry["verify_resume_equal"] = (vr.returncode == 0 and not entry.get("rc_stop") and not entry.get("rc_resume"))
    if vr.stderr.strip():
        entry["verify_resume_stderr"] = vr.stderr[-3000:]
    for name, rc_key in (("b1", "rc_stop"), ("b2", "rc_resume")):
        if entry.get(rc_key):
            entry[f"log_tail_{name}"] = (work / f"{alg}-{name}.log").read_text()[-3000:]


def _free_gb(path: Path) -> float:
    return shutil.disk_usage(path).free / 1e9


def print_e2e(args, alg: str, e: dict) -> None:
    print(f"\n### e2e: {args.kind} {alg}, train {args.device}, rollout {args.engine_device}, "
          f"{args.transport}, K={args.checkpoint_every}, "
          f"{precision(args)}, full run {e['wall_full_s']} s\n")
    keys = ["rollout", "reward", "recompute", "optimizer", "publish_write", "engine_load", "checkpoint",
            "checkpoint_write"]
    # update: the update's wall time; outside: its share outside rollout and optimization (the
    # RL at scale goal: <= 15% at the stated checkpoint interval)
    print("| update | " + " | ".join(keys) + " | update s | outside | rollout tok/s | peak GiB per GPU |")
    print("| ---: | " + " | ".join("---:" for _ in keys) + " | ---: | ---: | ---: | --- |")
    for u in e["updates"]:
        s = u["seconds"]
        print(f"| {u['update']} | " + " | ".join(f"{s.get(k, float('nan')):.2f}" for k in keys)
              + f" | {s.get('update', float('nan')):.2f} | {u.get('outside_share', float('nan')):.0%}"
              + f" | {u['tokens_per_s']:.0f} | {u.get('peak_memory_gib', {})} |")


def print_resume(e: dict) -> None:
    if "verify_resume_rc" in e:
        # Item lines read "<item>: <verdict>"; the closing tally line ("28 equal, 0 different") is not an item.
        items = [line for line in e["verify_resume"] if ": " in line]
        n_eq = sum(1 for line in items if line.endswith(": equal"))
        print(f"\nstop after 2 + resume ({e['wall_stop_resume_s']} s): verify-resume rc {e['verify_resume_rc']}, "
              f"{n_eq}/{len(items)} items equal")
        for line in e["verify_resume"]:
            if not line.endswith(": equal"):
                print("   ", line)


def write(args, res: dict) -> None:
    if args.json:
        write_json(args.json, res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", required=True, choices=sorted(OFFICIAL))
    p.add_argument("--size", default="official", choices=["official", "tiny"])
    p.add_argument("--parts", default="rollout,publish,e2e", help="any of rollout, publish, e2e, fwd-bwd")
    p.add_argument("--work", default="/tmp/hobson-rl-bench")
    p.add_argument("--json")
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda:0" if cuda else "cpu", help="training device")
    p.add_argument("--engine-device", default=f"cuda:{torch.cuda.device_count() - 1}" if cuda else "cpu")
    p.add_argument("--rollout-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="rollout: the weights' and the engine's dtype")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--fwd-bwd", action="store_true", help="also the Huginn forward+backward at tiny size")
    p.add_argument("--native-only", action="store_true",
                   help="rollout: the native engine alone (no HF-style baseline, no Huginn forward+backward): "
                        "for A/B runs of engine changes, which compare against each other")
    p.add_argument("--engines", default="all", choices=["all", "now"],
                   help="rollout: every engine row, or the engine as it is now (and the HF-style baseline)")
    p.add_argument("--profile", action="store_true",
                   help="rollout: also profile one generate of each engine; fwd-bwd: one forward+backward of "
                        "the given and given+fused rows; print where the time goes")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--compiled-chains", action="store_true",
                   help="e2e: train with --compiled-chains (the norm, RoPE and MLP chains compiled; CUDA)")
    p.add_argument("--checkpoint-every", type=int, default=1, help="e2e: checkpoint every K updates (default 1)")
    p.add_argument("--updates", type=int, default=3, help="e2e: updates in the full run (default 3)")
    p.add_argument("--transport", default="shared-dir", choices=["shared-dir", "dist"],
                   help="e2e: how versions reach the engine (dist with the engine in-process: a hand-off)")
    p.add_argument("--resume-algorithms", default=",".join(ALGORITHMS), help="those also stopped and resumed")
    p.add_argument("--reward", default="test-token-value",
                   help="random weights never solve math: the documented test reward gives varied rewards")
    p.add_argument("--shm", default="/dev/shm/hobson-e2e", help="where the uninterrupted run goes if RAM allows")
    p.add_argument("--shm-min-gb", type=float, default=45.0)
    p.add_argument("--deadline", type=float, default=480.0, help="seconds after which no new e2e run starts")
    p.add_argument("--e2e-steps", default=",".join(E2E_STEPS),
                   help="e2e: the steps to run (full,record,stop,resume,compare), so one pair can span several "
                        "calls of a time-limited host; a later step finds what an earlier call left in --work")
    p.add_argument("--via-record", action="store_true",
                   help="e2e: record the full run's digests (verify-resume --record), delete it, run the stopped "
                        "and resumed run in its place and compare it with the record")
    args = p.parse_args()
    t_start = time.perf_counter()
    res: dict = {
        "kind": args.kind, "size": args.size, "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "date": time.strftime("%Y-%m-%d"),
        "command": ["python", "bench/rl_gpu.py", *sys.argv[1:]], "commit": common.commit(),
        "machine": common.environment(args.engine_device),
    }
    parts = args.parts.split(",")
    model_dir = part_model(args, res) if {"publish", "e2e"} & set(parts) else None
    write(args, res)
    for part in parts:
        t0 = time.perf_counter()
        try:
            if part == "rollout":
                part_rollout(args, res)
            elif part == "publish":
                part_publish(args, res, model_dir)
            elif part == "e2e":
                part_e2e(args, res, model_dir, t_start)
            elif part == "fwd-bwd":
                part_fwd_bwd(args, res)
            else:
                raise SystemExit(f"unknown part {part!r}: rollout, publish, e2e or fwd-bwd")
        except Exception as e:  # keep the other parts' figures
            import traceback

            traceback.print_exc()
            res[f"{part}_error"] = repr(e)
        res.setdefault("part_seconds", {})[part] = round(time.perf_counter() - t0, 1)
        log(f"{part} done in {res['part_seconds'][part]} s")
        write(args, res)


if __name__ == "__main__":
    main()
