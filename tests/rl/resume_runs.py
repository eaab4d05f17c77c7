"""Shared by the RL resume tests: uninterrupted and stopped runs in this process, every resume in
ONE fresh process (which never saw the interrupted runs' memory), threads pinned to 1 in both
(reductions may split differently with another count; a resume checks the recorded count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hobson.jobs.rl import main

REPO = Path(__file__).resolve().parents[2]
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# the TEST-ONLY reward (rewards vary within a group) and lr 1.0 under the default global-norm clip
# 1.0 (the gradients' norms are 3-4): weights change at every update, the clip acts on every step
COMMON = ["--reward", "test-token-value", "--max-new-tokens", "6", "--prompts-per-update", "2",
          "--completions-per-prompt", "2", "--updates", "3", "--lr", "1.0"]


def full_stop_resume(runs: list[tuple[list[str], list[str]]], timeout: float) -> None:
    """For each ``(full_args, part_args)``: run ``full_args``, then ``part_args --stop-after 2``
    here; then every ``part_args --resume`` in one fresh process."""
    dist_before = {k: os.environ.get(k) for k in DIST_VARS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resumes = []
        for full, part in runs:
            assert main(full) == 0
            assert main([*part, "--stop-after", "2"]) == 0
            resumes.append([*part, "--resume"])
    finally:
        torch.set_num_threads(threads)
    # the trainer removes the rendezvous variables it set; the child picks its own port
    assert {k: os.environ.get(k) for k in DIST_VARS} == dist_before
    script = (
        "import json, sys, torch; torch.set_num_threads(1); from hobson.jobs.rl import main; "
        "sys.exit(max(main(a) for a in json.loads(sys.argv[1])))"
    )
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(resumes)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
