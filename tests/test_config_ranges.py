"""Every numeric setting of every config declares its range, and a value outside it is one error
naming the file, the line, the key and the range (hobson.config)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from hobson.aws.options import AwsConfig, HostOptions, InstanceChoice, PollOptions
from hobson.config import Range, load_config, ranges
from hobson.decider.config import TrainConfig
from hobson.errors import ConfigError
from hobson.launch.options import (
    ClusterProfile,
    CorpusOptions,
    DeciderOptions,
    RecipeConfig,
    StageOverride,
    TeacherOptions,
)
from hobson.rl.config import RLConfig

# class -> (the top-level config that holds it, how to place a {key: value} mapping in it, its
# required keys)
TRAIN_REQUIRED = {"base_model": "m", "train_files": ["t.jsonl"], "output_dir": "out"}
WHERE = {
    TrainConfig: (TrainConfig, lambda kv: {**TRAIN_REQUIRED, **kv}, ""),
    RLConfig: (RLConfig, lambda kv: kv, ""),
    CorpusOptions: (RecipeConfig, lambda kv: {"corpus": kv}, "corpus."),
    TeacherOptions: (RecipeConfig, lambda kv: {"teacher": kv}, "teacher."),
    DeciderOptions: (RecipeConfig, lambda kv: {"decider": kv}, "decider."),
    ClusterProfile: (ClusterProfile, lambda kv: kv, ""),
    StageOverride: (ClusterProfile, lambda kv: {"stages": {"rl": kv}}, ""),
    AwsConfig: (AwsConfig, lambda kv: kv, ""),
    PollOptions: (AwsConfig, lambda kv: {"poll": kv}, "poll."),
    HostOptions: (AwsConfig, lambda kv: {"host": kv}, "host."),
    InstanceChoice: (AwsConfig, lambda kv: {"instance_types": [{"type": "p5.48xlarge", "gpus": 8, **kv}]}, ""),
}


def _numeric(cls: type) -> dict[str, type]:
    """Each int/float setting (also optional, or a list of them) -> int or float."""
    out = {}
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = [tp, *typing.get_args(tp)]
        args += [a for x in args for a in typing.get_args(x)]
        kinds = [a for a in args if a in (int, float)]
        if kinds:
            out[f.name] = kinds[0]
    return out


def test_every_config_class_is_covered():
    """Every dataclass the loader builds is in WHERE (a new config class must declare its ranges)."""
    seen, todo = set(), [TrainConfig, RLConfig, RecipeConfig, ClusterProfile, AwsConfig, StageOverride, InstanceChoice]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        for tp in typing.get_type_hints(cls).values():
            if dataclasses.is_dataclass(tp) and tp not in seen:
                todo.append(tp)
    assert {c for c in seen if _numeric(c)} <= set(WHERE)


@pytest.mark.parametrize("cls", list(WHERE), ids=lambda c: c.__name__)
def test_every_numeric_setting_declares_a_range(cls):
    declared = ranges(cls)
    assert set(_numeric(cls)) - set(declared) == set(), f"{cls.__name__}: numeric settings without a range"
    assert set(declared) <= set(_numeric(cls)), f"{cls.__name__}: RANGES names keys that are not numeric settings"


def _outside(rng: Range, kind: type) -> float:
    bad = (rng.lo if rng.lo_open else rng.lo - 1) if rng.lo is not None else (rng.hi if rng.hi_open else rng.hi + 1)
    return int(bad) if kind is int else float(bad)


CASES = [(cls, key) for cls in WHERE for key in sorted(ranges(cls))]


@pytest.mark.parametrize("cls,key", CASES, ids=[f"{c.__name__}.{k}" for c, k in CASES])
def test_a_value_outside_its_range_is_one_error_naming_file_line_key_and_range(cls, key, tmp_path):
    top, place, prefix = WHERE[cls]
    rng = ranges(cls)[key]
    kind = _numeric(cls)[key]
    value = _outside(rng, kind)
    listed = typing.get_origin(typing.get_type_hints(cls)[key]) is list
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(place({key: [value] if listed else value}), sort_keys=False))
    with pytest.raises(ConfigError) as err:
        load_config(path, top)
    msg = str(err.value)
    assert f"'{prefix}{key}' must be {rng}" in msg, msg
    assert str(path) in msg, msg
    if cls not in (StageOverride, InstanceChoice):  # built from a list/dict entry: no line of its own
        line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.lstrip().startswith(key))
        assert f"{path}:{line}:" in msg, msg


@pytest.mark.parametrize("shards", [-3, 0])
def test_teacher_shards_below_one_is_refused(shards, tmp_path):
    """The issue's example: `teacher.shards: -3` and `0` were accepted."""
    path = tmp_path / "recipe.yaml"
    path.write_text(f"teacher:\n  shards: {shards}\n")
    with pytest.raises(ConfigError, match=rf"recipe.yaml:2: 'teacher.shards' must be >= 1, got {shards}"):
        load_config(path, RecipeConfig)


def test_shipped_configs_are_in_range():
    repo = Path(__file__).resolve().parents[1]
    load_config(repo / "configs" / "recipe.yaml", RecipeConfig)
    load_config(repo / "configs" / "cluster" / "default.yaml", ClusterProfile)
    load_config(repo / "configs" / "aws.yaml", AwsConfig)
    for f in sorted((repo / "configs" / "rl").glob("*.yaml")):
        load_config(f, RLConfig)


def test_range_parsing_and_membership():
    r = Range.parse("[0, 1)")
    assert 0 in r and 0.5 in r and 1 not in r and -0.1 not in r and str(r) == "[0, 1)"
    assert 0 not in Range.parse("> 0") and 1e-9 in Range.parse("> 0") and str(Range.parse(">= 1")) == ">= 1"
    with pytest.raises(ValueError):
        Range.parse("positive")
