from hobson.launch.sbatch import VALID_OPTIONS, render_sbatch


def test_options_come_from_the_signature():
    assert VALID_OPTIONS["kill_on_invalid_dep"] is True
    assert "array" in VALID_OPTIONS and "command" not in VALID_OPTIONS


def test_sections_and_sorted_parameters():
    text = render_sbatch("exec python -m x", job_name="j", output="/l/j_%a.log", array="0-7%8",
                         gpus_per_node=1, dependency="afterok:12:13", extra=("--reservation=r",),
                         setup=("cd /repo",))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    params = [ln for ln in lines if ln.startswith("#SBATCH")]
    assert params == sorted(params)
    assert "#SBATCH --array=0-7%8" in params
    assert "#SBATCH --dependency=afterok:12:13" in params
    assert "#SBATCH --kill-on-invalid-dep=yes" in params
    assert "#SBATCH --reservation=r" in params
    assert lines.index("# setup") < lines.index("cd /repo") < lines.index("# command") < lines.index("exec python -m x")


def test_no_dependency_means_no_kill_on_invalid_dep():
    text = render_sbatch("true", job_name="j", output="o")
    assert "kill-on-invalid-dep" not in text and "--dependency" not in text


def test_values_the_shell_would_split_are_quoted():
    text = render_sbatch("true", job_name="j", output="o", constraint="a100 | h100")
    assert "#SBATCH --constraint='a100 | h100'" in text
