#!/usr/bin/env bash
# Host set-up for the AWS backend, run from an unpacked code archive by the SSM command.
# Idempotent: a second run reinstalls the dependencies only when setup.py, the extras or the
# interpreter changed; it always points the venv's hobson at the code dir it runs from.
#
#   bash aws/host_setup.sh --home /opt/dlami/nvme/hobson [--python python3] [--no-venv] [--extras aws,train]
#                          [--scratch-mount /opt/dlami/nvme] [--prefetch MODEL_ID]...
#   bash aws/host_setup.sh --check [--python python3]     # only print versions and the GPU count
#   ... --no-check                                          # set up without the check (it imports torch)
#
# 1. scratch: if --scratch-mount is given, nothing is mounted there, and the host has unmounted
#    instance-store NVMe disks, they are formatted (RAID 0 when several) and mounted there;
# 2. a venv at <home>/venv that sees the image's CUDA torch (--system-site-packages; a torch wheel
#    for the driver's CUDA is installed only when the image has none) plus setup.py's extras, and
#    this code dir installed editable into it on every run, so the run imports this code (hobson,
#    hobson.launch, hobson.jobs, hobson.aws); with --no-venv the interpreter is used as it is;
# 3. <home>/hf-cache as HF_HOME, models pre-fetched into it when the host reaches huggingface.co;
# 4. <home>/env.sh (HOBSON_PYTHON, HF_HOME, TMPDIR) for the run to source; then the check.
set -euo pipefail

HOME_DIR="" PY="python3" VENV=1 EXTRAS="aws,train" SCRATCH="" CHECK_ONLY=0 CHECK=1
PREFETCH=()
while [ $# -gt 0 ]; do
  case "$1" in
    --home) HOME_DIR="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --no-venv) VENV=0; shift ;;
    --extras) EXTRAS="$2"; shift 2 ;;
    --scratch-mount) SCRATCH="$2"; shift 2 ;;
    --prefetch) PREFETCH+=("$2"); shift 2 ;;
    --check) CHECK_ONLY=1; shift ;;
    --no-check) CHECK=0; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "host_setup.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

check() {  # versions and GPU count; fails if the interpreter cannot import the stack
  "$1" - <<'PYEOF'
import platform, shutil, subprocess, sys
from importlib.metadata import PackageNotFoundError, version
print(f"[host] python {platform.python_version()} at {sys.executable}")
for dist in ("torch", "transformers", "peft", "accelerate", "boto3", "pyyaml", "numpy"):
    try:  # metadata only: importing transformers/peft costs seconds and proves nothing more
        print(f"[host] {dist} {version(dist)}")
    except PackageNotFoundError:
        print(f"[host] {dist} missing")
import torch
cuda = torch.version.cuda or "none"
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"[host] torch CUDA {cuda}; GPUs visible to torch: {n}")
if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"[host] nvidia-smi GPUs: {len(out)}")
    if len(out) != n:
        raise SystemExit(f"[host] nvidia-smi sees {len(out)} GPUs but torch sees {n}: torch/driver mismatch")
print(f"[host] GPU count: {n}")
try:  # the code the run imports: this code dir in the venv, whatever is installed with --no-venv
    import hobson.launch
    print(f"[host] hobson.launch from {hobson.launch.__path__[0]}")
except ImportError as e:
    print(f"[host] hobson.launch not importable ({e}): install hobson (pip install -e .) into this python")
PYEOF
}

if [ "$CHECK_ONLY" = 1 ]; then check "$PY"; exit 0; fi
[ -n "$HOME_DIR" ] || { echo "host_setup.sh: --home is required" >&2; exit 2; }
[ -f setup.py ] || { echo "host_setup.sh: run it from the unpacked code (setup.py not in $(pwd))" >&2; exit 2; }

# 1. scratch on local NVMe
if [ -n "$SCRATCH" ] && [ "$(id -u)" = 0 ] && ! mountpoint -q "$SCRATCH" 2>/dev/null; then
  mapfile -t DISKS < <(lsblk -dpno NAME,MODEL | awk '/Instance Storage/ {print $1}' |
                       while read -r d; do lsblk -no MOUNTPOINT "$d" | grep -q . || echo "$d"; done)
  if [ "${#DISKS[@]}" -gt 0 ]; then
    DEV="${DISKS[0]}"
    if [ "${#DISKS[@]}" -gt 1 ] && command -v mdadm >/dev/null; then
      DEV=/dev/md/hobson
      [ -e "$DEV" ] || mdadm --create "$DEV" --level=0 --raid-devices="${#DISKS[@]}" "${DISKS[@]}" --run
    fi
    blkid "$DEV" >/dev/null 2>&1 || mkfs.ext4 -q -F "$DEV"
    mkdir -p "$SCRATCH" && mount "$DEV" "$SCRATCH"
    echo "[host] scratch: $DEV on $SCRATCH"
  fi
fi
mkdir -p "$HOME_DIR"/{code,runs,logs,hf-cache,tmp}

# 2. the interpreter the run uses
if [ "$VENV" = 1 ]; then
  V="$HOME_DIR/venv"
  [ -x "$V/bin/python" ] || "$PY" -m venv --system-site-packages "$V"
  RUN_PY="$V/bin/python"
  STAMP="$(cat setup.py; echo "$EXTRAS"; "$RUN_PY" -V)"
  STAMP="$(printf '%s' "$STAMP" | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$V/.hobson-stamp" 2>/dev/null)" != "$STAMP" ]; then
    PIP=("$RUN_PY" -m pip install -q --disable-pip-version-check)
    if ! "$RUN_PY" -c "import torch" 2>/dev/null; then  # no torch in the image: one for the driver's CUDA
      CU=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\)\.\([0-9]*\).*/cu\1\2/p' | head -1)
      case "$CU" in cu13*) CU=cu130 ;; cu12[89]) CU=cu128 ;; cu12*) CU=cu126 ;; *) CU=cpu ;; esac
      "${PIP[@]}" torch --index-url "https://download.pytorch.org/whl/$CU"
    fi
    TORCH_PIN="torch==$("$RUN_PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
    # The torch already there is pinned in the same command, so pip never swaps in another CUDA build.
    "${PIP[@]}" "$TORCH_PIN" -e ".[$EXTRAS]"
    echo "$STAMP" > "$V/.hobson-stamp"
    echo "[host] venv $V ready"
  else
    # hobson.launch/jobs/aws are importable only as installed (setup.py maps them into hobson):
    # re-point the editable install at this run's code; the dependencies are already there
    "${PIP[@]}" --no-deps -e .
    echo "[host] venv $V up to date; hobson from $(pwd)"
  fi
else
  RUN_PY="$(command -v "$PY")"
fi

# 3. model cache
export HF_HOME="$HOME_DIR/hf-cache"
if [ "${#PREFETCH[@]}" -gt 0 ]; then
  if curl -sfI --max-time 5 https://huggingface.co >/dev/null 2>&1; then
    for m in "${PREFETCH[@]}"; do
      "$RUN_PY" -c "import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1]))" "$m"
    done
  else
    echo "[host] no route to huggingface.co: models not pre-fetched"
  fi
fi

# 4. what the run sources, written atomically
cat > "$HOME_DIR/env.sh.tmp" <<EOF
export HOBSON_PYTHON='$RUN_PY'
export HF_HOME='$HOME_DIR/hf-cache'
export TMPDIR='$HOME_DIR/tmp'
EOF
mv "$HOME_DIR/env.sh.tmp" "$HOME_DIR/env.sh"
if [ "$CHECK" = 1 ]; then check "$RUN_PY"; fi
