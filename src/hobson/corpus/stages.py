"""The corpus stages of the decider recipe: build, fetch, multistep, generated, adequacy, catchall.

Each ``run_<stage>(data_dir, ...)`` writes its files under ``data_dir/<stage>/`` (fetch:
``data_dir/raw/``), then ``SOURCE`` (where the rows came from) and, last, ``SHA256SUMS``:
its presence means the stage finished. Outputs are written to temp files and renamed only
after every file is complete (and, for the default corpus, matches ``data/SHA256SUMS``), so
a failure leaves no partial output and no SHA256SUMS.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hobson.corpus import adequacy, catchall, generated, multistep, raw, short_tasks
from hobson.corpus.fetch import download, load_fetch_config
from hobson.corpus.generator import Family, split_groups
from hobson.corpus.sums import (
    DEFAULT_SCALE,
    DEFAULT_SEED,
    SOURCE_NAME,
    SUMS_NAME,
    check_committed,
    source_line_generator,
    write_sums,
)
from hobson.errors import ConfigError
from hobson.io import atomic_write, dumps_row, sha256_file, write_json_atomic, write_text_atomic

FETCH_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "fetch.yaml"


@dataclass(frozen=True)
class SplitSpec:
    """One output file of a generator stage. Held-out splits come first and reserve their states."""

    name: str  # file stem: <stage>/<name>.jsonl
    families: list[Family]
    heldout: bool = True
    paired: bool = False  # rows come in groups of two sharing a "pair" id

    def expected_rows(self) -> int:
        return sum(f.counts[self.name] for f in self.families) * (2 if self.paired else 1)


@dataclass(frozen=True)
class GeneratorStage:
    name: str
    splits: list[SplitSpec] = field(default_factory=list)

    def relpaths(self) -> list[str]:
        return [f"{self.name}/{s.name}.jsonl" for s in self.splits]


def _simple(name: str, families: list[Family]) -> GeneratorStage:
    return GeneratorStage(name, [SplitSpec("eval", families), SplitSpec("train", families, heldout=False)])


GENERATOR_STAGES: dict[str, GeneratorStage] = {
    "build": _simple("build", short_tasks.FAMILIES),
    "multistep": _simple("multistep", multistep.FAMILIES),
    "generated": GeneratorStage("generated", [
        SplitSpec("eval", generated.FAMILIES),
        SplitSpec("consistency", generated.CONSISTENCY_FAMILIES, paired=True),
        SplitSpec("flip", generated.FLIP_FAMILIES, paired=True),
        SplitSpec("train", generated.FAMILIES, heldout=False),
    ]),
    "adequacy": _simple("adequacy", adequacy.FAMILIES),
    "catchall": _simple("catchall", catchall.FAMILIES),
}

STAGES = ("build", "fetch", "multistep", "generated", "adequacy", "catchall")

# relpath -> row count of the embedded default corpus (generator, seed 0, scale 1)
EXPECTED_ROWS: dict[str, int] = {
    f"{st.name}/{sp.name}.jsonl": sp.expected_rows() for st in GENERATOR_STAGES.values() for sp in st.splits
}

# Every stage's output files relative to the data dir (SOURCE/SHA256SUMS are its markers).
STAGE_OUTPUTS: dict[str, list[str]] = {
    **{name: st.relpaths() for name, st in GENERATOR_STAGES.items()},
    "fetch": ["raw/MANIFEST.json"],
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _split_lines(stage: GeneratorStage, split: SplitSpec, seed: int, scale: float,
                 taken: set[bytes]) -> Iterator[str]:
    groups = split_groups(stage.name, split.families, split.name, seed, scale, taken, remember=split.heldout)
    for pair, group in enumerate(groups):
        for row in group:
            if split.paired:
                row["pair"] = pair  # after the schema keys, as consumers expect
            yield dumps_row(row)


def _write_stage(
    data_dir: Path,
    stage: str,
    files: Iterable[tuple[str, Iterator[str]]],
    source: str,
    compare_committed: bool,
) -> list[Path]:
    """Stream each file to a temp name, check, then rename all; SOURCE and SHA256SUMS last."""
    stage_dir = data_dir / stage
    stage_dir.mkdir(parents=True, exist_ok=True)
    # Drop the completion marker first: from here on the stage counts as unfinished.
    (stage_dir / SUMS_NAME).unlink(missing_ok=True)
    log(f"{stage}: rows from {source.replace(chr(10), '; ')}")
    digests: dict[str, str] = {}
    counts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for name, lines in files:
            rel = f"{stage}/{name}"
            f = stack.enter_context(atomic_write(data_dir / rel))
            h = hashlib.sha256()
            n = 0
            for line in lines:
                text = line + "\n"
                f.write(text)
                h.update(text.encode("utf-8"))
                n += 1
            digests[rel], counts[rel] = h.hexdigest(), n
        if compare_committed:
            check_committed(stage, digests, data_dir)  # raising here discards every temp file
    write_text_atomic(stage_dir / SOURCE_NAME, source + "\n")
    write_sums(stage_dir / SUMS_NAME, digests)
    for rel in digests:
        log(f"{stage}: wrote {data_dir / rel} ({counts[rel]} rows)")
    return [data_dir / rel for rel in digests]


def _check_args(scale: float, seed: int) -> None:
    if not scale > 0:
        raise ConfigError(f"--scale must be positive, got {scale}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"--seed must be a non-negative integer, got {seed!r}")


def _run_generator(data_dir: str | os.PathLike, stage: str, scale: float, seed: int,
                   compare_committed: bool) -> list[Path]:
    _check_args(scale, seed)
    spec = GENERATOR_STAGES[stage]
    taken: set[bytes] = set()
    files = ((f"{sp.name}.jsonl", _split_lines(spec, sp, seed, scale, taken)) for sp in spec.splits)
    is_default = seed == DEFAULT_SEED and scale == DEFAULT_SCALE
    return _write_stage(Path(data_dir), stage, files, source_line_generator(seed, scale),
                        compare_committed and is_default)


def run_build(data_dir: str | os.PathLike, scale: float = 1.0, seed: int = 0,
              compare_committed: bool = True) -> list[Path]:
    """Short-task rows -> ``build/train.jsonl``, ``build/eval.jsonl``.

    Reads ``qa-jsonl`` sources listed in ``raw/MANIFEST.json`` when present (each verified
    against its recorded sha256 first); otherwise runs the embedded generator.
    """
    data_dir = Path(data_dir)
    sources = raw.manifest_sources(data_dir, "qa-jsonl")
    if not sources:
        return _run_generator(data_dir, "build", scale, seed, compare_committed)
    paths = [(s["name"], raw.check_source(data_dir, s)) for s in sources]
    source = "\n".join(f"raw:{s['name']} sha256={s['sha256']}" for s in sources)

    def lines(split: str) -> Iterator[str]:
        for name, path in paths:
            for row in raw.qa_rows(path, name, split):
                yield dumps_row(row)

    files = ((f"{split}.jsonl", lines(split)) for split in ("eval", "train"))
    return _write_stage(data_dir, "build", files, source, compare_committed=False)


def run_multistep(data_dir: str | os.PathLike, scale: float = 1.0, seed: int = 0,
                  compare_committed: bool = True) -> list[Path]:
    """2-3-hop rows over stated facts -> ``multistep/train.jsonl``, ``multistep/eval.jsonl``."""
    return _run_generator(data_dir, "multistep", scale, seed, compare_committed)


def run_generated(data_dir: str | os.PathLike, scale: float = 1.0, seed: int = 0,
                  compare_committed: bool = True) -> list[Path]:
    """Paraphrased questions -> ``generated/{train,eval}.jsonl`` plus the paired eval sets
    ``generated/consistency.jsonl`` (same question, two paraphrases) and
    ``generated/flip.jsonl`` (same state, flipped question, different answer); paired rows
    carry ``"pair": int`` after the schema keys."""
    return _run_generator(data_dir, "generated", scale, seed, compare_committed)


def run_adequacy(data_dir: str | os.PathLike, scale: float = 1.0, seed: int = 0,
                 compare_committed: bool = True) -> list[Path]:
    """Request/response adequacy rows -> ``adequacy/train.jsonl``, ``adequacy/eval.jsonl``."""
    return _run_generator(data_dir, "adequacy", scale, seed, compare_committed)


def run_catchall(data_dir: str | os.PathLike, scale: float = 1.0, seed: int = 0,
                 compare_committed: bool = True) -> list[Path]:
    """Rows whose answer is "none of these" -> ``catchall/train.jsonl``, ``catchall/eval.jsonl``."""
    return _run_generator(data_dir, "catchall", scale, seed, compare_committed)


def run_fetch(data_dir: str | os.PathLike, config: str | os.PathLike | None = None, retries: int = 5,
              backoff_s: float = 0.5, timeout_s: float = 60.0) -> list[Path]:
    """Download the sources of ``config`` (default ``configs/fetch.yaml``) into ``D/raw/``.

    Writes ``raw/<name>`` per source, ``raw/MANIFEST.json`` (the sources present, in config
    order) and ``raw/SHA256SUMS``. A missing default config means no sources.
    """
    raw_dir = Path(data_dir) / "raw"
    config_path = Path(config) if config is not None else FETCH_CONFIG
    if config is None and not config_path.is_file():
        sources = []
    else:
        sources = load_fetch_config(config_path)
    raw_dir.mkdir(parents=True, exist_ok=True)
    (raw_dir / SUMS_NAME).unlink(missing_ok=True)
    log(f"fetch: {len(sources)} source(s) from {config_path}")
    fetched = [download(s, raw_dir, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s) for s in sources]
    write_json_atomic(raw_dir / raw.MANIFEST, {"sources": [s.manifest_entry() for s in sources]})
    digests = {f"raw/{p.name}": s.sha256 for p, s in zip(fetched, sources, strict=True)}
    digests[f"raw/{raw.MANIFEST}"] = sha256_file(raw_dir / raw.MANIFEST)
    write_sums(raw_dir / SUMS_NAME, digests)
    return [*fetched, raw_dir / raw.MANIFEST]


RUNNERS = {
    "build": run_build,
    "multistep": run_multistep,
    "generated": run_generated,
    "adequacy": run_adequacy,
    "catchall": run_catchall,
}
