#!/bin/bash
# Run the whole decider recipe inside ONE Slurm allocation (one node, its GPUs), on the local
# backend: the same stages, records and outputs as `python launch/submit.py recipe ...`, for
# clusters where a single long job is easier to get than a chain of jobs.
#
#   sbatch sbatch/recipe.sh                       # all stages, every GPU of the node
#   STAGES="build multistep teacher" RUN_DIR=runs/mine sbatch sbatch/recipe.sh
#   sbatch --gpus-per-node=1 --cpus-per-task=2 --mem=8G sbatch/recipe.sh   # a smaller node
#
# Settings (environment variables, all optional):
#   STAGES   stages to run (default: all)
#   RUN_DIR  run directory (default: runs/slurm-$SLURM_JOB_ID); reuse one to continue a run
#   CONFIG   recipe config (default: configs/recipe.yaml)
#   NGPU     GPUs to use (default: the GPUs Slurm gave this job, at least 1)
#   PYTHON   interpreter (default: python)
# This file is recipe_script()'s output (launch/backends/slurm_scripts.py; a test keeps them equal).

# Parameters
#SBATCH --cpus-per-task=16
#SBATCH --gpus-per-node=8
#SBATCH --job-name=hobson-recipe
#SBATCH --mem=128G
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=logs/recipe-%j.log
#SBATCH --time=04:00:00

# setup
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
STAGES=${STAGES:-all}
RUN_DIR=${RUN_DIR:-runs/slurm-${SLURM_JOB_ID:-local}}
CONFIG=${CONFIG:-configs/recipe.yaml}
PYTHON=${PYTHON:-python}
if [ -z "${NGPU:-}" ]; then
  NGPU=$(echo "${CUDA_VISIBLE_DEVICES:-0}" | tr ',' '\n' | grep -c . || true)
  [ "$NGPU" -ge 1 ] || NGPU=1
fi

# command
# shellcheck disable=SC2086  # STAGES is a list of words
exec "$PYTHON" launch/submit.py recipe $STAGES --backend local --ngpu "$NGPU" --run-dir "$RUN_DIR" --config "$CONFIG"

# teardown
