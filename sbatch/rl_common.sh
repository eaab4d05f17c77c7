# The body of sbatch/grpo.sh, ppo.sh, dppo.sh and flow_dppo.sh (and of the scripts that
# `python launch/submit.py rl --backend slurm` renders): sourced, never submitted itself.
#
# Heterogeneous job: this batch shell runs on component 0. It starts the rollout server on
# component 1 (`srun --het-group=1`), waits until the server's address file exists and the
# server answers a real readiness request (deadline READY_TIMEOUT, not a sleep), then runs the
# trainer on component 0 (`srun --het-group=0 python -m hobson.jobs.rl ... --engine-address-file`).
# If either component exits, the other is stopped and the job fails with the component's exit
# code and a line naming it. A hung engine is found by the trainer's deadlines on every request
# (REQUEST_TIMEOUT) and every publication (PUBLISH_TIMEOUT). COLOCATED=1: one-component job,
# both processes on this node (`srun --overlap`), the node's GPUs split (the rollout server
# takes the last ROLLOUT_GPUS of them).
#
# Settings (environment variables, all optional; ALGORITHM is set by the calling script):
#   ALGORITHM        ppo | grpo | dppo | flow-dppo
#   MODEL            model directory; empty: the embedded tiny Huginn (CPU-sized test model)
#   DATA             prompts JSONL (string prompt, label); empty: the shipped arithmetic data
#   OUTPUT           run directory (default runs/rl-$ALGORITHM-$SLURM_JOB_ID; a requeued job keeps its id)
#   UPDATES          total updates of the run (default 3)
#   STOP_AFTER       stop, checkpointed, after this update (empty: run to UPDATES)
#   RESUME           auto (default): continue OUTPUT's run if it has one (a requeued job or a
#                    second job on the same OUTPUT resumes from its last checkpoint) | 1 | 0
#   DEVICE           training device (default cuda; cpu for the tiny model on CPU nodes)
#   ENGINE_DEVICE    rollout device of the server (default: DEVICE)
#   MODEL_REVISION   model revision recorded and checked (empty: the model dir's own)
#   ENGINE_REVISION  engine revision recorded in publications (empty: hobson-native-torch-<version>)
#   THREADS          torch threads in both components (empty: torch's default; the server always
#                    uses the trainer's count, since rollout bits depend on it)
#   RL_ARGS          more `python -m jobs.rl` flags, e.g. "--prompts-per-update 8 --recompute"
#   READY_TIMEOUT    seconds for the rollout server to answer its readiness check (default 600)
#   REQUEST_TIMEOUT  seconds for one generate request (default 600)
#   PUBLISH_TIMEOUT  seconds for one publication to be loaded and committed (default 600)
#   TRANSPORT        how each version reaches the server: shared-dir (default: files in OUTPUT) |
#                    dist (a process group of the two components: no publication files)
#   ROLLOUT_SERVERS  rollout servers, the rollout component's tasks (default 1); N > 1 needs the
#                    component's #SBATCH block to ask for N tasks (--ntasks=N --gpus-per-task=1,
#                    as `submit.py rl --rollout-servers N` renders it); any N gives the same bits
#   COLOCATED        1: both components in this one-component job (default 0: heterogeneous)
#   ROLLOUT_GPUS     GPUs the colocated server takes from the node's list (default 1)
#   RUN_DIR          the run record of a job submitted with plain sbatch (default runs/slurm-$SLURM_JOB_ID):
#                    `python launch/submit.py status|logs|cancel|retry RUN_DIR` (the launcher sets
#                    HOBSON_LAUNCHED=1 in what it submits, and keeps its own record)
#   HOBSON_REPO      the checkout to run in: relative paths start there (default $SLURM_SUBMIT_DIR)
#   PYTHON           interpreter with hobson installed (default python); an editable install of
#                    HOBSON_REPO (`pip install -e .` there, the README's set-up) runs that checkout's code
#
# Requeue: USR2 to the batch shell makes the job requeue itself (the scripts ask Slurm for USR2
# 120 s before the time limit); a requeued job (USR2, `scontrol requeue`, node failure) keeps its
# id and OUTPUT, so RESUME=auto continues from the last checkpoint and republishes its weights
# before the first rollout.

set -euo pipefail
HOBSON_REPO=${HOBSON_REPO:-${SLURM_SUBMIT_DIR:-.}}
cd "$HOBSON_REPO"
PYTHON=${PYTHON:-python}
ALGORITHM=${ALGORITHM:?set ALGORITHM (ppo, grpo, dppo or flow-dppo)}
MODEL=${MODEL:-}
DATA=${DATA:-}
JOB_ID=${SLURM_JOB_ID:-local}
OUTPUT=${OUTPUT:-runs/rl-$ALGORITHM-$JOB_ID}
UPDATES=${UPDATES:-3}
STOP_AFTER=${STOP_AFTER:-}
RESUME=${RESUME:-auto}
DEVICE=${DEVICE:-cuda}
ENGINE_DEVICE=${ENGINE_DEVICE:-$DEVICE}
MODEL_REVISION=${MODEL_REVISION:-}
ENGINE_REVISION=${ENGINE_REVISION:-}
THREADS=${THREADS:-}
RL_ARGS=${RL_ARGS:-}
READY_TIMEOUT=${READY_TIMEOUT:-600}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-600}
PUBLISH_TIMEOUT=${PUBLISH_TIMEOUT:-600}
TRANSPORT=${TRANSPORT:-shared-dir}
COLOCATED=${COLOCATED:-0}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-1}
ROLLOUT_SERVERS=${ROLLOUT_SERVERS:-1}
[ -z "$THREADS" ] || export OMP_NUM_THREADS="$THREADS"

say() { echo "hobson-rl: $*" >&2; }

# ---- where each component runs
if [ "$COLOCATED" = 1 ] && [ "$ROLLOUT_SERVERS" != 1 ]; then
  say "FAILED: ROLLOUT_SERVERS=$ROLLOUT_SERVERS needs the heterogeneous job (COLOCATED=0): one server per task, one GPU each"
  exit 2
fi
if [ "$COLOCATED" = 1 ]; then
  TRAIN_SRUN=(srun --overlap --nodes=1 --ntasks=1)
  SERVE_SRUN=(srun --overlap --nodes=1 --ntasks=1)
  TRAIN_NAME="training process (colocated)"
  SERVE_NAME="rollout component (colocated server)"
  TRAIN_ENV=() SERVE_ENV=()
  IFS=, read -ra GPUS <<< "${CUDA_VISIBLE_DEVICES:-}"
  if [ "${#GPUS[@]}" -gt "$ROLLOUT_GPUS" ]; then   # split the node's GPUs: trainer first, server last
    KEEP=$(( ${#GPUS[@]} - ROLLOUT_GPUS ))
    TRAIN_ENV=(env "CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${GPUS[*]:0:$KEEP}")")
    SERVE_ENV=(env "CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${GPUS[*]:$KEEP}")")
  fi
else
  TRAIN_SRUN=(srun --het-group=0 --nodes=1 --ntasks=1)
  SERVE_SRUN=(srun --het-group=1 --nodes=1 --ntasks=1)
  if [ "$ROLLOUT_SERVERS" != 1 ]; then   # one task per server, wherever the component's tasks are
    HAVE=${SLURM_NTASKS_HET_GROUP_1:-${SLURM_NTASKS_PACK_GROUP_1:-}}
    if [ -n "$HAVE" ] && [ "$HAVE" -lt "$ROLLOUT_SERVERS" ]; then
      say "FAILED: ROLLOUT_SERVERS=$ROLLOUT_SERVERS but the rollout component (het group 1) has $HAVE task(s);" \
          "ask for --ntasks=$ROLLOUT_SERVERS --gpus-per-task=1 in its #SBATCH block (after '#SBATCH hetjob')"
      exit 2
    fi
    SERVE_SRUN=(srun --het-group=1 --ntasks="$ROLLOUT_SERVERS")
  fi
  TRAIN_NAME="training component (het group 0)"
  SERVE_NAME="rollout component (het group 1)"
  TRAIN_ENV=() SERVE_ENV=()
fi

# ---- the trainer's flags
ADDR="$OUTPUT/engine/address-$JOB_ID.json"
# several servers: each writes its own address file, {index} its SLURM_PROCID; one secret for all
[ "$ROLLOUT_SERVERS" = 1 ] || ADDR="$OUTPUT/engine/address-$JOB_ID-{index}.json"
RL=(--algorithm "$ALGORITHM" --output "$OUTPUT" --updates "$UPDATES" --device "$DEVICE"
    --engine-address-file "$ADDR" --engine-timeout "$REQUEST_TIMEOUT" --publish-timeout "$PUBLISH_TIMEOUT"
    --engine-ready-timeout "$READY_TIMEOUT" --transport "$TRANSPORT")
[ "$ROLLOUT_SERVERS" = 1 ] || RL+=(--rollout-servers "$ROLLOUT_SERVERS")
[ -z "$MODEL" ] || RL+=(--model "$MODEL")
[ -z "$DATA" ] || RL+=(--data "$DATA")
[ -z "$STOP_AFTER" ] || RL+=(--stop-after "$STOP_AFTER")
[ -z "$MODEL_REVISION" ] || RL+=(--model-revision "$MODEL_REVISION")
[ -z "$ENGINE_REVISION" ] || RL+=(--engine-revision "$ENGINE_REVISION")
if [ "$RESUME" = 1 ] || { [ "$RESUME" = auto ] && [ -f "$OUTPUT/run.json" ]; }; then
  RL+=(--resume)
fi
# shellcheck disable=SC2206  # RL_ARGS is a list of words
RL+=($RL_ARGS)

# ---- the run record: a job the launcher did not submit (plain `sbatch sbatch/<alg>.sh`) records
# itself in RUN_DIR, the launcher's own run.json, so `python launch/submit.py status|logs|cancel|retry
# RUN_DIR` work on it too
if [ -z "${HOBSON_LAUNCHED:-}" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  RUN_DIR=${RUN_DIR:-runs/slurm-$JOB_ID}
  REC=(--algorithm "$ALGORITHM" --output "$(realpath -m "$OUTPUT")" --updates "$UPDATES" --device "$DEVICE"
       --engine-device "$ENGINE_DEVICE" --engine-timeout "$REQUEST_TIMEOUT" --publish-timeout "$PUBLISH_TIMEOUT"
       --engine-ready-timeout "$READY_TIMEOUT" --transport "$TRANSPORT")
  [ "$ROLLOUT_SERVERS" = 1 ] || REC+=(--rollout-servers "$ROLLOUT_SERVERS")
  [ -z "$MODEL" ] || REC+=(--model "$(realpath -m "$MODEL")")
  [ -z "$DATA" ] || REC+=(--data "$(realpath -m "$DATA")")
  [ -z "$MODEL_REVISION" ] || REC+=(--model-revision "$MODEL_REVISION")
  [ -z "$ENGINE_REVISION" ] || REC+=(--engine-revision "$ENGINE_REVISION")
  # shellcheck disable=SC2206  # RL_ARGS is a list of words
  REC+=($RL_ARGS)
  COLO=(); [ "$COLOCATED" != 1 ] || COLO=(--colocated)
  "$PYTHON" -m hobson.launch.sbatch_record --run-dir "$RUN_DIR" --job-id "$JOB_ID" "${COLO[@]}" -- "${REC[@]}" ||
    say "warning: could not write the run record in $RUN_DIR"
fi

# stop PID (an srun): TERM (srun passes it to its step), KILL after 10 s; reaps it
stop() {
  kill -TERM "$1" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# ---- component 1: the rollout server
mkdir -p "$OUTPUT/engine"
# a requeued job must not find the previous servers' addresses
rm -f "$OUTPUT/engine/address-$JOB_ID.json" "$OUTPUT/engine/address-$JOB_ID"-[0-9]*.json
"${SERVE_SRUN[@]}" "${SERVE_ENV[@]}" "$PYTHON" -m hobson.jobs.rollout_server --address-file "$ADDR" --device "$ENGINE_DEVICE" &
SERVER=$!
code=0
"$PYTHON" -m hobson.jobs.rollout_server --wait --address-file "$ADDR" --servers "$ROLLOUT_SERVERS" \
  --timeout "$READY_TIMEOUT" --watch-pid "$SERVER" || code=$?
if [ "$code" != 0 ]; then
  scode=0
  kill -0 "$SERVER" 2>/dev/null && stop "$SERVER"
  wait "$SERVER" 2>/dev/null || scode=$?
  say "FAILED: the $SERVE_NAME did not become ready within ${READY_TIMEOUT} s (its exit code $scode)"
  exit $(( scode ? scode : 1 ))
fi
for i in $(seq 0 $(( ROLLOUT_SERVERS - 1 ))); do say "$SERVE_NAME ready: $(cat "${ADDR//\{index\}/$i}")"; done

# ---- component 0: the trainer
"${TRAIN_SRUN[@]}" "${TRAIN_ENV[@]}" "$PYTHON" -m hobson.jobs.rl "${RL[@]}" &
TRAINER=$!

# USR2 (sbatch --signal=B:USR2@N before the time limit, or `scancel --batch --signal=USR2`):
# requeue; the job runs again with the same id and OUTPUT, and resumes from the last checkpoint
trap 'say "USR2: requeueing job $JOB_ID; it resumes from the last checkpoint"; scontrol requeue "$JOB_ID"' USR2
while :; do
  code=0
  FIRST=
  wait -n -p FIRST "$SERVER" "$TRAINER" || code=$?
  [ -z "$FIRST" ] || break   # else a trapped signal interrupted the wait: keep waiting
done
if [ "$FIRST" = "$TRAINER" ]; then
  if [ "$code" = 0 ]; then
    # the trainer's close() shut the server down; give it a deadline all the same
    for _ in $(seq 300); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
    stop "$SERVER"
    say "done: $OUTPUT"
    exit 0
  fi
  # was the rollout server the cause (gone or hung)? the trainer's own error line says how
  if ! kill -0 "$SERVER" 2>/dev/null \
      || ! "$PYTHON" -m hobson.jobs.rollout_server --ping --address-file "$ADDR" --servers "$ROLLOUT_SERVERS" \
        --timeout 10 >/dev/null 2>&1; then
    stop "$SERVER"
    say "FAILED: the $SERVE_NAME is gone or not answering; the $TRAIN_NAME stopped with exit code $code"
  else
    stop "$SERVER"
    say "FAILED: the $TRAIN_NAME exited with code $code; stopped the $SERVE_NAME"
  fi
  exit "$code"
fi
# the server ended first: fine only if the trainer then finishes (it shut the server down)
if [ "$code" = 0 ]; then
  tcode=0
  for _ in $(seq 600); do kill -0 "$TRAINER" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$TRAINER" 2>/dev/null && stop "$TRAINER"
  wait "$TRAINER" 2>/dev/null || tcode=$?
  if [ "$tcode" = 0 ]; then say "done: $OUTPUT"; exit 0; fi
  say "FAILED: the $SERVE_NAME exited (code 0) before the $TRAIN_NAME finished (its exit code $tcode)"
  exit "$tcode"
fi
# a trainer that already finished (its close() shut the server down) may still be exiting; it
# ends on its own within seconds, and a trainer whose server died mid-run fails its next request
tcode=
for _ in $(seq 100); do kill -0 "$TRAINER" 2>/dev/null || break; sleep 0.1; done
if ! kill -0 "$TRAINER" 2>/dev/null; then
  tcode=0
  wait "$TRAINER" 2>/dev/null || tcode=$?
  if [ "$tcode" = 0 ]; then
    say "done: $OUTPUT (the $SERVE_NAME exited with code $code after the $TRAIN_NAME shut it down)"
    exit 0
  fi
fi
say "FAILED: the $SERVE_NAME exited with code $code while the $TRAIN_NAME was running; stopping training"
[ -n "$tcode" ] || stop "$TRAINER"
exit "$code"
