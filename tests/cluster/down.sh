#!/usr/bin/env bash
# Stop hobson's local dev Slurm cluster: exactly the daemons tests/cluster/up.sh (or dbd.sh)
# started, by the pids recorded in /run/hobson-cluster, waiting until each has exited. Daemons
# that were already running before up.sh (nothing recorded) are left alone. Jobs still queued or
# running are cancelled first so no job process outlives its slurmd.
#
# State is kept (job ids continue, the accounting DB keeps its rows); `down.sh --purge-state`
# also wipes the slurmctld state and slurmd spool dirs (not the accounting DB).
set -uo pipefail
RUN_DIR=/run/hobson-cluster
export SLURM_CONF=/etc/slurm/slurm.conf
T0=$(date +%s.%N)
log() { printf '[down.sh %5.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }
case "${1:-}" in ""|--purge-state) ;; *) echo "usage: down.sh [--purge-state]" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { log "ERROR: must run as root"; exit 1; }
[ -d "$RUN_DIR" ] || { log "nothing recorded in $RUN_DIR: no daemon of up.sh to stop"; exit 0; }

stop() {  # stop NAME COMM: SIGTERM the recorded pid if it is still COMM, wait for it to exit
  local f="$RUN_DIR/$1.pid" comm=$2 pid i
  [ -s "$f" ] || return 0
  pid=$(tr -dc '0-9' <"$f")
  if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ]; then
    kill -TERM "$pid"
    for i in $(seq 1 150); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
    if [ -e "/proc/$pid" ]; then log "$1 (pid $pid) alive 15 s after SIGTERM: SIGKILL"; kill -KILL "$pid"; fi
    log "stopped $1 (pid $pid)"
  else
    log "$1: pid ${pid:-?} is not a running $comm, nothing to stop"
  fi
  rm -f "$f"
}

if [ -s "$RUN_DIR/slurmctld.pid" ] && timeout 10 scontrol ping 2>/dev/null | grep -q "is UP"; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs
    for _ in $(seq 1 40); do [ -z "$(squeue -h -t R,CG,PD 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi

# compute daemons, controller, accounting, database, auth; independent ones in parallel
for f in "$RUN_DIR"/slurmd-n*.pid; do [ -e "$f" ] && stop "$(basename "$f" .pid)" slurmd & done; wait
stop slurmctld slurmctld
stop slurmdbd slurmdbd
stop mariadbd mariadbd & stop munged munged & wait
rm -f "$RUN_DIR/restart.key"

if [ "${1:-}" = --purge-state ]; then
  rm -rf /var/lib/slurm/slurmctld/* /var/lib/slurm/slurmd/*
  log "purged slurmctld state and slurmd spool"
fi
log "down"
