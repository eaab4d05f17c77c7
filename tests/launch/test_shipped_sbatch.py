"""launch/backends/slurm_scripts.py renders every shipped sbatch/*.sh byte for byte, and the RL
one is the job `submit.py rl --backend slurm` renders (no cluster needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hobson.launch.backends.slurm_scripts import SHIPPED_NAMES, render_rl_sbatch, shipped_script, split_rl_args

REPO = Path(__file__).resolve().parents[2]


def _components(text: str) -> list[list[str]]:
    """The #SBATCH options of each component, job-wide ones (name, output, time) left out."""
    comps: list[list[str]] = [[]]
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            comps.append([])
        elif line.startswith("#SBATCH ") and not line.startswith(("#SBATCH --job-name", "#SBATCH --output")):
            comps[-1].append(line)
    return [sorted(c) for c in comps]


@pytest.mark.parametrize("name,alg", [("grpo", "grpo"), ("ppo", "ppo"), ("dppo", "dppo"), ("flow_dppo", "flow-dppo")])
def test_rendered_script_matches_the_sbatch_file(name: str, alg: str) -> None:
    shipped = (REPO / "sbatch" / f"{name}.sh").read_text()
    rendered = render_rl_sbatch(["--algorithm", alg], repo=str(REPO), log="logs/x.log")
    assert _components(rendered) == _components(shipped)
    assert len(_components(rendered)) == 2
    assert f"#SBATCH --job-name=hobson-{name}" in rendered and f"#SBATCH --job-name=hobson-{name}" in shipped
    assert f"ALGORITHM=${{ALGORITHM:-{alg}}}" in shipped and f"export ALGORITHM={alg}" in rendered
    for text in (rendered, shipped):
        # the render's command section (after its settings) is the one line sourcing the shared body
        assert 'rl_common.sh"' in text.split("# command\n")[1].splitlines()[0]
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_every_shipped_script_has_a_renderer() -> None:
    shipped = {p.stem for p in (REPO / "sbatch").glob("*.sh")} - {"rl_common"}  # the RL scripts' shared body
    assert shipped == set(SHIPPED_NAMES)


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_shipped_script_is_the_renderers_output_byte_for_byte(name: str) -> None:
    shipped = (REPO / "sbatch" / f"{name}.sh").read_text()
    assert shipped == shipped_script(name), (
        f"sbatch/{name}.sh differs from the renderer at its defaults: edit launch/backends/slurm_scripts.py, then "
        "`python -m hobson.launch.backends.slurm_scripts --write`")


def test_flags_become_settings_and_the_rest_rl_args() -> None:
    env, rest = split_rl_args(["--model", "/m", "--updates=5", "--resume", "--lr", "0.1", "--recompute",
                               "--data", "a b.jsonl"])
    assert env == {"MODEL": "/m", "UPDATES": "5", "RESUME": "1", "DATA": "a b.jsonl"}
    assert rest == ["--lr", "0.1", "--recompute"]
    text = render_rl_sbatch(["--model", "/m", "--lr", "0.1", "--data", "a b.jsonl"], repo="/r", log="l.log",
                            colocated=True, train_gpus=3, rollout_gpus=1, partition="gpu")
    assert "#SBATCH hetjob" not in text
    assert "#SBATCH --gpus-per-node=4" in text and "#SBATCH --partition=gpu" in text
    assert "export DATA='a b.jsonl'" in text and "export RL_ARGS='--lr 0.1'" in text
    assert "export COLOCATED=1" in text and "export ROLLOUT_GPUS=1" in text
    with pytest.raises(ValueError, match="--model needs a value"):
        split_rl_args(["--model"])


def test_common_body_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(REPO / "sbatch" / "rl_common.sh")], check=True)
