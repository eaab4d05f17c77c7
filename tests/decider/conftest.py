"""What the decider fixtures are built from: a tiny Qwen3 torso with a 300-token byte-level BPE,
~40 rows, a teacher file, a config. The fixtures themselves (``decider_data``, ``config_factory``)
live in tests/conftest.py, so the serve, Slurm and bench tests share the one built per session.

Everything is built once per session in code (no download) and saved to disk, so every process
(pytest itself, forked ranks, CLI subprocesses) loads the same bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

import yaml

from hobson.corpus.schema import NOUL_OPTIONS

WORDS = ["apple", "river", "seven", "north", "green", "quick", "stone", "ember", "lunar", "maple", "cobalt",
         "the", "is", "not", "and", "a", "red", "box", "door", "key"]


def make_rows(n: int = 40, seed: int = 0) -> list[dict]:
    """All three kinds, 2..5 options, states of 0..45 words, mixed weights (0.0 = KL-only)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = ["noul", "choice", "score"][i % 3]
        if kind == "noul":
            options = [list(o) for o in NOUL_OPTIONS]
        elif kind == "score":
            options = [[str(s), ["awful", "poor", "fair", "good", "great"][s - 1]] for s in range(1, 6)]
        else:
            options = [[rng.choice(WORDS) + str(j), " ".join(rng.choices(WORDS, k=rng.randint(0, 3)))]
                       for j in range(rng.randint(2, 5))]
        rows.append({
            "kind": kind,
            "state": " ".join(rng.choices(WORDS, k=rng.randint(0, 45))),
            "instructions": f"Pick the option that fits case {i}.",
            "options": options,
            "label": rng.randrange(len(options)),
            "task": f"family{i % 4}",
            "weight": [1.0, 0.5, 2.0, 0.0][i % 4],
            "instruction_variants": [f"Which option fits case {i}?", f"Choose for case {i}."][: i % 3],
        })
    return rows


def teacher_lines(rows: list[dict], seed: int = 1) -> list[dict]:
    """Six-decimal teacher distributions for every KL-only row and most others."""
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        if row["weight"] > 0 and i % 5 == 0:
            continue  # rows without a teacher line get no teacher KL
        raw = [rng.random() + 0.05 for _ in row["options"]]
        probs = [round(x / sum(raw), 6) for x in raw]
        out.append({"i": i, "probs": probs})
    return out


def build_tiny_torso(out: Path, texts: list[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from hobson.tinymodel import build_tokenizer

    tok = build_tokenizer(texts, vocab_size=300)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.1, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def base_config(data: dict[str, Path], output_dir: Path, **over) -> dict:
    """10 optimizer steps: 40 rows, micro-batches of 3, 3 per step (5 steps per epoch), 2 epochs."""
    cfg = {
        "base_model": str(data["torso"]),
        "train_files": [str(data["train"])],
        "teacher_files": [str(data["teacher"])],
        "output_dir": str(output_dir),
        "head_type": "pointer",
        "pointer_dim": 16,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_targets": ["q_proj", "v_proj", "down_proj"],
        "max_length": 128,  # long states get cut from the left
        "kl_teacher_weight": 0.5,
        "kl_frozen_weight": 0.3,
        "score_smoothing": 0.1,
        "seed": 3,
        "epochs": 2,
        "micro_batch_size": 3,
        "grad_accum": 3,
        "length_group_chunk": 4,
        "lr": 0.01,
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "num_threads": 1,
        "keep_checkpoints": 0,
    }
    cfg.update(over)
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=True), encoding="utf-8")
    return path


def micro_batch_loss(model, batch, cfg):
    """One training micro-batch as the recipe runs it (forward with the frozen readout, both KL
    terms at ``cfg``'s weights, backward); returns the loss."""
    from hobson.decider.collate import to_canonical
    from hobson.decider.loss import decider_loss

    out = model(batch)
    loss, _ = decider_loss(to_canonical(out["logits"], batch.perm), batch.option_mask, batch.label,
                           batch.is_score, batch.weight, batch.teacher, batch.has_teacher,
                           to_canonical(out["frozen_logits"], batch.perm),
                           kl_teacher_weight=cfg.kl_teacher_weight, kl_frozen_weight=cfg.kl_frozen_weight)
    loss.backward()
    return loss
