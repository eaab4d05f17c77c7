"""Fixtures of the RL tests: a rollout server in its own process on localhost."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.rl.servers import start_server, stop_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    addr = tmp_path / "engine" / "address.json"
    proc = start_server(addr)
    yield addr, proc
    stop_server(proc)


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
