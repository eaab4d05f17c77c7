#!/bin/bash
# flow-dppo on a looped model (Huginn, Nanbeige) as ONE heterogeneous Slurm job: component 0 trains
# (python -m jobs.rl), component 1 serves rollouts (python -m jobs.rollout_server); weights
# reach the server as versioned publications in OUTPUT/publications/.
#
#   sbatch sbatch/flow_dppo.sh                                     # tiny Huginn + arithmetic data
#   MODEL=/models/huginn-0125 DATA=math.jsonl OUTPUT=runs/huginn-flow_dppo UPDATES=100 sbatch sbatch/flow_dppo.sh
#   OUTPUT=runs/huginn-flow_dppo sbatch sbatch/flow_dppo.sh              # a second job on OUTPUT resumes it
#   DEVICE=cpu THREADS=1 sbatch sbatch/flow_dppo.sh                # CPU nodes
#
# Settings (environment variables, all optional; details in sbatch/rl_common.sh):
#   MODEL DATA OUTPUT UPDATES STOP_AFTER RESUME DEVICE ENGINE_DEVICE MODEL_REVISION ENGINE_REVISION
#   THREADS RL_ARGS READY_TIMEOUT REQUEST_TIMEOUT PUBLISH_TIMEOUT TRANSPORT ROLLOUT_SERVERS
#   HOBSON_REPO PYTHON
#   ALGORITHM (default flow-dppo)
# Resources: component 0 is the first block of #SBATCH lines, component 1 the block after
# "#SBATCH hetjob"; change them here or on the sbatch command line (which sets component 0's).
# This file is render_rl_sbatch's job at its defaults (launch/backends/slurm_scripts.py; tested equal).

# Parameters
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=1
#SBATCH --job-name=hobson-flow_dppo
#SBATCH --mem=40G
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --open-mode=append
#SBATCH --output=logs/rl-flow_dppo-%j.log
#SBATCH --requeue
#SBATCH --signal=B:USR2@120
#SBATCH --time=24:00:00
#SBATCH hetjob
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=1
#SBATCH --mem=40G
#SBATCH --nodes=1
#SBATCH --ntasks=1

# setup
ALGORITHM=${ALGORITHM:-flow-dppo}
# shellcheck source=sbatch/rl_common.sh

# command
source "${HOBSON_REPO:-${SLURM_SUBMIT_DIR:-.}}/sbatch/rl_common.sh"

# teardown
