"""hobson submits its own sbatch scripts through submitit's executor, which has no public call for
a script: launch/backends/slurm.py:sbatch is the one wrapper around the private methods it needs.
This fails when submitit changes them (read its SlurmExecutor before bumping the pin)."""

import inspect

import submitit

from tests.conftest import REPO


def test_the_private_methods_hobson_relies_on_are_there():
    ex = submitit.SlurmExecutor
    assert list(inspect.signature(ex._submit_command).parameters) == ["self", "command"]
    assert list(inspect.signature(ex._make_submission_file_text).parameters) == ["self", "command", "uid"]
    assert list(inspect.signature(ex._num_tasks).parameters) == ["self"]
    # what the wrapper reads of the returned job
    src = inspect.getsource(ex._submit_command)
    assert "job_id" in src and "submission_file" in inspect.getsource(submitit.core.utils.JobPaths)


def test_only_the_wrapper_calls_them():
    callers = sorted(str(p.relative_to(REPO)) for d in ("launch", "jobs", "aws", "bench", "src")
                     for p in (REPO / d).rglob("*.py") if "_submit_command" in p.read_text())
    assert callers == ["launch/backends/slurm.py"]
