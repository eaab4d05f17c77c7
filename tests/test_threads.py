"""hobson.threads: the one place torch's thread count is set."""

from __future__ import annotations

import ast
import subprocess
import sys

import torch

from hobson.threads import set_threads, set_threads_before_torch, threads
from tests.conftest import REPO


def test_set_threads_takes_the_flag_then_hobson_cpus(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("HOBSON_CPUS", "1")
        assert set_threads(None) == 1 and torch.get_num_threads() == 1
        assert set_threads(2) == 2 and torch.get_num_threads() == 2
        monkeypatch.delenv("HOBSON_CPUS")
        assert set_threads(None) is None and torch.get_num_threads() == 2  # left as it was
    finally:
        torch.set_num_threads(before)


def test_set_threads_before_torch_imports_nothing_and_torch_starts_with_the_count(subprocess_env):
    """The stage wrapper's call: a data stage never imports torch; one that does gets the count."""
    code = ("import sys; from hobson.threads import set_threads_before_torch as s; s(1); "
            "assert 'torch' not in sys.modules; import torch; print(torch.get_num_threads())")
    env = {**subprocess_env, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "HOBSON_CPUS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["1"], out.stderr
    before = torch.get_num_threads()
    try:
        set_threads_before_torch(1)  # torch imported here: set at once
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_threads_block_puts_the_callers_count_back():
    before = torch.get_num_threads()
    with threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with threads(None):
        assert torch.get_num_threads() == before


def test_no_other_thread_setting_helper():
    """Each duplicated helper exists once: no module defines its own thread setter or keeper."""
    own = []
    for root in ("src", "jobs", "launch", "aws", "bench"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and "threads" in node.name and path.name != "threads.py":
                    body = ast.unparse(node)
                    if "set_num_threads" in body:
                        own.append(f"{path.relative_to(REPO)}: {node.name}")
    assert own == []


def test_the_library_sets_threads_only_through_hobson_threads():
    """Results depend on the count, so every setting goes through one function (bench scripts,
    which pin threads for a measurement, may call torch directly)."""
    calls = []
    for root in ("src", "jobs", "launch", "aws"):
        for path in (REPO / root).rglob("*.py"):
            if path.name == "threads.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "set_num_threads":
                    calls.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert calls == []
