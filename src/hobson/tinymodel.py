"""The embedded default teacher: a tiny causal LM and tokenizer built in code, no download.

Everything here is deterministic: the tokenizer is a byte-level BPE trained on the given texts in
their given order, the model is a random init under a fixed ``torch.manual_seed``, and
``save_pretrained`` writes the same bytes for the same inputs (a test compares the sha256 of
``model.safetensors`` built in two processes). It is a stand-in that makes the recipe run end to
end on a CPU; pass ``--teacher DIR`` to label with a real model.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from collections.abc import Iterable, Sequence
from pathlib import Path

from hobson.errors import ConfigError
from hobson.io import atomic_dir

TINY_VOCAB_SIZE = 768
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
MODEL_CARD = "hobson_model.json"
# Bumped whenever the architecture or the tokenizer recipe changes, so an old directory is
# recognised as stale instead of silently reused.
RECIPE_VERSION = 1


def texts_sha256(texts: Iterable[str]) -> str:
    """Digest of the training texts (each text's UTF-8 bytes, NUL-separated)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def build_tokenizer(texts: Sequence[str], vocab_size: int = TINY_VOCAB_SIZE):
    """A byte-level BPE trained on ``texts``, wrapped as a ``PreTrainedTokenizerFast``.

    The byte alphabet is the initial vocabulary, so every single character ``A``..``Z`` is one
    token whatever the texts are (the option letters must be single tokens). ``tokenizer(text)``
    prepends ``<bos>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )
    for letter in string.ascii_uppercase:
        ids = fast(letter, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:  # cannot happen with the byte alphabet; guard the promise anyway
            raise AssertionError(f"letter {letter!r} is not a single token: {ids}")
    return fast


def build_tiny_causal_lm(tokenizer, seed: int = 0):
    """A 2-layer Qwen3 (hidden 64, 4 heads of 16), fp32, random init under ``torch.manual_seed(seed)``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        # A wider init than the usual 0.02 so the random teacher's letter probabilities are
        # visibly non-uniform at six decimals (a flat 1/k everywhere would test little).
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    # from_config draws every parameter on the CPU from the seeded global generator.
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(torch.float32).eval()


def _card_ok(model_dir: Path, digest: str, seed: int) -> bool:
    try:
        card = json.loads((model_dir / MODEL_CARD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return card == _card(digest, seed)


def _card(digest: str, seed: int) -> dict:
    return {
        "kind": "hobson-default-teacher",
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "texts_sha256": digest,
        "vocab_size": TINY_VOCAB_SIZE,
    }


def ensure_default_teacher(model_dir: str | os.PathLike, corpus_texts: Sequence[str], seed: int = 0) -> Path:
    """Build (once) and return the default teacher directory trained on ``corpus_texts``.

    Race-safe: several shard processes may call this at once. Each builds into its own temp
    directory beside the target and renames it into place; the first rename wins and the others
    discard their copy (they built identical bytes anyway). An existing directory built from other
    texts or another seed is refused rather than silently reused.
    """
    target = Path(model_dir)
    digest = texts_sha256(corpus_texts)
    if not target.exists():
        # another process may win the race to rename: its directory holds the same bytes
        with atomic_dir(target, exists="keep", mode=0o755) as tmp:
            tokenizer = build_tokenizer(corpus_texts)
            model = build_tiny_causal_lm(tokenizer, seed=seed)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / MODEL_CARD).write_text(json.dumps(_card(digest, seed), indent=2, sort_keys=True) + "\n")
    if not _card_ok(target, digest, seed):
        raise ConfigError(
            f"{target}: exists but is not the default teacher for these texts and seed {seed} "
            f"(texts sha256 {digest[:16]}...; see {target / MODEL_CARD}); delete it or pass another "
            "--default-teacher-dir"
        )
    return target
