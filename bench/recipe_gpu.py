"""The recipe's GPU stages, measured: teacher labelling, decider training (tokens/s, MFU, memory), DDP = 1 process.

    python bench/recipe_gpu.py label --device cuda --json out/label.json
    python bench/recipe_gpu.py train --device cuda --json out/train.json [--gdn compiled] [--profile N] \
                                     [--set KEY=VALUE ...]   # e.g. --set compile_layers=true
    python bench/recipe_gpu.py replay --device cuda --json out/replay.json   # the decider labels the corpus
    python bench/recipe_gpu.py ddp   --device cuda --json out/ddp.json       # needs 2 GPUs (skipped with 1)
    python bench/recipe_gpu.py all   --device cuda --json out/all.json       # the four, one JSON
    python bench/projection.py out/all.json --gpus 8                         # recipe all --ngpu 8, projected
    python bench/recipe_gpu.py all   --device cpu --shape tiny --json x.json # seconds, on a CPU (CI)

Every figure comes from the project's own code on random weights (no download): the corpus is the
shipped one (the five generator stages' ``train.jsonl``, written by ``hobson.corpus.stages`` into a
temp dir, 6,850 rows), the tokenizer a byte-level BPE trained on it in code
(:func:`hobson.tinymodel.build_tokenizer`, 4,096 tokens; the models' vocabularies stay at their
published sizes and the ids above the tokenizer's are never read). Each part prints a markdown
table on stdout, progress on stderr, and writes its figures to ``--json`` (with versions and the
GPU's name).

``label``: a **Qwen3-4B-shaped** teacher (Qwen3Config: hidden 2560, 36 layers, 32 heads, 8 KV
heads, head_dim 128, intermediate 9728, vocab 151936, tied embeddings; bf16 on CUDA, SDPA; rope
left at its default, which does not change the work) scores the rows three ways, after a warm-up:
(a) ``hobson.labels.label_rows`` with ``LMOptionScorer`` (the teacher stage: tokenize, sort, pack
within ``--max-batch-tokens``/``--max-batch-rows``, left-pad, one forward per batch, write the
shard file; the scorer's own ``forward_seconds`` gives the model's share of it), (b) a naive
loop, one forward per row, on ``--naive-rows`` rows spread over the corpus, (c) the model alone
on full, unpadded ``[B, L]`` batches (random ids, no mask, the same ``logits_to_keep=1``), L = the
mean row length, B = as many rows as the labeller's budget allows, as many forwards as it takes
to cover the same real tokens. Tokens are real (unpadded) prompt tokens. Ratios: batched/naive
and batched/full-forward (target >= 0.60).

``train``: a **Qwen3.5-2B-shaped** torso (Qwen3_5TextConfig as published for Qwen/Qwen3.5-2B:
hidden 2048, 24 layers = 18 Gated DeltaNet + 6 full attention (every 4th), 8 heads / 2 KV heads
of 256 with the output gate, linear attention 16 key / 16 value heads of 128, conv kernel 4,
intermediate 6144, vocab 248320, tied embeddings: 1.88 B parameters) trained by the real recipe
(``hobson.decider.train.DeciderTrainRecipe`` with ``configs/train.yaml``: LoRA r16 on
q/k/v/o/gate/up/down, pointer head, teacher KL, frozen-torso KL; bf16 on CUDA; gradient
checkpointing as the config has it) for ``--warmup`` then ``--steps`` optimizer steps, through the
recipe's own settings and hooks: ``torso_init=random`` builds the torso from its config.json with a
seeded random init (``from_config``) instead of reading weights; ``gated_delta_rule=<--gdn>``
picks the Gated DeltaNet kernel (``auto``: fla's chunked kernel when it imports and its backward
passes a probe, which fla 0.6 + triton 3.6 fails on Hopper, else transformers' torch function;
``torch``; ``compiled``: the torch function under ``torch.compile``), and ``recipe.kernels`` says
which ran and how often; ``on_step`` hands over each step's rows, real and padded tokens and
synchronised seconds (timed wall = the sum of the timed steps' seconds).

Beside it, in the same run (unless ``--no-baseline``), what a user would write instead:
:func:`train_baseline`, plain transformers + peft LoRA + a linear readout and AdamW on the very
micro-batches the recipe trained (the same rows, padding and real tokens), reported with its own
MFU (F + B: it has no frozen forward) and hobson's ratios to it.

MFU, per real token (padding is work wasted, so it lowers MFU). N = the torso's matmul weights
(every nn.Linear of the decoder layers; embeddings are a lookup and the decider has no LM head),
N_L = the LoRA matmul weights (A and B), and the weight-free cores:

    A = 4 * heads * head_dim * ctx per full-attention layer (QK^T and AV), ctx = (L + 1) / 2
        averaged over the real tokens of rows of length L (causal)
    G = 6 * d_k * d_v per value head per Gated DeltaNet layer (read S^T k, rank-1 update of S,
        output S^T q: three state-sized matrix-vector products, the recurrent-form count)
        + 2 * conv_kernel * conv_dim (the depthwise causal conv)
    forward   F = 2N + 2N_L + A + G
    backward  B = 2N + 4N_L + 2(A + G)   frozen weights need input gradients only (no weight-gradient
                                         2N); LoRA needs both; the weight-free cores cost 2x forward
    frozen KL K = 2N + A + G             the adapter-disabled no-grad forward per micro-batch (when
                                         kl_frozen_weight > 0 and not precomputed), part of the recipe
    model FLOPs per token = F + B + K    so "4N + ..." for the trained pass, 6N+ with the frozen forward
    MFU    = (F + B + K) * real tokens/s / peak
    MFU_6N = 6N * real tokens/s / peak   (the usual convention: a weight gradient for every weight,
                                         no attention; printed for comparison)
    HFU    = (F + B + K + [F when checkpointing recomputes]) * padded tokens/s / peak
    peak   = a bf16 dense matmul measured in the same run on the same GPU: 8192^3 operands,
             3 warm-ups, 10 timed, 2 * 8192^3 FLOPs each (fp32 and 256^3 on a CPU --shape tiny run)

``ddp``: the same training (``--dtype fp32`` by default, the precision of the CPU test's bound) for
``--ddp-steps`` steps as one process and under ``torchrun --nproc_per_node=2`` (NCCL on CUDA, gloo
on CPU), both with ``trace_dir`` set; then per step the relative norm difference of the all-reduced
gradient (the metric of ``tests/decider/test_ddp_resume_on_cpu.py``, bound 1e-5; the GPU test
``tests/decider/test_ddp_on_gpu.py`` allows 1e-4), equality of the rendered tokens, and the
adapter/head tensors of the step checkpoint (max abs and relative norm difference), plus every
rank's peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import torch
from common import gib, log, print_table, release, sync

from hobson.io import dumps_row, write_json_atomic
from hobson.labels.label import DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_TOKENS
from hobson.threads import threads

REPO = Path(__file__).resolve().parents[1]

INIT_SEED = 1234  # the random teacher's weights (the torso's come from the training config's seed)
CPU_TEST_BOUND = 1e-5  # tests/decider/test_ddp_resume_on_cpu.py: per-step relative gradient difference
GPU_TEST_BOUND = 1e-4  # tests/decider/test_ddp_on_gpu.py (fp32 on GPUs)
LABEL_TARGET = 0.60  # issue 8: batched labelling >= 60% of full, unpadded forward throughput
CORPUS_STAGES = ("build", "multistep", "generated", "adequacy", "catchall")

# Qwen/Qwen3-4B's text shape (random weights).
TEACHER_SHAPES: dict[str, dict[str, Any]] = {
    "official": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=40960),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=0, tie_word_embeddings=True, max_position_embeddings=4096),
}
# Qwen/Qwen3.5-2B's text_config (random weights): 1.88 B parameters.
TORSO_SHAPES: dict[str, dict[str, Any]] = {
    "official": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=256, intermediate_size=6144, vocab_size=248320, tie_word_embeddings=True,
                     linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                     layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 intermediate_size=128, vocab_size=0, tie_word_embeddings=True, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_conv_kernel_dim=4, max_position_embeddings=4096,
                 layer_types=["linear_attention"] * 3 + ["full_attention"]),
}
# Per-shape defaults of the size knobs (a flag given on the command line wins).
DEFAULTS: dict[str, dict[str, int]] = {
    "official": dict(rows=0, naive_rows=256, vocab=4096, steps=20, warmup=3, ddp_steps=4, peak_size=8192),
    "tiny": dict(rows=160, naive_rows=8, vocab=512, steps=2, warmup=1, ddp_steps=3, peak_size=256),
}
TINY_LABEL_ROWS = 48  # a tiny label run scores this many of the sampled rows


def count(n: float) -> str:
    """``1.881 B`` / ``10.9 M`` / ``52.3 k``: parameter counts for the tables."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3f} {unit}" if unit == "B" else f"{n / div:.1f} {unit}"
    return str(int(n))


# --- corpus, tokenizer, random models --------------------------------------------------------------
class Workspace:
    """The run's temp dir, the shipped corpus (generated once) and the BPE tokenizer."""

    def __init__(self, root: Path, shape: str, vocab: int, rows: int) -> None:
        self.root = root
        self.shape = shape
        self.vocab = vocab
        self.n_rows = rows
        self._rows: list[dict] | None = None
        self._tok = None

    def rows(self) -> list[dict]:
        if self._rows is None:
            from hobson.corpus import stages
            from hobson.corpus.schema import read_rows

            data = self.root / "data"
            rows: list[dict] = []
            log("generating the shipped corpus (train splits of the five generator stages)")
            for stage in CORPUS_STAGES:
                paths = getattr(stages, f"run_{stage}")(data, compare_committed=False)
                rows.extend(read_rows(next(p for p in paths if p.name == "train.jsonl")))
            if self.n_rows and self.n_rows < len(rows):
                # An even spread over every family (the files are written family by family).
                keep = sorted(random.Random(0).sample(range(len(rows)), self.n_rows))
                rows = [rows[i] for i in keep]
            self._rows = rows
            log(f"corpus: {len(rows)} rows")
        return self._rows

    def tokenizer(self):
        if self._tok is None:
            from hobson.labels import render_prompt
            from hobson.tinymodel import build_tokenizer

            self._tok = build_tokenizer([render_prompt(r) for r in self.rows()], vocab_size=self.vocab)
            log(f"tokenizer: byte-level BPE, {len(self._tok)} tokens")
        return self._tok

    def train_files(self) -> tuple[Path, Path, Path]:
        """(corpus file, teacher file, tokenizer dir) for the training recipe, written once."""
        corpus, teacher, tokdir = self.root / "train.jsonl", self.root / "teacher.jsonl", self.root / "tokenizer"
        if not corpus.exists():
            from hobson.labels.shardfile import format_label_line

            rows = self.rows()
            rng = random.Random(1)
            lines = []
            for i, row in enumerate(rows):
                raw = [rng.random() + 0.05 for _ in row["options"]]
                lines.append(format_label_line(i, [x / sum(raw) for x in raw]))
            teacher.write_text("".join(lines), encoding="utf-8")
            self.tokenizer().save_pretrained(tokdir)
            corpus.write_text("".join(dumps_row(r) + "\n" for r in rows), encoding="utf-8")
        return corpus, teacher, tokdir


def init_device(device: str) -> str:
    """Where a model is created: the rank's GPU under torchrun, else ``device``."""
    if device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def random_lm(config, device: str, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """``AutoModelForCausalLM.from_config`` under a fixed seed, created directly on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(INIT_SEED)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    except Exception as e:  # creating on the device is only a speed-up: fall back to CPU init + move
        log(f"creating the model on {device} failed ({type(e).__name__}: {e}); initialising on the CPU instead")
        torch.manual_seed(INIT_SEED)
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        return lm.to(device)


def teacher_config(shape: str, tok):
    from transformers import Qwen3Config

    kw = dict(TEACHER_SHAPES[shape])
    kw["vocab_size"] = max(kw["vocab_size"], len(tok))
    return Qwen3Config(**kw, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def torso_config(shape: str, tok):
    from transformers import Qwen3_5TextConfig

    kw = dict(TORSO_SHAPES[shape])
    kw["vocab_size"] = max(kw["vocab_size"], len(tok))
    return Qwen3_5TextConfig(**kw, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)


# --- label --------------------------------------------------------------------------------------------
def bench_label(args: argparse.Namespace, ws: Workspace) -> dict[str, Any]:
    from hobson.labels import label_rows, plan_batches
    from hobson.labels.lm_scorer import LMOptionScorer
    from hobson.shards import shard_paths

    device, shape = args.device, args.shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = ws.rows()[:TINY_LABEL_ROWS] if shape == "tiny" else ws.rows()
    tok = ws.tokenizer()
    config = teacher_config(shape, tok)
    log(f"label: building a random Qwen3-4B-shaped teacher ({shape}) on {device}")
    model = random_lm(config, init_device(device), dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    scorer = LMOptionScorer(model, tok, init_device(device))
    lengths = scorer.lengths(rows)
    total_tokens = sum(lengths)
    batches = plan_batches(lengths, args.max_batch_tokens, args.max_batch_rows)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    out_dir = ws.root / "label"
    out_dir.mkdir(exist_ok=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    log("label: warm-up")
    warm = [rows[i] for b in batches[:2] + batches[-1:] for i in b]
    label_rows(warm, scorer, out=str(out_dir / "warm.jsonl"), max_batch_tokens=args.max_batch_tokens,
               max_batch_rows=args.max_batch_rows)
    forward_before = scorer.forward_seconds  # the scorer's own clock: the warm-up's forwards are not counted
    log(f"label: batched labeller on {len(rows)} rows ({len(batches)} batches)")
    sync(device)
    start = time.perf_counter()
    result = label_rows(rows, scorer, out=str(out_dir / "labels.jsonl"), max_batch_tokens=args.max_batch_tokens,
                        max_batch_rows=args.max_batch_rows)
    sync(device)
    batched_s = time.perf_counter() - start
    model_s = scorer.forward_seconds - forward_before
    batched_probs = {}
    with open(shard_paths(str(out_dir / "labels.jsonl"), 0, 1)[0], encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            batched_probs[obj["i"]] = obj["probs"]

    n_naive = min(args.naive_rows, len(rows))
    stride = max(1, len(rows) // n_naive)
    naive_idx = list(range(0, len(rows), stride))[:n_naive]
    log(f"label: naive loop, one forward per row, {len(naive_idx)} rows")
    with torch.inference_mode():
        for i in naive_idx[:3]:
            scorer.score_batch([rows[i]])
        sync(device)
        start = time.perf_counter()
        naive_probs = [scorer.score_batch([rows[i]])[0] for i in naive_idx]
        sync(device)
    naive_s = time.perf_counter() - start
    naive_tokens = sum(lengths[i] for i in naive_idx)
    diff = max(abs(a - b) for i, p in zip(naive_idx, naive_probs, strict=True)
               for a, b in zip(batched_probs[i], p, strict=True))

    L = max(1, round(total_tokens / len(rows)))
    B = max(1, min(args.max_batch_rows, args.max_batch_tokens // L))
    n_fwd = max(1, -(-total_tokens // (B * L)))
    log(f"label: full-forward baseline, {n_fwd} forwards of [{B}, {L}] without padding")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (B, L), generator=g).to(init_device(device))
    with torch.inference_mode():
        for _ in range(3):
            model(input_ids=ids, logits_to_keep=1)
        sync(device)
        start = time.perf_counter()
        for _ in range(n_fwd):
            model(input_ids=ids, logits_to_keep=1)
        sync(device)
    full_s = time.perf_counter() - start
    full_tokens = n_fwd * B * L
    n_mm = matmul_params(model.model)

    batched_tps, naive_tps, full_tps = total_tokens / batched_s, naive_tokens / naive_s, full_tokens / full_s
    fig = {
        "shape": shape, "device": device, "dtype": str(dtype).replace("torch.", ""),
        "teacher": {"config": {k: v for k, v in TEACHER_SHAPES[shape].items()} | {"vocab_size": config.vocab_size},
                    "params": params, "matmul_params_non_embedding": n_mm},
        "rows": len(rows), "tokens": total_tokens, "mean_row_tokens": round(total_tokens / len(rows), 2),
        "max_row_tokens": max(lengths), "max_batch_tokens": args.max_batch_tokens,
        "max_batch_rows": args.max_batch_rows, "batches": len(batches),
        "padding_share": round(1 - total_tokens / padded, 4),
        "batched": {"wall_s": round(batched_s, 3), "model_s": round(model_s, 3),
                    "model_only_tokens_per_s": round(total_tokens / model_s, 1),
                    "rows_per_s": round(len(rows) / batched_s, 2), "tokens_per_s": round(batched_tps, 1),
                    "tflops_2n": round(2 * n_mm * batched_tps / 1e12, 2), "shard_rows": result.rows},
        "naive": {"rows": len(naive_idx), "tokens": naive_tokens, "wall_s": round(naive_s, 3),
                  "rows_per_s": round(len(naive_idx) / naive_s, 2), "tokens_per_s": round(naive_tps, 1)},
        "full_forward": {"batch": B, "length": L, "forwards": n_fwd, "tokens": full_tokens,
                         "wall_s": round(full_s, 3), "tokens_per_s": round(full_tps, 1),
                         "tflops_2n": round(2 * n_mm * full_tps / 1e12, 2)},
        "batched_over_naive_tokens_per_s": round(batched_tps / naive_tps, 3),
        "batched_over_naive_rows_per_s": round((len(rows) / batched_s) / (len(naive_idx) / naive_s), 3),
        "batched_over_full_forward": round(batched_tps / full_tps, 3),
        "target_batched_over_full_forward": LABEL_TARGET,
        "meets_target": batched_tps / full_tps >= LABEL_TARGET,
        "max_abs_prob_diff_batched_vs_naive": round(diff, 6),
    }
    if device == "cuda":
        fig["peak_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
    del model, scorer
    release(device)
    print_table(f"label: Qwen3-4B-shaped teacher ({shape}, {device}, {fig['dtype']})", [
        ("rows / real tokens / mean tokens per row", f"{len(rows)} / {total_tokens} / {fig['mean_row_tokens']}"),
        ("batches (budget tokens x rows) / padding share",
         f"{len(batches)} ({args.max_batch_tokens} x {args.max_batch_rows}) / {fig['padding_share']}"),
        ("(a) batched labeller rows/s, tokens/s", f"{fig['batched']['rows_per_s']}, {fig['batched']['tokens_per_s']}"),
        ("(a) wall s (of which model forward s; tokens/s over the forwards alone)",
         f"{fig['batched']['wall_s']} ({fig['batched']['model_s']}; {fig['batched']['model_only_tokens_per_s']})"),
        ("(b) naive per-row loop rows/s, tokens/s", f"{fig['naive']['rows_per_s']}, {fig['naive']['tokens_per_s']}"),
        (f"(c) full forward [{B}, {L}] tokens/s", fig["full_forward"]["tokens_per_s"]),
        ("batched / naive (tokens/s)", fig["batched_over_naive_tokens_per_s"]),
        ("batched / full forward (target >= 0.60)", f"{fig['batched_over_full_forward']} "
                                                    f"({'met' if fig['meets_target'] else 'missed'})"),
        ("max |p batched - p naive|", fig["max_abs_prob_diff_batched_vs_naive"]),
    ])
    return fig


# --- FLOPs --------------------------------------------------------------------------------------------
def matmul_params(module: torch.nn.Module, lora: bool = False) -> int:
    """Weights of the nn.Linear layers under ``module``: the base layers, or (``lora``) the LoRA A/B."""
    total = 0
    for name, mod in module.named_modules():
        if isinstance(mod, torch.nn.Linear) and (".lora_" in f".{name}") == lora:
            total += mod.in_features * mod.out_features
    return total


def flops_per_token(config, n_mm: int, n_lora: int, *, mean_context: float, frozen_forward: bool,
                    recompute: bool) -> dict[str, float]:
    """The module docstring's F, B, K terms per real token; ``mean_context`` = the positions a real
    token attends to, on average (the recipe's ``attended_pairs / tokens``)."""
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    n_full = sum(k == "full_attention" for k in kinds)
    n_linear = sum(k == "linear_attention" for k in kinds)
    ctx = mean_context
    attn = n_full * 4 * config.num_attention_heads * config.head_dim * ctx
    gdn = 0.0
    if n_linear:
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        conv_dim = 2 * config.linear_num_key_heads * dk + config.linear_num_value_heads * dv
        gdn = n_linear * (6 * dk * dv * config.linear_num_value_heads + 2 * config.linear_conv_kernel_dim * conv_dim)
    fwd = 2 * n_mm + 2 * n_lora + attn + gdn
    bwd = 2 * n_mm + 4 * n_lora + 2 * (attn + gdn)
    frozen = 2 * n_mm + attn + gdn if frozen_forward else 0.0
    return {"forward": fwd, "backward": bwd, "frozen_forward": frozen, "model": fwd + bwd + frozen,
            "recompute": fwd if recompute else 0.0, "attention_core": attn, "gated_deltanet_core": gdn,
            "six_n": 6.0 * n_mm, "mean_context": ctx}


# --- train --------------------------------------------------------------------------------------------
def train_overrides(args: argparse.Namespace, ws: Workspace, out: Path, *, bf16: bool) -> list[str]:
    corpus, teacher, tokdir = ws.train_files()
    base = out / "torso"
    if not (base / "config.json").exists():
        torso_config(args.shape, ws.tokenizer()).save_pretrained(base)
    over = [f"base_model={json.dumps(str(base))}", f"tokenizer={json.dumps(str(tokdir))}",
            f"train_files={json.dumps([str(corpus)])}", f"teacher_files={json.dumps([str(teacher)])}",
            "val_file=null", f"output_dir={json.dumps(str(out / 'out'))}", "resume=false", "checkpoint_every=0",
            "log_every=1000000", f"device={args.device}", f"bf16={'true' if bf16 else 'false'}",
            "torso_init=random", f"gated_delta_rule={args.gdn}"]
    if args.device == "cpu":
        over.append(f"num_threads={args.threads}")
    return over + list(args.set)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """The recipe logs JSON lines on stdout; keep stdout for the tables."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def train_baseline(cfg: Any, rows: list[dict], collator: Any, plan: list[list[list[int]]], warmup: int,
                   device: str) -> dict[str, Any]:
    """What a user would write instead, on the same rows in the same micro-batches: the same torso
    (transformers, the same seeded random init, dtype, attention and checkpointing), peft LoRA on
    the same projections, a linear readout of the answer token's hidden state, AdamW, a plain
    loop. No teacher or frozen-torso KL (so no frozen forward) and no pointer head: its model FLOPs
    per token are F + B of the module docstring. The Gated DeltaNet rule is the recipe's choice
    (``select_gated_delta_rule``), so both rows run the same kernel."""
    from peft import LoraConfig, get_peft_model

    from hobson.decider.kernels import select_gated_delta_rule
    from hobson.decider.model import load_torso

    dev = init_device(device)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    torso, _, _ = load_torso(cfg.base_model, dtype=dtype, attn_implementation=cfg.attn_implementation,
                             keep_lm_head=False, init="random", seed=cfg.seed, device=dev)
    for p in torso.parameters():
        p.requires_grad_(False)
    if cfg.gradient_checkpointing:
        torso.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(cfg.seed)
    model = get_peft_model(torso, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                             target_modules=list(cfg.lora_targets), bias="none"))
    head = torch.nn.Linear(torso.config.hidden_size, 1, device=dev, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    model.train()
    seconds: list[float] = []
    tokens = rows_done = 0
    with select_gated_delta_rule(torso, cfg.gated_delta_rule, dev):
        for s, micro in enumerate(plan):
            sync(device)
            t0 = time.perf_counter()
            n_tok = 0
            for mb in micro:
                batch = collator.collate([(i, rows[i]) for i in mb]).to(dev)
                hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
                r = torch.arange(hidden.shape[0], device=hidden.device)
                score = head(hidden[r, batch.answer_pos].float()).squeeze(-1)
                loss = torch.nn.functional.mse_loss(score, batch.label.float()) / len(micro)
                loss.backward()
                n_tok += int(batch.attention_mask.sum())
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            if s >= warmup:
                seconds.append(time.perf_counter() - t0)
                tokens += n_tok
                rows_done += sum(len(mb) for mb in micro)
    del model, torso, head, opt
    release(device)
    wall = sum(seconds)
    return {"steps": len(seconds), "wall_s": round(wall, 3), "rows": rows_done, "tokens": tokens,
            "rows_per_s": round(rows_done / wall, 2), "tokens_per_s": round(tokens / wall, 1)}


def bench_train(args: argparse.Namespace, ws: Workspace) -> dict[str, Any]:
    from hobson.decider.config import load_train_config
    from hobson.decider.train import DeciderTrainRecipe

    device = args.device
    out = ws.root / "train"
    warmup, steps = args.warmup, args.steps
    overrides = train_overrides(args, ws, out, bf16=device == "cuda")
    overrides.append(f"stop_after_steps={warmup + steps + args.profile}")
    cfg = load_train_config(args.config, overrides)
    peak = common.dense_peak(init_device(device), args.peak_size)
    log(f"train: dense matmul peak {peak['tflops']} TFLOP/s ({peak['dtype']}, {peak['size']}^3)")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    per_step: list[Any] = []  # StepStats, one per optimizer step
    prof: dict[str, Any] = {}

    captures: list[int] = []  # CUDA graphs captured so far, after each step (cuda_graphs: true)

    def on_step(stats) -> None:  # the recipe's per-step hook
        per_step.append(stats)
        graphs = getattr(prof.get("recipe"), "graphs", None)
        captures.append(graphs.captures if graphs is not None else 0)
        if args.profile and len(per_step) == warmup + steps:  # the profiled steps follow the timed ones
            prof["cm"] = common.profiled(device)
            prof["p"] = prof["cm"].__enter__()
            prof["ranges"] = common.module_ranges(prof["model"])
            prof["ranges"].__enter__()
            prof["t0"] = time.perf_counter()
        elif "cm" in prof and len(per_step) == warmup + steps + args.profile:
            wall = time.perf_counter() - prof["t0"]
            prof.pop("ranges").__exit__(None, None, None)
            prof.pop("cm").__exit__(None, None, None)
            prof["summary"] = common.summarize(prof.pop("p"), steps=args.profile, wall_s=wall)

    with stdout_to_stderr(), threads(None):
        recipe = DeciderTrainRecipe(cfg, on_step=on_step)
        prof["recipe"] = recipe
        try:
            setup_start = time.perf_counter()
            recipe.setup()
            setup_s = time.perf_counter() - setup_start
            prof["model"] = recipe.model  # the profiled steps name its modules
            log(f"train: Gated DeltaNet path {recipe.kernels}; chains {recipe.model.chain_kernel}")
            chain_kernel = recipe.model.chain_kernel
            torso = recipe.model.torso
            n_base = sum(p.numel() for n, p in torso.named_parameters() if "lora_" not in n)
            n_mm, n_lora = matmul_params(torso), matmul_params(torso, lora=True)
            n_trainable = sum(p.numel() for p in recipe.params)
            log(f"train: torso {count(n_base)} parameters ({count(n_mm)} matmul, non-embedding), "
                f"trainable {count(n_trainable)}; {warmup} warm-up + {steps} timed steps")
            recipe.train()
        finally:
            recipe.cleanup()
    gdn = recipe.kernels.as_dict() if recipe.kernels else {"chunk_gated_delta_rule": "none (no Gated DeltaNet "
                                                                                     "layers)", "calls": 0}
    done = per_step[: warmup + steps]
    if len(done) <= warmup:
        raise RuntimeError(f"only {len(done)} steps ran (warm-up {warmup}); the corpus is too small for --steps")
    window = done[warmup:]
    wall = sum(s.seconds for s in window)
    warmup_s = sum(s.seconds for s in done[:warmup])
    rows = sum(s.rows for s in window)
    tokens = sum(s.tokens for s in window)
    padded = sum(s.padded_tokens for s in window)
    mean_context = sum(s.attended_pairs for s in window) / tokens
    tps, ptps = tokens / wall, padded / wall
    frozen_forward = cfg.use_lora and cfg.kl_frozen_weight > 0 and not cfg.precompute_frozen_kl
    fl = flops_per_token(torso.config, n_mm, n_lora, mean_context=mean_context, frozen_forward=frozen_forward,
                         recompute=cfg.gradient_checkpointing)
    peak_flops = peak["tflops"] * 1e12
    fig = {
        "shape": args.shape, "device": device, "dtype": "bfloat16" if cfg.bf16 else "float32",
        "torso": {"config": {k: v for k, v in TORSO_SHAPES[args.shape].items() if k != "layer_types"}
                  | {"vocab_size": torso.config.vocab_size, "full_attention_layers":
                     sum(k == "full_attention" for k in torso.config.layer_types),
                     "gated_deltanet_layers": sum(k == "linear_attention" for k in torso.config.layer_types)},
                  "params": n_base, "matmul_params_non_embedding": n_mm, "lora_matmul_params": n_lora,
                  "trainable_params": n_trainable},
        "recipe": {"config": str(args.config), "overrides": list(args.set), "micro_batch_size": cfg.micro_batch_size,
                   "grad_accum": cfg.grad_accum, "lora_r": cfg.lora_r, "lora_targets": list(cfg.lora_targets),
                   "gradient_checkpointing": cfg.gradient_checkpointing, "kl_frozen_weight": cfg.kl_frozen_weight,
                   "frozen_forward_per_micro_batch": frozen_forward, "max_length": cfg.max_length,
                   "attn_implementation": cfg.attn_implementation, "lora_kernel": cfg.lora_kernel,
                   "chain_kernel": chain_kernel, "cuda_graphs": cfg.cuda_graphs,
                   "graph_length_multiple": cfg.graph_length_multiple},
        "gated_deltanet": gdn,
        "setup_s": round(setup_s, 2), "warmup_steps": warmup, "warmup_s": round(warmup_s, 2),
        "steps": len(window), "wall_s": round(wall, 3),
        "step_s": [round(s.seconds, 3) for s in done],  # warm-up steps first: a slow step shows here
        "rows": rows, "tokens": tokens, "padded_tokens": padded,
        "rows_per_s": round(rows / wall, 2), "tokens_per_s": round(tps, 1), "padded_tokens_per_s": round(ptps, 1),
        "mean_row_tokens": round(tokens / max(rows, 1), 2), "padding_share": round(1 - tokens / padded, 4),
        "peak": peak,
        "flops_per_token": {k: round(v, 1) for k, v in fl.items()},
        "model_tflops": round(fl["model"] * tps / 1e12, 2),
        "mfu": round(fl["model"] * tps / peak_flops, 4),
        "mfu_6n": round(fl["six_n"] * tps / peak_flops, 4),
        "hfu": round((fl["model"] + fl["recompute"]) * ptps / peak_flops, 4),
    }
    graph_rows: list[tuple[str, Any]] = []
    if cfg.cuda_graphs:
        # a step that met a new bucket ran it eagerly once and captured it: a one-off per bucket
        # in a run, so the steps that captured nothing are the run's steady state
        new = [b - a for a, b in zip([0] + captures, captures, strict=False)][: warmup + steps]
        steady = [s for s, n in zip(window, new[warmup:], strict=True) if n == 0]
        fig["graphs"] = {"captured": captures[-1] if captures else 0, "captured_in_timed_steps": sum(new[warmup:]),
                         "steady_steps": len(steady)}
        graphs = getattr(prof.get("recipe"), "graphs", None)
        if graphs is not None:  # the memory all buckets' graphs hold together (session 23: 50 GiB)
            fig["graphs"]["pool_gib"] = gib(graphs.pool_bytes())
        if steady:
            s_wall = sum(s.seconds for s in steady)
            s_tps = sum(s.tokens for s in steady) / s_wall
            fig["graphs"].update({"steady_tokens_per_s": round(s_tps, 1),
                                  "steady_mfu": round(fl["model"] * s_tps / peak_flops, 4)})
        g = fig["graphs"]
        graph_rows = [("CUDA graphs: captured (in timed steps) / steady steps",
                       f"{g['captured']} ({g['captured_in_timed_steps']}) / {g['steady_steps']}")]
        if "pool_gib" in g:
            graph_rows.append(("CUDA graphs: pool memory GiB", g["pool_gib"]))
        if steady:
            graph_rows.append(("steady steps: real tokens/s / MFU (F+B+K)",
                               f"{g['steady_tokens_per_s']} / {g['steady_mfu']:.2%}"))
    if device == "cuda":
        fig["peak_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
        fig["peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
    if "summary" in prof:
        fig["profile"] = prof["summary"]
    if gdn.get("compiled"):
        from torch._dynamo.utils import counters

        fig["gated_deltanet"]["dynamo_unique_graphs"] = int(counters["stats"].get("unique_graphs", 0))
    # the baseline's inputs: the very micro-batches the recipe trained, rendered by its collator
    from hobson.decider.collate import Collator

    # a fresh collator with the recipe's seed renders them again draw for draw (its option orders
    # come from one seeded stream, consumed in the recipe's micro-batch order)
    collator = Collator(recipe.tokenizer, max_length=cfg.max_length, force_bos=cfg.force_bos, seed=cfg.seed)
    plan, train_rows, torso_config = recipe.sampler.plan(0)[: warmup + steps], recipe.rows, torso.config
    del recipe, torso
    release(device)
    baseline_rows: list[tuple[str, Any]] = []
    if not args.no_baseline:
        log("train: plain transformers + peft LoRA on the same micro-batches (the baseline)")
        with stdout_to_stderr(), threads(None):
            base = train_baseline(cfg, train_rows, collator, plan, warmup, device)
        bf = flops_per_token(torso_config, n_mm, n_lora, mean_context=mean_context, frozen_forward=False,
                             recompute=cfg.gradient_checkpointing)
        base["flops_per_token"] = round(bf["model"], 1)
        base["mfu"] = round(bf["model"] * base["tokens_per_s"] / peak_flops, 4)
        fig["baseline"] = base
        fig["ratio_tokens_per_s"] = round(tps / base["tokens_per_s"], 3)
        fig["ratio_mfu"] = round(fig["mfu"] / base["mfu"], 3) if base["mfu"] else None
        baseline_rows = [
            ("baseline: transformers + peft, same micro-batches: real tokens/s / MFU (F+B)",
             f"{base['tokens_per_s']} / {base['mfu']:.2%}"),
            ("hobson / baseline: tokens/s, MFU", f"{fig['ratio_tokens_per_s']}x, {fig['ratio_mfu']}x")]
    print_table(f"train: Qwen3.5-2B-shaped torso ({args.shape}, {device}, {fig['dtype']})", [
        ("torso parameters / matmul (non-embedding) / trainable",
         f"{count(n_base)} / {count(n_mm)} / {count(n_trainable)}"),
        ("Gated DeltaNet path (chunked rule / conv)",
         f"{gdn['chunk_gated_delta_rule']}{' + torch.compile' if gdn.get('compiled') else ''} ({gdn['calls']} calls)"
         f" / {gdn.get('causal_conv1d')}" + (" (fla backward failed: torch instead)" if gdn.get("fla_backward_error")
                                             else "")),
        ("LoRA kernel / norm and SwiGLU chains", f"{cfg.lora_kernel} / {chain_kernel}"),
        ("micro-batch x accum / gradient checkpointing / frozen forward",
         f"{cfg.micro_batch_size} x {cfg.grad_accum} / {cfg.gradient_checkpointing} / {frozen_forward}"),
        ("timed steps / wall s (warm-up s)", f"{len(window)} / {fig['wall_s']} ({fig['warmup_s']})"),
        ("rows/s", fig["rows_per_s"]),
        ("real tokens/s (padded tokens/s)", f"{fig['tokens_per_s']} ({fig['padded_tokens_per_s']})"),
        ("model GFLOP per real token (F + B + K) / 6N", f"{fl['model'] / 1e9:.3f} / {fl['six_n'] / 1e9:.3f}"),
        (f"dense {peak['dtype']} matmul peak TFLOP/s", peak["tflops"]),
        ("MFU (F+B+K) / MFU (6N) / HFU", f"{fig['mfu']:.2%} / {fig['mfu_6n']:.2%} / {fig['hfu']:.2%}"),
        ("peak memory allocated GiB", fig.get("peak_alloc_gib", "n/a (CPU)")),
        *graph_rows,
        *baseline_rows,
    ])
    if "profile" in fig:
        common.print_summary(f"train, {args.profile} steps after the timed ones", fig["profile"])
    return fig


# --- replay -------------------------------------------------------------------------------------------
def bench_replay(args: argparse.Namespace, ws: Workspace) -> dict[str, Any]:
    """The replay stage's work on one device: the decider (the torso as ``train`` builds it, a
    fresh adapter and head) labels the corpus through ``label_rows`` + ``DeciderScorer``, exactly
    as ``jobs.replay`` does for its shard; calibration and evaluation run the same forwards."""
    from transformers import AutoTokenizer

    from hobson.decider.checkpoint import DEFAULT_TEMPERATURES
    from hobson.decider.config import load_train_config
    from hobson.decider.model import build_decider
    from hobson.decider.predict import DeciderScorer, LoadedDecider
    from hobson.labels import label_rows

    device = args.device
    out = ws.root / "replay"
    overrides = train_overrides(args, ws, out, bf16=device == "cuda")
    cfg = load_train_config(args.config, [*overrides, "kl_frozen_weight=0.0", "gradient_checkpointing=false"])
    rows = ws.rows()[:TINY_LABEL_ROWS] if args.shape == "tiny" else ws.rows()
    with stdout_to_stderr():
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
        model = build_decider(cfg, tok, init_device(device)).eval()
    loaded = LoadedDecider(model, tok, cfg, dict(DEFAULT_TEMPERATURES), str(out), torch.device(init_device(device)))
    scorer = DeciderScorer(loaded)
    lengths = scorer.lengths(rows)
    kw = dict(max_batch_tokens=args.max_batch_tokens, max_batch_rows=args.max_batch_rows)
    log(f"replay: warm-up, then the decider labels {len(rows)} rows")
    label_rows(rows[: min(len(rows), 64)], scorer, out=str(out / "warm.jsonl"), **kw)
    sync(device)
    start = time.perf_counter()
    result = label_rows(rows, scorer, out=str(out / "replay.jsonl"), **kw)
    sync(device)
    wall = time.perf_counter() - start
    fig = {"shape": args.shape, "device": device, "dtype": "bfloat16" if cfg.bf16 else "float32",
           "rows": len(rows), "tokens": sum(lengths), "wall_s": round(wall, 3),
           "rows_per_s": round(len(rows) / wall, 2), "tokens_per_s": round(sum(lengths) / wall, 1),
           "shard_rows": result.rows}
    del model, loaded, scorer
    release(device)
    print_table(f"replay: the decider labels the corpus ({args.shape}, {device}, {fig['dtype']})", [
        ("rows / rendered tokens", f"{fig['rows']} / {fig['tokens']}"),
        ("wall s", fig["wall_s"]), ("rows/s, tokens/s", f"{fig['rows_per_s']}, {fig['tokens_per_s']}")])
    return fig


# --- ddp ----------------------------------------------------------------------------------------------
def bench_ddp(args: argparse.Namespace, ws: Workspace) -> dict[str, Any]:
    from hobson.decider.config import load_train_config

    device, nproc = args.device, 2
    if device == "cuda" and torch.cuda.device_count() < nproc:
        fig = {"skipped": f"needs {nproc} CUDA devices, {torch.cuda.device_count()} visible"}
        print_table("ddp: 2 ranks against 1 process", [("skipped", fig["skipped"])])
        return fig
    root = ws.root / "ddp"
    steps = args.ddp_steps
    bf16 = args.dtype == "bf16"
    runs = {}
    for name in ("one", "two"):
        over = train_overrides(args, ws, root / name, bf16=bf16)
        over += [f"stop_after_steps={steps}", f"trace_dir={json.dumps(str(root / name / 'trace'))}"]
        runs[name] = over
    load_train_config(args.config, runs["one"])  # fail here, before any process starts, on a bad override

    log(f"ddp: one process, {steps} steps ({args.dtype})")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with stdout_to_stderr(), threads(None):
        rc, gdn = train_once(load_train_config(args.config, runs["one"]))
    one_s = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"the one-process run exited {rc}")
    one_mem = {"rank": 0, "wall_s": round(one_s, 2)}
    if device == "cuda":
        one_mem |= {"peak_alloc_gib": gib(torch.cuda.max_memory_allocated()),
                    "peak_reserved_gib": gib(torch.cuda.max_memory_reserved())}
    release(device)

    spec = root / "two" / "spec.json"
    write_json_atomic(spec, {"config": str(args.config), "overrides": runs["two"], "device": device,
                             "out": str(root / "two")})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), "ddp-worker", "--spec", str(spec)]
    env = dict(os.environ)  # the workers run this file: bench/ is their sys.path[0], hobson is installed
    # NVLink multicast stays off (the device machines' rule; a 2-rank all-reduce does not need it).
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(key, value)
    log(f"ddp: {nproc} ranks under torchrun ({'nccl' if device == 'cuda' else 'gloo'}): {' '.join(cmd)}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.ddp_timeout)
    two_s = time.perf_counter() - start
    (root / "two" / "torchrun.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
                           f"--- stderr ---\n{proc.stderr[-6000:]}")
    ranks = [json.loads((root / "two" / f"rank{r}.json").read_text()) for r in range(nproc)]
    cmp = compare_runs(root / "one", root / "two", steps)
    fig = {"device": device, "dtype": args.dtype, "shape": args.shape, "steps": steps, "world_size": nproc,
           "gated_deltanet": gdn, "one_process": one_mem, "ranks": ranks, "one_process_wall_s": round(one_s, 2),
           "torchrun_wall_s": round(two_s, 2), **cmp, "cpu_test_bound": CPU_TEST_BOUND,
           "gpu_test_bound": GPU_TEST_BOUND,
           "grads_within_cpu_test_bound": cmp["worst_grad_rel_diff"] < CPU_TEST_BOUND,
           "params_within_cpu_test_bound": cmp["worst_param_rel_diff"] < CPU_TEST_BOUND}
    mem = ", ".join(f"rank {r['rank']} {r.get('peak_alloc_gib', 'n/a')}" for r in ranks)
    print_table(f"ddp: {nproc} ranks against 1 process ({args.shape}, {device}, {args.dtype}, {steps} steps)", [
        ("worst per-step relative gradient difference (bound 1e-5 CPU test, 1e-4 GPU test)",
         f"{cmp['worst_grad_rel_diff']:.3e} ({'within' if fig['grads_within_cpu_test_bound'] else 'OVER'} 1e-5)"),
        ("adapter/head after the steps: max abs diff", f"{cmp['worst_param_abs_diff']:.3e}"),
        # the tests bound gradients (the DDP claim); AdamW then scales every element by its own
        # gradient history, so parameters may drift further apart than the gradients did
        ("adapter/head after the steps: worst relative norm diff (no test bound)",
         f"{cmp['worst_param_rel_diff']:.3e}"),
        ("rendered tokens equal every step", cmp["rendering_equal"]),
        ("peak memory allocated GiB: one process", one_mem.get("peak_alloc_gib", "n/a (CPU)")),
        ("peak memory allocated GiB per rank", mem),
        ("wall s: one process / torchrun (with start-up)", f"{fig['one_process_wall_s']} / {fig['torchrun_wall_s']}"),
    ])
    return fig


def compare_runs(one: Path, two: Path, steps: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    grad_rel = []
    rendering_equal = True
    for s in range(1, steps + 1):
        g1 = torch.load(one / "trace" / f"grads_step{s:04d}.pt").double()
        g2 = torch.load(two / "trace" / f"grads_step{s:04d}.pt").double()
        grad_rel.append(float((g1 - g2).norm() / g1.norm()))
        tokens = []
        for d in (one, two):
            merged: dict[str, Any] = {}
            for f in sorted((d / "trace").glob(f"tokens_step{s:04d}_rank*.json")):
                merged.update(json.loads(f.read_text()))
            tokens.append(merged)
        rendering_equal &= tokens[0] == tokens[1]
    worst_abs = worst_rel = 0.0
    tensors = 0
    for name in ("adapter.safetensors", "head.safetensors"):
        a = load_file(str(one / "out" / "checkpoints" / f"step_{steps:08d}" / name))
        b = load_file(str(two / "out" / "checkpoints" / f"step_{steps:08d}" / name))
        if a.keys() != b.keys():
            raise RuntimeError(f"{name}: the runs saved different tensors")
        for k in a:
            x, y = a[k].double(), b[k].double()
            worst_abs = max(worst_abs, float((x - y).abs().max()))
            worst_rel = max(worst_rel, float((x - y).norm() / x.norm().clamp(min=1e-30)))
            tensors += 1
    return {"grad_rel_diff_per_step": [float(f"{x:.3e}") for x in grad_rel], "worst_grad_rel_diff": max(grad_rel),
            "worst_param_abs_diff": worst_abs, "worst_param_rel_diff": worst_rel, "tensors_compared": tensors,
            "rendering_equal": rendering_equal}


def train_once(cfg) -> tuple[int, dict[str, Any]]:
    """``recipe_main`` that also returns the recipe's Gated DeltaNet report (``recipe.kernels``)."""
    from hobson.decider.train import DeciderTrainRecipe

    recipe = DeciderTrainRecipe(cfg)
    try:
        recipe.setup()
        rc = recipe.train()
    finally:
        recipe.cleanup()
    return rc, recipe.kernels.as_dict() if recipe.kernels else {}


def ddp_worker(spec_path: str) -> int:
    """One torchrun rank: the recipe with the random torso; writes ``rank<R>.json`` (memory, wall)."""
    from hobson.decider.config import load_train_config

    spec = json.loads(Path(spec_path).read_text())
    device, rank = spec["device"], int(os.environ.get("RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    start = time.perf_counter()
    rc, gdn = train_once(load_train_config(spec["config"], spec["overrides"]))
    rec: dict[str, Any] = {"rank": rank, "wall_s": round(time.perf_counter() - start, 2), "rc": rc,
                           "gated_deltanet": gdn}
    if device == "cuda":
        rec |= {"peak_alloc_gib": gib(torch.cuda.max_memory_allocated()),
                "peak_reserved_gib": gib(torch.cuda.max_memory_reserved())}
    write_json_atomic(Path(spec["out"]) / f"rank{rank}.json", rec)
    return rc


# --- main ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["label", "train", "replay", "ddp", "all", "ddp-worker"],
                   help="what to measure (all: label, train, ddp in turn; ddp-worker: one torchrun rank, internal)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--shape", choices=["official", "tiny"], default="official",
                   help="official: the Qwen3-4B / Qwen3.5-2B shapes; tiny: small models for a CPU run")
    p.add_argument("--json", default=None, help="write the figures here (JSON)")
    p.add_argument("--workdir", default=None, help="keep corpus, labels, checkpoints and logs here (default: a temp "
                                                   "dir, removed at exit)")
    p.add_argument("--rows", type=int, default=None, help="corpus rows to use (official default: all 6,850)")
    p.add_argument("--vocab", type=int, default=None, help="BPE tokenizer size (official default 4096)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU run (default 1)")
    g = p.add_argument_group("label")
    g.add_argument("--naive-rows", type=int, default=None, help="rows of the naive per-row loop (official 256)")
    g.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                   help=f"labeller token budget (default {DEFAULT_MAX_BATCH_TOKENS}, the stage's)")
    g.add_argument("--max-batch-rows", type=int, default=DEFAULT_MAX_BATCH_ROWS,
                   help=f"labeller row cap (default {DEFAULT_MAX_BATCH_ROWS}, the stage's)")
    g = p.add_argument_group("train / ddp")
    g.add_argument("--config", default=str(REPO / "configs" / "train.yaml"), help="training config")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, repeatable (e.g. --set gradient_checkpointing=true)")
    g.add_argument("--steps", type=int, default=None, help="timed optimizer steps (official 20)")
    g.add_argument("--no-baseline", action="store_true",
                   help="train: skip the plain transformers + peft loop on the same micro-batches")
    g.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps first (official 3)")
    g.add_argument("--peak-size", type=int, default=None, help="matmul size of the peak measurement (official 8192)")
    g.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, run N more under torch.profiler and print where the time goes")
    g.add_argument("--gdn", choices=["auto", "torch", "compiled"], default="auto",
                   help="the training config's gated_delta_rule: auto (fla when it imports and its backward works, "
                        "else torch), torch (the torch fallback), compiled (it under torch.compile; give --warmup "
                        "room to compile)")
    g.add_argument("--ddp-steps", type=int, default=None, help="optimizer steps of each ddp run (official 4)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="ddp precision (default fp32: the precision of the CPU test's bound)")
    g.add_argument("--ddp-timeout", type=int, default=900, help="seconds the torchrun run may take")
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    for key, value in DEFAULTS[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "ddp-worker":
        return ddp_worker(args.spec)
    with threads(None):
        if args.device == "cpu":
            torch.set_num_threads(args.threads)
        return run_parts(args, argv)


def run_parts(args: argparse.Namespace, argv: list[str] | None) -> int:
    parts = ["label", "train", "replay", "ddp"] if args.command == "all" else [args.command]
    result: dict[str, Any] = {"environment": common.environment(args.device), "command": args.command,
                              "argv": sys.argv[1:] if argv is None else list(argv)}
    with contextlib.ExitStack() as stack:
        root = Path(args.workdir) if args.workdir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="recipe_gpu.")))
        root.mkdir(parents=True, exist_ok=True)
        ws = Workspace(root, args.shape, args.vocab, args.rows)
        bench = {"label": bench_label, "train": bench_train, "replay": bench_replay, "ddp": bench_ddp}
        walls: dict[str, Any] = {}
        failed = []
        for part in parts:
            start = time.perf_counter()
            try:
                fig = bench[part](args, ws)
            except Exception as e:  # record it and go on: device time is scarce, the other parts still count
                log(f"{part} FAILED:\n{traceback.format_exc()}")
                fig = {"error": f"{type(e).__name__}: {e}"[-4000:]}
                failed.append(part)
                release(args.device)
            walls[part] = round(time.perf_counter() - start, 1)
            fig["part_wall_s"] = walls[part]
            log(f"{part}: {walls[part]} s")
            result[part] = fig
            if args.json:  # after every part, so a later failure keeps what was measured
                common.write_json(args.json, result)
    print_table("wall seconds per part", [(k, f"{v}{' (FAILED)' if k in failed else ''}") for k, v in walls.items()])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
