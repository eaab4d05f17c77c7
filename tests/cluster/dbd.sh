#!/usr/bin/env bash
# Stop or start only the accounting daemon (slurmdbd) of the cluster tests/cluster/up.sh brought
# up, so a test can check that `status` still works while sacct fails. MariaDB, slurmctld and the
# slurmd's keep running; slurmctld queues accounting records meanwhile and sends them on restart.
#   dbd.sh stop     stop slurmdbd (only one up.sh/dbd.sh started), wait until it has exited
#   dbd.sh start    start slurmdbd if not running, wait until sacct answers
#   dbd.sh status   print "running" or "stopped" (exit 0 / 3)
set -euo pipefail
RUN_DIR=/run/hobson-cluster
PIDFILE=/run/slurm/slurmdbd.pid   # written by slurmdbd itself (slurmdbd.conf PidFile)
export SLURM_CONF=/etc/slurm/slurm.conf

running_pid() {  # the pid in $1 if it is a live slurmdbd
  local pid
  [ -s "$1" ] || return 1
  pid=$(tr -dc '0-9' <"$1")
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmdbd ] && echo "$pid"
}

case "${1:-}" in
  stop)
    pid=$(running_pid "$RUN_DIR/slurmdbd.pid") || {
      if running_pid "$PIDFILE" >/dev/null; then
        echo "dbd.sh: slurmdbd was not started by up.sh/dbd.sh; leaving it alone" >&2; exit 1
      fi
      echo "dbd.sh: slurmdbd already stopped"; exit 0
    }
    kill -TERM "$pid"
    for _ in $(seq 1 150); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
    [ ! -e "/proc/$pid" ] || kill -KILL "$pid"
    rm -f "$RUN_DIR/slurmdbd.pid"
    echo "dbd.sh: stopped slurmdbd (pid $pid)"
    ;;
  start)
    [ "$(id -u)" = 0 ] || { echo "dbd.sh: must run as root" >&2; exit 1; }
    [ -s /etc/slurm/slurmdbd.conf ] || { echo "dbd.sh: no slurmdbd.conf: run tests/cluster/up.sh" >&2; exit 1; }
    if ! running_pid "$PIDFILE" >/dev/null; then
      mkdir -p "$RUN_DIR"
      slurmdbd </dev/null >>/var/log/slurm/slurmdbd.start.log 2>&1
      # slurmdbd daemonizes before it rewrites its pid file: wait for the file to name it
      for _ in $(seq 1 100); do pid=$(running_pid "$PIDFILE") && break; sleep 0.2; done
      [ -n "${pid:-}" ] || { echo "dbd.sh: slurmdbd did not start (see /var/log/slurm/slurmdbd.log)" >&2; exit 1; }
      echo "$pid" >"$RUN_DIR/slurmdbd.pid"
      echo "dbd.sh: started slurmdbd (pid $(cat "$RUN_DIR/slurmdbd.pid"))"
    fi
    for _ in $(seq 1 300); do sacct -n -X -S now >/dev/null 2>&1 && exit 0; sleep 0.2; done
    echo "dbd.sh: sacct still fails 60 s after starting slurmdbd (see /var/log/slurm/slurmdbd.log)" >&2
    exit 1
    ;;
  status)
    if running_pid "$PIDFILE" >/dev/null; then echo running; else echo stopped; exit 3; fi
    ;;
  *) echo "usage: dbd.sh stop|start|status" >&2; exit 2 ;;
esac
