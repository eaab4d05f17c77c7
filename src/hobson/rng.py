"""Every random generator a run draws from, captured and restored as one dict (checkpoints).

Keys: ``python``, ``numpy``, ``torch_cpu`` and, where CUDA is in use, ``torch_cuda`` (one state
per visible device: the RL process trains on one GPU and may sample on another) or ``cuda`` (the
current device only: a DDP rank, which must not create a context on its neighbours' GPUs).
:func:`restore` also reads the decider's layout from before this module (``torch`` for the CPU
generator), so older checkpoints still resume.
"""

from __future__ import annotations

import random
from typing import Any, Literal

import numpy as np
import torch


def capture(cuda: Literal["all", "current"] = "all") -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and (cuda == "all" or torch.cuda.is_initialized()):
        if cuda == "all":
            state["torch_cuda"] = torch.cuda.get_rng_state_all()
        else:
            state["cuda"] = torch.cuda.get_rng_state()
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
