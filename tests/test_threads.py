"""hobson.threads: the one place torch's thread count is set."""

from __future__ import annotations

import ast

import torch

from hobson.threads import set_threads, threads
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
