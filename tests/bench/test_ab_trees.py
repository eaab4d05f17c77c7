"""bench/ab_trees.py: another commit's code against this checkout's, interleaved (the plumbing on CPU
at tiny size; on a GPU the same runs time the two trees)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = "--size tiny --device cpu --engine-device cpu --batch 2 --prompt-tokens 8 --new-tokens 4"


def test_two_trees_alternate_and_each_run_imports_its_own_tree(tmp_path: Path) -> None:
    """``--base HEAD``: the base tree is extracted by ``git archive`` and installed into a venv over
    this environment; the runs alternate base, new, base, new; each run imported hobson from its own
    tree (recorded by the run itself: the base from the venv, this checkout from its editable
    install), and the table has a line per tree with the speed ratio over the base."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.fail("the test needs the checkout's git history (git archive HEAD)")
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, "bench/ab_trees.py", "--base", "HEAD", "--kinds", "nanbeige",
                        "--repeat", "2", "--timeout", "300", "--json", str(out),
                        "--rollout-args", f"{TINY} --work {tmp_path / 'work'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(row["tree"], row["run"]) for row in res["rows"]] == [("base", 0), ("new", 0), ("base", 1), ("new", 1)]
    assert all("error" not in row and row["decode_ms_per_step"] > 0 for row in res["rows"]), res["rows"]
    srcs: dict[str, set[str]] = {}
    for row in res["rows"]:
        srcs.setdefault(row["tree"], set()).add(row["hobson_src"])
    assert srcs["new"] == {str((REPO / "src").resolve())}
    (base_src,) = srcs["base"]
    assert Path(base_src).parts[-4:-2] == ("venv", "lib") and Path(base_src).name == "site-packages"
    assert not Path(base_src).exists()  # the base tree and its venv are removed at the end
    table = {t["tree"]: t for t in res["table"]}
    assert len(table["base"]["runs"]) == len(table["new"]["runs"]) == 2
    assert table["base"]["speedup"] == 1.0
    assert table["new"]["speedup"] == pytest.approx(table["base"]["best"] / table["new"]["best"])
    assert "| nanbeige | rollout | new |" in r.stdout


def test_a_base_that_is_not_a_hobson_tree_is_one_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "bench/ab_trees.py", "--base-tree", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--base-tree {tmp_path}: not a hobson tree" in r.stderr


def test_a_commit_that_does_not_exist_is_one_error_and_leaves_no_files(tmp_path: Path) -> None:
    import os

    env = dict(os.environ, TMPDIR=str(tmp_path))  # where the bench's temporary directory would stay
    r = subprocess.run([sys.executable, "bench/ab_trees.py", "--base", "no-such-commit-0123"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--base no-such-commit-0123: git archive failed" in r.stderr and "--base-tree" in r.stderr
    assert list(tmp_path.iterdir()) == []
