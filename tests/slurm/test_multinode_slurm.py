"""Decider training (`parent`, `train`) as torchrun over 2 nodes x 1 rank on the local cluster.

The cluster profile spreads each stage's 2 ranks over 2 nodes (``stages.<stage>.nodes``) and names
the ranks' network interface (``socket_ifname``). Every node of the cluster is a slurmd on this
host, so this proves the orchestration (one srun task per node, one c10d rendezvous on the job's
first node, ranks that split each step's micro-batches), not cross-host networking.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from hobson.io import sha256_file
from tests.slurm.test_recipe_slurm import job_ids, submit, wait_all

TWO_NODES = "socket_ifname: lo\nstages:\n  parent: {nodes: 2}\n  train: {nodes: 2}\n"
RANK_LINE = re.compile(r"^\[hobson\] rank (\d) of WORLD_SIZE=(\d+) \(local rank (\d)\) on SLURMD_NODENAME=(\S+), "
                       r"rendezvous (\S+), GLOO_SOCKET_IFNAME=(\S+) NCCL_SOCKET_IFNAME=(\S+)$", re.M)


@pytest.mark.slow
def test_parent_and_train_on_two_nodes_equal_two_ranks_on_one(tmp_path, slurm_jobs, tiny_training):
    """Slow: two torchrun jobs of 2 nodes each, at once (4 ranks on this machine's 2 cores)."""
    run_dir = tiny_training.copy_inputs(tmp_path / "run")
    profile = tmp_path / "two-nodes.yaml"
    profile.write_text(TWO_NODES)
    configs = {s: tiny_training.write_config(s, tmp_path / f"{s}.yaml", trace_dir=str(tmp_path / f"trace-{s}"))
               for s in ("parent", "train")}
    meta = submit(run_dir, "parent", "train", args=["--cluster", str(profile), "--parent-config",
                                                    str(configs["parent"]), "--train-config", str(configs["train"])])
    ids = {name: v[0] for name, v in job_ids(meta).items()}
    assert set(ids) == {"parent", "train"}
    states = wait_all(slurm_jobs, meta, deadline_s=300)
    assert set(states.values()) == {"COMPLETED"}, states

    for stage, job in ids.items():
        script = next(s["script"] for s in meta["submissions"] if s.get("job_id") == job)
        text = open(script).read()
        assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=1" in text, text
        assert "--torchrun 1" in text and "export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo" in text, text
        (row,) = slurm_jobs.sacct([job], fields=("JobID", "NNodes", "NodeList", "AllocTRES"))
        nodes = slurm_jobs.run(["scontrol", "show", "hostnames", row["NodeList"]]).stdout.split()
        assert row["NNodes"] == "2" and len(nodes) == 2 and "gres/gpu=2" in row["AllocTRES"], row

        # each rank's line: WORLD_SIZE=2, ranks 0 and 1 on the job's two nodes, one rendezvous
        # endpoint on its first node with the job's port
        log = (tmp_path / "logs" / "run" / f"{stage}.log").read_text()
        ranks = {int(m[0]): m for m in RANK_LINE.findall(log)}
        assert sorted(ranks) == [0, 1], log
        assert {m[1] for m in ranks.values()} == {"2"} and {m[2] for m in ranks.values()} == {"0"}
        assert sorted(m[3] for m in ranks.values()) == sorted(nodes)
        assert {m[4] for m in ranks.values()} == {f"{nodes[0]}:{20000 + int(job) % 20000}"}
        assert {m[5] for m in ranks.values()} == {m[6] for m in ranks.values()} == {"lo"}
        record = [json.loads(line) for line in (run_dir / "stages.jsonl").read_text().splitlines()][-2:]
        assert {r["stage"]: r["world_size"] for r in record}[stage] == 2

        # every step's rows, split into two disjoint halves, one per rank (the trainer's trace)
        trace = tmp_path / f"trace-{stage}"
        steps = [json.loads(line) for line in log.splitlines() if line.startswith('{"acc"')]
        assert [s["step"] for s in steps] == list(range(1, tiny_training.steps + 1))
        for s in steps:
            halves = [set(json.loads((trace / f"tokens_step{s['step']:04d}_rank{r}.json").read_text())) for r in (0, 1)]
            assert halves[0] and halves[1] and not halves[0] & halves[1], (stage, s["step"])
            assert len(halves[0]) + len(halves[1]) == s["rows"]

        # the same bytes as 2 ranks on one node; within 1e-5 of one process
        for name in ("adapter.safetensors", "head.safetensors"):
            final = run_dir / stage / "final" / name
            assert sha256_file(final) == sha256_file(tiny_training.two_ranks[stage] / name), (stage, name)
            mine, one = load_file(final), load_file(tiny_training.one_process[stage] / name)
            assert mine.keys() == one.keys()
            for key in one:
                torch.testing.assert_close(mine[key], one[key], rtol=1e-5, atol=0)
