#!/usr/bin/env bash
# Bring up hobson's local dev Slurm cluster: a REAL Slurm 22.05 (Debian 12 packages) on this one
# host, for the slurm tests and CI. Run as root: `bash tests/cluster/up.sh`.
#
# Idempotent: it installs only missing packages (apt-get update only then), rewrites configs only
# when they differ, starts only daemons that are not running, applies config changes to running
# daemons (reconfigure, or a restart where reconfigure does not apply them), and returns once every
# node answers and the cluster is registered in slurmdbd. A second run on an up cluster takes ~1 s.
#
#   - nodes n1..nN: N slurmd processes on this host (Debian's slurmd is built with multiple-slurmd),
#     NodeHostname=localhost NodeAddr=127.0.0.1, slurmd of nK on port 17000+K; n1..nN also resolve
#     to 127.0.0.1 through /etc/hosts so "first host of the allocation" works as a rendezvous address.
#   - fake GPUs: Gres=gpu:G per node; gres.conf File= names char devices made with mknod (major 195,
#     the nvidia major). Plain files give no CUDA_VISIBLE_DEVICES, and no File= makes nodes INVALID.
#     Nothing ever opens them: task/none, no cgroup device rules.
#   - accounting: slurmdbd + MariaDB listening on its unix socket only, so sacct works. Without it
#     submitit never notices a cancelled job. AccountingStorageTRES adds gres/gpu so sacct's
#     AllocTRES shows GPUs.
#   - one partition `debug` (default) holding every node.
#
# Daemons this script starts get their pid recorded in $RUN_DIR/<name>.pid; down.sh (and dbd.sh)
# stop exactly those, by pid. Daemons found already running are used and left unrecorded.
#
# Knobs (env): HOBSON_CLUSTER_NODES (4), HOBSON_CLUSTER_GPUS (8 per node),
#   HOBSON_CLUSTER_MAX_ARRAY (10001: MaxArraySize; the submit benchmark lowers it to exercise
#   array splitting), HOBSON_CLUSTER_NO_DBD=1 (no slurmdbd/MariaDB; sacct then fails).
set -euo pipefail

NODES=${HOBSON_CLUSTER_NODES:-4}
GPUS=${HOBSON_CLUSTER_GPUS:-8}
MAX_ARRAY=${HOBSON_CLUSTER_MAX_ARRAY:-10001}
NO_DBD=${HOBSON_CLUSTER_NO_DBD:-0}

CLUSTER=hobson
RUN_DIR=/run/hobson-cluster          # pid files of the daemons up.sh started
ETC=/etc/slurm
STATE=/var/lib/slurm/slurmctld
SPOOL=/var/lib/slurm/slurmd
LOGDIR=/var/log/slurm
FAKEDEV=/var/lib/slurm/fakegpu       # fake GPU char devices gpu0..gpu{G-1}
DB_PASS=hobson-dev                   # MariaDB is reachable only through its root-owned socket
BASE_PORT=17000
export SLURM_CONF=$ETC/slurm.conf    # ours, whatever the caller's environment says
T0=$(date +%s.%N)

log() { printf '[up.sh %5.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts system daemons)"
for knob in NODES GPUS MAX_ARRAY; do
  [[ ${!knob} =~ ^[1-9][0-9]*$ ]] || die "HOBSON_CLUSTER_$knob must be a positive integer, got '${!knob}'"
done
[ "$MAX_ARRAY" -le 4000001 ] || die "HOBSON_CLUSTER_MAX_ARRAY must be <= 4000001 (Slurm's limit)"

# pid_of PIDFILE COMM -> prints the pid if PIDFILE names a live process whose comm is COMM
pid_of() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(tr -dc '0-9' <"$1")
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  echo "$pid"
}
# wait_for SECONDS WHAT CMD...: poll CMD every 0.2 s, die with WHAT after SECONDS
wait_for() {
  local secs=$1 what=$2 end; shift 2
  end=$(($(date +%s) + secs))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die "timed out after ${secs}s waiting for $what (logs: $LOGDIR)"
    sleep 0.2
  done
}
# record PIDFILE NAME COMM: remember that up.sh started this daemon. Daemons rewrite their pid file
# after forking, so a stale pid from an earlier run may sit there briefly: wait for COMM.
record() {
  wait_for 20 "$1 to name a running $3" pid_of "$1" "$3"
  pid_of "$1" "$3" >"$RUN_DIR/$2.pid"
}
# stop_ours NAME COMM: stop a daemon up.sh started (recorded in RUN_DIR), wait until it is gone
stop_ours() {
  local pid i
  pid=$(pid_of "$RUN_DIR/$1.pid" "$2") || { rm -f "$RUN_DIR/$1.pid"; return 0; }
  kill -TERM "$pid"
  for i in $(seq 1 150); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
  [ ! -e "/proc/$pid" ] || { log "$1 ($pid) alive 15 s after SIGTERM: SIGKILL"; kill -KILL "$pid" || true; }
  rm -f "$RUN_DIR/$1.pid"
  log "stopped $1 (pid $pid)"
}

# ---------------------------------------------------------------- 1. packages
PKGS=(munge slurmctld slurmd slurm-client)
[ "$NO_DBD" = 1 ] || PKGS+=(slurmdbd mariadb-server)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing: ${missing[*]}"
  # Package scripts must not start services: this script starts (and records) every daemon itself.
  # Docker-style images already ship a deny-all policy-rc.d; add a temporary one otherwise.
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 0755 /usr/sbin/policy-rc.d; own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT   # also when apt fails
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >"$(mktemp /tmp/hobson-cluster-apt.XXXXXX.log)" || die "apt-get install ${missing[*]} failed"
  [ "$own_policy" = 0 ] || { rm -f /usr/sbin/policy-rc.d; trap - EXIT; }
fi
log "packages ok (slurm $(dpkg-query -W -f='${Version}' slurmctld))"

# ---------------------------------------------------------------- 2. dirs, munge key, fake GPUs, hosts
mkdir -p "$RUN_DIR" /run/slurm "$ETC" "$STATE" "$LOGDIR"
for i in $(seq 1 "$NODES"); do mkdir -p "$SPOOL/n$i"; done   # slurmd does not create its %n spool dir
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
mkdir -p "$FAKEDEV"
for ((g = 0; g < GPUS; g++)); do
  [ -c "$FAKEDEV/gpu$g" ] || { rm -f "$FAKEDEV/gpu$g"; mknod "$FAKEDEV/gpu$g" c 195 "$g"; }
done
hosts_line="127.0.0.1 $(for i in $(seq 1 "$NODES"); do printf 'n%s ' "$i"; done)# hobson-cluster"
if ! grep -qxF "$hosts_line" /etc/hosts; then
  # rewrite in place (not rename): /etc/hosts is often a bind mount in containers
  hosts=$(grep -v '# hobson-cluster$' /etc/hosts || true)
  printf '%s\n%s\n' "$hosts" "$hosts_line" >/etc/hosts
fi

# ---------------------------------------------------------------- 3. config files
if [ "$NO_DBD" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/none"
else
  ACCT=$'AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\nAccountingStorageTRES=gres/gpu'
fi
NODE_RANGE="n[1-$NODES]"; [ "$NODES" = 1 ] && NODE_RANGE=n1
PORT_RANGE="[$((BASE_PORT + 1))-$((BASE_PORT + NODES))]"; [ "$NODES" = 1 ] && PORT_RANGE=$((BASE_PORT + 1))
GPU_FILES="$FAKEDEV/gpu[0-$((GPUS - 1))]"; [ "$GPUS" = 1 ] && GPU_FILES="$FAKEDEV/gpu0"
MAX_JOBS=$((MAX_ARRAY * 10 > 100000 ? MAX_ARRAY * 10 : 100000))  # Slurm: keep well above MaxArraySize

CHANGED=0
write_if_changed() {  # write_if_changed FILE MODE < content; sets CHANGED=1 when it differs
  local tmp; tmp=$(mktemp "$1.XXXXXX")
  cat >"$tmp"; chmod "$2" "$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; CHANGED=1; fi
}
write_if_changed "$ETC/slurm.conf" 0644 <<EOF
# Generated by hobson tests/cluster/up.sh: $NODES slurmd's on 127.0.0.1, $GPUS fake GPUs each.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort=6817
AuthType=auth/munge
# a short credential lifetime: a requeued job waits about this long before it can start again
AuthInfo=cred_expire=10
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
# a node an admin (or a fault test) set DOWN stays down until it is resumed (scontrol update
# nodename=X state=resume); with 2 it came back at its slurmd's next answer, within a second, and
# took its requeued job back
ReturnToService=1
SchedulerType=sched/backfill
# het jobs are started only by the backfill scheduler; its default 30 s interval means 30 s waits.
# The main scheduler every 2 s (default 60): a requeued job starts once its begin time (cred_expire
# + 1 s) has passed, not at the next node ping (measured: 17 s after a node went down, now 11.7 s)
SchedulerParameters=bf_interval=1,sched_interval=2
# ... and it runs only after a job, node or partition changed. A requeued job becomes eligible
# cred_expire + 1 s after its requeue, often once the cluster has gone quiet, and then waited for
# the next node ping (every SlurmdTimeout/3, 100 s by default): 138-167 s in the RL requeue test
SlurmdTimeout=30
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=1024
# nodes claim more CPUs and memory than this machine has
SlurmdParameters=config_overrides
$ACCT
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
MaxArraySize=$MAX_ARRAY
MaxJobCount=$MAX_JOBS
# finished jobs stay visible to squeue (the fallback when accounting is down) for 10 minutes
MinJobAge=600
# SIGTERM -> SIGKILL grace for cancelled / timed-out jobs
KillWait=5
InactiveLimit=0
GresTypes=gpu
NodeName=$NODE_RANGE NodeHostname=localhost NodeAddr=127.0.0.1 Port=$PORT_RANGE CPUs=16 RealMemory=64000 Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
write_if_changed "$ETC/gres.conf" 0644 <<EOF
NodeName=$NODE_RANGE Name=gpu File=$GPU_FILES
EOF
if [ "$NO_DBD" != 1 ]; then
  write_if_changed "$ETC/slurmdbd.conf" 0600 <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=$LOGDIR/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
fi
log "config written (changed=$CHANGED)"

# ---------------------------------------------------------------- 4. munged
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged </dev/null >>"$LOGDIR/munged.start.log" 2>&1
  wait_for 10 munged bash -c 'munge -n | unmunge'
  record /run/munge/munged.pid munged munged
  log "munged started"
fi

# ---------------------------------------------------------------- 5. MariaDB + slurmdbd
if [ "$NO_DBD" != 1 ]; then
  if ! mariadb-admin ping >/dev/null 2>&1; then
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    install -d -o mysql -g root -m 0755 /run/mysqld
    # unix socket only (--skip-networking); slurmdbd's StorageHost=localhost means "the socket"
    setsid /usr/sbin/mariadbd --user=mysql --skip-networking \
      --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid \
      --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
      </dev/null >>"$LOGDIR/mariadb.log" 2>&1 &
    wait_for 60 mariadb mariadb-admin ping
    record /run/mysqld/mysqld.pid mariadbd mariadbd
    log "mariadbd started"
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  if ! pid_of /run/slurm/slurmdbd.pid slurmdbd >/dev/null; then
    slurmdbd </dev/null >>"$LOGDIR/slurmdbd.start.log" 2>&1   # daemonizes, writes its pid file
    wait_for 60 "slurmdbd on port 6819" bash -c 'exec 3<>/dev/tcp/127.0.0.1/6819'
    record /run/slurm/slurmdbd.pid slurmdbd slurmdbd
    log "slurmdbd started"
  fi
fi

# ---------------------------------------------------------------- 6. slurmctld
# Node definitions, GRES counts and the accounting plugin are read only at daemon start, so when
# they change the daemons are restarted; so is slurmctld when MaxArraySize changes: in 22.05
# `scontrol reconfigure` updates the value `scontrol show config` prints, but submissions keep
# being checked against the old limit (measured: 1001 -> 10001 still refused --array=0-1001).
# Everything else goes through `scontrol reconfigure`.
NODE_KEY="nodes=$NODES gpus=$GPUS"
RESTART_KEY="$NODE_KEY acct=$NO_DBD max_array=$MAX_ARRAY"
start_slurmctld() {
  slurmctld </dev/null >>"$LOGDIR/slurmctld.start.log" 2>&1   # daemonizes, writes its pid file
  wait_for 60 slurmctld bash -c 'scontrol ping | grep -q "is UP"'
  record /run/slurm/slurmctld.pid slurmctld slurmctld
  echo "$RESTART_KEY" >"$RUN_DIR/restart.key"
  log "slurmctld started"
}
start_slurmd() {  # start_slurmd K
  slurmd -N "n$1" </dev/null >>"$LOGDIR/slurmd.start.log" 2>&1
  record "/run/slurm/slurmd-n$1.pid" "slurmd-n$1" slurmd
  log "slurmd n$1 started (port $((BASE_PORT + $1)))"
}
if ! pid_of /run/slurm/slurmctld.pid slurmctld >/dev/null; then
  start_slurmctld
elif [ "$(cat "$RUN_DIR/restart.key" 2>/dev/null)" != "$RESTART_KEY" ]; then
  if pid_of "$RUN_DIR/slurmctld.pid" slurmctld >/dev/null; then
    if [[ "$(cat "$RUN_DIR/restart.key" 2>/dev/null)" != "$NODE_KEY "* ]]; then
      log "nodes/GPUs changed ($NODE_KEY): restarting the slurmd's too"
      for f in "$RUN_DIR"/slurmd-n*.pid; do [ -e "$f" ] && stop_ours "$(basename "$f" .pid)" slurmd & done; wait
    fi
    log "restarting slurmctld to apply $RESTART_KEY"
    stop_ours slurmctld slurmctld
    start_slurmctld
  else
    log "WARNING: slurmctld was not started by up.sh; restart it yourself to apply $RESTART_KEY"
  fi
elif [ "$CHANGED" = 1 ]; then
  scontrol reconfigure
  log "scontrol reconfigure"
fi

# ---------------------------------------------------------------- 7. slurmd x NODES
for i in $(seq 1 "$NODES"); do
  pid_of "/run/slurm/slurmd-n$i.pid" slurmd >/dev/null || start_slurmd "$i"
done
for f in "$RUN_DIR"/slurmd-n*.pid; do   # nodes beyond HOBSON_CLUSTER_NODES from an earlier run
  [ -e "$f" ] || continue
  k=$(basename "$f" .pid); k=${k#slurmd-n}
  [ "$k" -le "$NODES" ] || stop_ours "slurmd-n$k" slurmd
done

# ---------------------------------------------------------------- 8. nodes up, accounting registered
bad=$(sinfo -h -N -t drain,down,fail -o '%N' | sort -u | paste -sd, || true)
if [ -n "$bad" ]; then
  scontrol update nodename="$bad" state=resume || true   # left down/drained by an earlier run
fi
# every node answers: idle, or busy with jobs of an earlier session (a "*" suffix = not responding)
nodes_up() { [ "$(sinfo -h -N -p debug -o '%N %t' | sort -u | grep -cE ' (idle|mix|alloc|comp)$')" -ge "$NODES" ]; }
wait_for 60 "all $NODES nodes to answer" nodes_up
if [ "$NO_DBD" != 1 ]; then
  wait_for 60 "cluster $CLUSTER registered in slurmdbd" \
    bash -c "sacctmgr -n -P show cluster format=cluster | grep -qx $CLUSTER"
fi
sinfo -o '%P %D %t %N %G'
log "cluster up: $NODES nodes x $GPUS fake GPUs, MaxArraySize=$MAX_ARRAY, accounting=$([ "$NO_DBD" = 1 ] && echo off || echo on); daemons started by up.sh: $RUN_DIR"
