"""launch/, jobs/ and aws/ are installed inside the hobson package (setup.py's package_dir).

- No code under launch/, jobs/, aws/, bench/, src/ or tests/ edits ``sys.path`` or sets ``PYTHONPATH``
  (the tests' child processes import the install, as a user's do; this file only names the patterns).
- ``hobson.launch``, ``hobson.jobs`` and ``hobson.aws`` import from this checkout's folders, in this
  process and in a fresh interpreter that has only the install (no pytest path, no PYTHONPATH).
- The ``hobson`` console script, ``python launch/submit.py`` and ``python -m jobs.rl`` run.
- No top-level ``launch``, ``jobs`` or ``aws`` is importable outside the checkout, and a wheel
  holds them only under ``hobson/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

FOLDERS = ("launch", "jobs", "aws", "bench", "src", "tests")
MAPPED = {"hobson.launch": "launch", "hobson.launch.backends": "launch/backends", "hobson.jobs": "jobs",
          "hobson.aws": "aws"}

# sys.path.insert/append/extend/remove, sys.path[...] = ..., sys.path += / =, site.addsitedir, and
# PYTHONPATH set for a child process (the same edit, one process later): env["PYTHONPATH"] = ...,
# {"PYTHONPATH": ...}, PYTHONPATH=... (a keyword, or a line of a rendered or shipped script)
PATH_EDIT = re.compile(
    r"sys\.path\s*(\.\s*(insert|append|extend|remove)\s*\(|\[[^\]]*\]\s*=|\+=|=(?!=))"
    r"|site\.addsitedir\s*\("
    r"|[\"']PYTHONPATH[\"']\s*(\]\s*=|:)|\bPYTHONPATH\s*=(?!=)"
)


def _env() -> dict[str, str]:
    """This environment without PYTHONPATH: what resolves is what is installed."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def path_edits(root: Path) -> list[str]:
    """``file:line: text`` of every sys.path/PYTHONPATH edit in the .py and .sh files under ``root``."""
    hits = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".sh") or "__pycache__" in path.parts or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".sh" else line
            if PATH_EDIT.search(code):
                hits.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return hits


def test_the_check_finds_path_edits(tmp_path):
    (tmp_path / "a.py").write_text(
        "import sys, os, site\nsys.path.insert(0, 'x')\nsys.path.append('y')\nsys.path[:0] = ['z']\n"
        "sys.path += ['w']\nsite.addsitedir('v')\nenv['PYTHONPATH'] = 'u'\nprint(sys.path)\n"
        "if 'x' in sys.path: pass\nenv = {**os.environ, 'PYTHONPATH': 't'}\n")
    (tmp_path / "b.sh").write_text('export PYTHONPATH="$PWD"\n# export PYTHONPATH=x (a comment)\n')
    assert [h.split(":")[1] for h in path_edits(tmp_path)] == ["2", "3", "4", "5", "6", "7", "10", "1"]


def test_no_code_edits_sys_path():
    hits = [f"{d}/{h}" for d in FOLDERS for h in path_edits(REPO / d)] + [f"sbatch/{h}" for h in
                                                                           path_edits(REPO / "sbatch")]
    hits = [h for h in hits if not h.startswith("tests/test_packaging.py:")]  # its own patterns and samples
    assert hits == [], "the checkout's code must not put itself on the path:\n" + "\n".join(hits)


def test_mapped_packages_are_the_checkout_folders():
    import importlib

    for name, folder in MAPPED.items():
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve() == (REPO / folder / "__init__.py").resolve(), name


def test_a_fresh_interpreter_finds_them_through_the_install(tmp_path):
    """From outside the checkout, without PYTHONPATH: only the install can resolve these."""
    names = ["hobson", *MAPPED, "hobson.launch.submit", "hobson.jobs.rl", "hobson.aws.runner"]
    code = ("import importlib, json, sys; "
            "print(json.dumps({n: importlib.import_module(n).__file__ for n in sys.argv[1:]}))")
    p = subprocess.run([sys.executable, "-c", code, *names], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    files = {n: Path(f).resolve() for n, f in json.loads(p.stdout).items()}
    assert files["hobson"] == (REPO / "src" / "hobson" / "__init__.py").resolve()
    for name, folder in MAPPED.items():
        assert files[name] == (REPO / folder / "__init__.py").resolve(), name
    assert files["hobson.jobs.rl"] == (REPO / "jobs" / "rl.py").resolve()
    assert files["hobson.aws.runner"] == (REPO / "aws" / "runner.py").resolve()


@pytest.mark.parametrize("name", ["launch", "jobs", "aws"])
def test_no_top_level_module_outside_the_checkout(name, tmp_path):
    p = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and f"No module named '{name}'" in p.stderr, (p.stdout, p.stderr)


def _console_script() -> str:
    """The ``hobson`` script of the interpreter under test (beside it in a venv or CI's bin), else PATH's."""
    beside = Path(sys.executable).with_name("hobson")
    found = str(beside) if beside.is_file() else shutil.which("hobson")
    assert found, "no `hobson` console script: install the checkout (pip install -e .)"
    return found


def test_console_script_is_the_launcher(tmp_path):
    script = _console_script()
    p = subprocess.run([script, "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("usage: hobson ") and "recipe" in p.stdout and "status" in p.stdout
    # main()'s return value is the exit code
    p = subprocess.run([script, "status", str(tmp_path / "no-run")], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "no run at" in p.stderr, (p.returncode, p.stderr[-3000:])


@pytest.mark.parametrize("argv", [["launch/submit.py", "--help"], ["launch/submit.py", "recipe", "--help"],
                                  ["-m", "jobs.rl", "--help"], ["-m", "aws.runner", "--help"]])
def test_checkout_entry_points_run_from_the_repo_root(argv):
    p = subprocess.run([sys.executable, *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("usage: "), p.stdout[:300]


def test_wheel_holds_them_only_under_hobson(tmp_path):
    """A regular (non-editable) build: hobson/launch, hobson/jobs, hobson/aws, no new top-level names."""
    pytest.importorskip("setuptools", minversion="70.1")  # bdist_wheel without the wheel package
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("src", "launch", "jobs", "aws"):  # what setup.py packages (no build/ in the checkout)
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "wheel"
    code = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    p = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    with zipfile.ZipFile(out / p.stdout.strip().splitlines()[-1]) as zf:
        names = zf.namelist()
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"hobson"}, top
    for path in ("hobson/launch/submit.py", "hobson/launch/backends/slurm.py", "hobson/jobs/rl.py",
                 "hobson/aws/runner.py", "hobson/stagerun.py", "hobson/rl/default_data.jsonl"):
        assert path in names, path
    assert "hobson = hobson.launch.submit:main" in entry_points
