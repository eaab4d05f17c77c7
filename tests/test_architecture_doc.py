"""docs/ARCHITECTURE.md names only modules and files that exist: every `hobson.*`, `launch.*`,
`jobs.*` and `aws.*` path in backticks imports (a name after the last module, such as a class, is
an attribute), every `python -m` module is found, and every backticked path into the checkout
(`bench/common.py`, `launch/backends/<name>.py`) matches a file."""

import importlib
import importlib.util
import re

import pytest

from tests.conftest import REPO

DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()
NAMES = sorted(set(re.findall(r"`((?:hobson|launch|jobs|aws)(?:\.\w+)+|hobson)`", DOC)))


def test_the_page_names_modules():
    assert len(NAMES) >= 30


@pytest.mark.parametrize("name", NAMES)
def test_named_module_exists(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        module, _, attr = name.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), name


TOP = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
# backticked paths into the checkout (a run directory's own paths, such as `runs/<id>/`, are not)
PATHS = sorted({p for p in re.findall(r"`([\w.<>-]+/[\w./<>-]*)`", DOC) if p.split("/")[0] in TOP - {"runs", "logs"}})
MODULES_RUN = sorted(set(re.findall(r"python -m ((?:hobson|launch|jobs|aws)(?:\.\w+)+)", DOC)))


def test_the_page_names_paths():
    assert len(PATHS) >= 8 and "bench/common.py" in PATHS


@pytest.mark.parametrize("path", PATHS)
def test_named_path_exists(path):
    """A path with a placeholder (`launch/backends/<name>.py`) matches at least one file."""
    pattern = re.sub(r"<\w+>", "*", path.rstrip("/"))
    assert list(REPO.glob(pattern)), path


@pytest.mark.parametrize("name", MODULES_RUN)
def test_module_run_with_python_m_exists(name):
    assert importlib.util.find_spec(name) is not None, name
