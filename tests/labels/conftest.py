"""Fixtures: a 60-row corpus, one tiny default teacher per session, the one-process label file."""

from __future__ import annotations

import pytest

from tests.labels.labelkit import BATCH, make_rows, write_corpus


@pytest.fixture(scope="session")
def corpus_rows() -> list[dict]:
    return make_rows()


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory, corpus_rows) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", corpus_rows)


@pytest.fixture(scope="session")
def teacher(tmp_path_factory, corpus_rows):
    """(model_dir, model, tokenizer) of the default teacher for the session corpus."""
    import torch

    from hobson.labels import render_prompt
    from hobson.labels.lm_scorer import load_causal_lm
    from hobson.tinymodel import ensure_default_teacher

    model_dir = ensure_default_teacher(tmp_path_factory.mktemp("models") / "teacher",
                                       [render_prompt(r) for r in corpus_rows])
    model, tokenizer = load_causal_lm(model_dir)
    # One thread: on a busy shared machine torch's spinning intra-op threads make this tiny
    # model ~40x slower, and the outputs here do not depend on the thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model_dir, model, tokenizer
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def scorer(teacher):
    from hobson.labels.lm_scorer import LMOptionScorer

    _, model, tokenizer = teacher
    return LMOptionScorer(model, tokenizer)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, corpus_rows, scorer):
    """The one-process (N=1) file, labelled in this process."""
    from hobson.labels import label_rows, merge_shards

    out = str(tmp_path_factory.mktemp("ref") / "teacher.jsonl")
    label_rows(corpus_rows, scorer, out=out, shard=0, num_shards=1, **BATCH)
    merge_shards(out, 1)
    return out
