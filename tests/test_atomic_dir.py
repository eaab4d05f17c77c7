"""hobson.io.atomic_dir: the one way a directory output is written (checkpoints, exports, the
cached tiny models): whole or not at all."""

import pytest

from hobson.io import atomic_dir


def test_replaces_whole_and_a_failure_leaves_the_old_one(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as d:
        (d / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(target) as d:
        (d / "a").write_text("2")
        raise RuntimeError("killed mid-write")
    assert (target / "a").read_text() == "1"
    with atomic_dir(target, mode=0o755) as d:
        (d / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b"] and (target.stat().st_mode & 0o777) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporaries left


def test_keep_lets_the_first_builder_win(tmp_path):
    target = tmp_path / "model"
    with atomic_dir(target, exists="keep") as d:
        (d / "x").write_text("first")
        with atomic_dir(target, exists="keep") as d2:  # a concurrent builder finishes first
            (d2 / "x").write_text("second")
    assert (target / "x").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
