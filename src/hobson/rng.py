"""Every random generator a run draws from, captured and restored as one dict (checkpoints).

Keys: ``python``, ``numpy``, ``torch_cpu`` and, where CUDA is in use, ``torch_cuda`` (one state
per visible device). :func:`restore` also reads the decider's layout from before this module
(``torch`` and ``cuda``, the current device only), so older checkpoints still resume.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"] if "torch_cpu" in state else state["torch"])
    if torch.cuda.is_available():
        if "torch_cuda" in state:
            torch.cuda.set_rng_state_all(state["torch_cuda"])
        elif "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
