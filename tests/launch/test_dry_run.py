"""The Slurm dry-run of `recipe all --ngpu 8` is kept as a golden file (run-specific paths normalised)."""

import os
import re
from pathlib import Path

from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden" / "recipe_all_ngpu8.sbatch"


def normalise(text: str, run_dir: Path, logs: Path) -> str:
    text = text.replace(str(run_dir), "$RUN_DIR").replace(str(logs), "$LOGS").replace(str(REPO), "$REPO")
    return text.replace(f"hobson-{run_dir.name}-", "hobson-$RUN_ID-")


def test_dry_run_matches_golden(cli, tmp_path):
    run_dir = tmp_path / "run-x"
    out = cli("recipe", "all", "--dry-run", "--backend", "slurm", "--ngpu", "8", "--run-dir", str(run_dir),
              "--logs-dir", str(tmp_path / "logs")).stdout
    text = normalise(out, run_dir.resolve(), (tmp_path / "logs" / "run-x").resolve())
    assert not run_dir.exists(), "a dry run must create nothing"
    if os.environ.get("HOBSON_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"missing golden file; create it with: HOBSON_UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == GOLDEN.read_text(), (
        f"dry-run differs from {GOLDEN}; if the change is intended refresh it with:\n"
        f"  rm {GOLDEN} && HOBSON_UPDATE_GOLDEN=1 python -m pytest {__file__}")


def test_dry_run_has_the_teacher_array_and_its_merge(cli, tmp_path):
    out = cli("recipe", "all", "--dry-run", "--backend", "slurm", "--ngpu", "8",
              "--run-dir", str(tmp_path / "r")).stdout
    jobs = out.split("# ===== job ")[1:]
    by_name = {j.split(":", 1)[1].split("(")[0].strip(): j for j in jobs}
    assert sorted(by_name) == sorted(["fetch", "build", "multistep", "generated", "adequacy", "catchall", "teacher",
                                      "teacher-merge", "parent", "replay", "replay-merge", "distill", "train",
                                      "calibrate", "eval"])
    for array in ("teacher", "replay"):
        assert "#SBATCH --array=0-7%8" in by_name[array]
        assert "#SBATCH --gpus-per-node=1" in by_name[array]
        assert re.search(rf"#SBATCH --dependency=afterok:\{{job:{array}\}}", by_name[f"{array}-merge"])
    for torchrun in ("parent", "train"):
        assert "#SBATCH --gpus-per-node=8" in by_name[torchrun] and "--torchrun 8" in by_name[torchrun]
        assert "#SBATCH --signal=B:USR2@120" in by_name[torchrun] and "#SBATCH --requeue" in by_name[torchrun]
    assert "{job:parent}" in by_name["replay"] and "{job:distill}" in by_name["train"]
    order = list(by_name)
    for name, body in by_name.items():
        m = re.search(r"#SBATCH --dependency=afterok:(\S+)", body)
        if m:
            assert "#SBATCH --kill-on-invalid-dep=yes" in body
            for dep in re.findall(r"\{job:([\w-]+)\}", m.group(1)):
                assert order.index(dep) < order.index(name), f"{name} depends on later job {dep}"


def test_training_over_several_nodes_and_the_ranks_network(cli, tmp_path):
    """``stages.<stage>.nodes`` spreads a torchrun stage's --ngpu ranks over that many nodes; the
    profile's rendezvous address and interface reach every node's torchrun."""
    prof = tmp_path / "c.yaml"
    prof.write_text("rdzv_address: head-0.cluster\nsocket_ifname: ib0,ib1\n"
                    "stages:\n  parent: {nodes: 2}\n  train: {nodes: 4}\n")
    out = cli("recipe", "all", "--dry-run", "--backend", "slurm", "--ngpu", "8", "--cluster", str(prof),
              "--run-dir", str(tmp_path / "r")).stdout
    by_name = {j.split(":", 1)[1].split("(")[0].strip(): j for j in out.split("# ===== job ")[1:]}
    for stage, nodes in (("parent", 2), ("train", 4)):
        body = by_name[stage]
        assert f"#SBATCH --nodes={nodes}" in body and "#SBATCH --ntasks-per-node=1" in body
        assert f"#SBATCH --gpus-per-node={8 // nodes}" in body and f"--torchrun {8 // nodes} " in body
        assert "export GLOO_SOCKET_IFNAME=ib0,ib1 NCCL_SOCKET_IFNAME=ib0,ib1" in body
        assert "head=head-0.cluster\n" in body and 'HOBSON_RDZV="$head:$(( 20000 + SLURM_JOB_ID % 20000 ))"' in body
    assert "#SBATCH --nodes=1" in by_name["replay"] and "GLOO_SOCKET_IFNAME" not in by_name["replay"]


def test_nodes_that_cannot_take_the_ranks_are_one_error(cli, tmp_path):
    prof = tmp_path / "c.yaml"
    for stages, ngpu, message in (("train: {nodes: 3}", "8", "stages.train.nodes: 3 does not divide the 8 ranks"),
                                  ("teacher: {nodes: 2}", "2", "stages.teacher.nodes: 2: only the torchrun"),
                                  ("train: {nodes: 0}", "2", "stages.train:?: 'nodes' must be >= 1, got 0")):
        prof.write_text(f"stages:\n  {stages}\n")
        proc = cli("recipe", "all", "--backend", "slurm", "--ngpu", ngpu, "--cluster", str(prof),
                   "--run-dir", str(tmp_path / "r"), check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("slurm/*")), "nothing submitted"
