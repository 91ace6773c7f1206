#!/usr/bin/env bash
# tpu_pod.sh: create, set up, run, watch and tear down a Cloud TPU VM pod for `ppgd-tpu train`.
#
# Every subcommand takes --help. Everything after `--` in `run`/`watch` reaches
# `ppgd-tpu train` unchanged, so a run rehearsed with
#   ppgd-tpu launch-local --processes N --devices_per_process M -- <train args>
# moves to a pod by changing only the launcher:
#   launch/tpu_pod.sh run --tpu NAME --zone ZONE --run_dir gs://B/R -- <train args>
#
# Workers get one environment variable from this script, PPGD_COORDINATOR_PORT (the JAX
# coordinator port; jax.distributed auto-detects the coordinator host, process count and
# process id on TPU VMs), plus whatever --env KEY=VALUE adds.
set -euo pipefail
shopt -s inherit_errexit

PROG=tpu_pod.sh
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly PROG REPO_ROOT
# Expanded on the worker, not here (always used inside double quotes in remote commands):
# the per-user directory for the train log and the package.
# shellcheck disable=SC2016
readonly REMOTE_DIR='$HOME/ppgd_tpu'
# The workers' Python environment (setup): TPU VM images ship an older python3 (Ubuntu 22.04:
# 3.10) than this package needs (>= 3.11), so uv makes a venv with a managed Python.
# shellcheck disable=SC2016
readonly REMOTE_VENV='$HOME/ppgd_tpu/venv'
# Matches the python process of the installed console script (`.../bin/python3
# .../bin/ppgd-tpu train ...`), not the remote shell that started it (`... env ... ppgd-tpu
# train ...`): that shell killed, ssh would end with 255, and gcloud answers 255 by running
# the command again (10 tries). The bracket keeps pkill/pgrep from matching the shell that
# runs the pattern itself.
readonly TRAIN_PATTERN='[/]ppgd-tpu train'
# Exit code of a re-run train command whose training ended without recording its own.
readonly LOST_RC=75
# watch: every worker exited 0 but the run has no summary.json (stopped before its end: the
# SIGTERM of a preemption or of `stop` saves a checkpoint and exits 0).
readonly UNFINISHED_RC=76
readonly LIBTPU_LOCKFILE=/tmp/libtpu_lockfile
readonly PREFLIGHT_OK=ppgd-preflight-ok
readonly SUBCOMMANDS="create setup run status logs stop delete watch"

# Knobs (environment): waits are configurable so tests never sleep for real.
BACKOFF_S=${TPU_POD_BACKOFF_S:-30}             # watch: first retry delay, doubled per failure
BACKOFF_MAX_S=${TPU_POD_BACKOFF_MAX_S:-900}    # watch: delay cap
POLL_S=${TPU_POD_POLL_S:-20}                   # create/watch: seconds between state polls
READY_TIMEOUT_S=${TPU_POD_READY_TIMEOUT_S:-3600}  # create/watch: give up waiting for READY
KILL_GRACE_S=${TPU_POD_KILL_GRACE_S:-60}       # stop/preflight: SIGTERM -> SIGKILL delay
# run/watch: the local `ppgd-tpu` (with libtpu: the `tpu` extra) that compiles the run's
# config for the pod's accelerator type before the pod is touched
LOCAL_PPGD_TPU=${TPU_POD_PPGD_TPU:-ppgd-tpu}

# Options (see usage_<subcommand>).
CMD="" TPU=${TPU_NAME:-} ZONE=${TPU_ZONE:-${CLOUDSDK_COMPUTE_ZONE:-}} PROJECT=${TPU_PROJECT:-}
DRY_RUN=0 COMPILE_CHECK=1 ACCEL="" RUNTIME=tpu-ubuntu2204-base CAPACITY="" QUEUED=0
PACKAGE="" GIT_REF="" GIT_URL="" PYTHON=3.12 RUN_DIR="" PORT=8476 LOG_ROOT="" MAX_RETRIES=5
WORKER=0 FOLLOW=0 LINES=100
EXTRA_ENV=() TRAIN_ARGS=() SSH_NET=()  # SSH_NET: --internal-ip / --tunnel-through-iap
TMP="" RUNNING=() ACTION=""   # scratch dir; local ssh pids still to reap on exit

die() { echo "$PROG${CMD:+ $CMD}: error: $*" >&2; exit 2; }
note() { echo "$PROG${CMD:+ $CMD}: $*" >&2; }

# ---------------------------------------------------------------- usage

usage() {
  cat <<EOF
usage: $PROG <subcommand> --tpu NAME --zone ZONE [--project P] [--dry-run] [options]

subcommands (each takes --help):
  create   create the TPU VM (or a queued resource); a no-op when it already exists
  setup    install this package with the [tpu] extra on every worker, check versions agree
  run      run 'ppgd-tpu train' on all workers at once, fail fast, logs to the run dir
  status   pod state, worker count, whether training runs on each worker
  logs     print (or follow) one worker's train log
  stop     stop training on every worker (SIGTERM, then SIGKILL after a grace period)
  delete   delete the TPU VM (and its queued resource)
  watch    requeue loop: recreate/restart and rerun until the run succeeds (bounded)

common options: --tpu NAME (env TPU_NAME), --zone ZONE (env TPU_ZONE or
CLOUDSDK_COMPUTE_ZONE), --project P (env TPU_PROJECT), --dry-run (print the gcloud
commands that change something instead of running them; read-only describes still run).
How ssh/scp reach the workers (setup, run, status, logs, stop, watch): --internal-ip (from a
VM in the pod's VPC: workers without external IPs) or --tunnel-through-iap (through
Identity-Aware Proxy, from outside); both are passed to every gcloud ssh and scp.
EOF
}

usage_create() {
  cat <<EOF
usage: $PROG create --tpu NAME --zone ZONE --accelerator-type TYPE [--runtime-version V]
                    [--spot | --preemptible] [--queued] [--dry-run]
Creates the pod and waits until it is READY; if it already exists, says so and waits.
  --accelerator-type TYPE  e.g. v4-32, v5litepod-16, v6e-16
  --runtime-version V      TPU VM image (default $RUNTIME; v5e: v2-alpha-tpuv5-lite,
                           v6e: v2-alpha-tpuv6e)
  --spot | --preemptible   cheaper capacity that can be preempted (use 'watch')
  --queued                 create through a queued resource of the same name
EOF
}

usage_setup() {
  cat <<EOF
usage: $PROG setup --tpu NAME --zone ZONE [--package FILE | --git-ref REF [--git-url URL]]
                   [--python V]
Installs ppgd-tpu[tpu] on every worker into a fresh venv, \$HOME/ppgd_tpu/venv (made by uv,
with Python V: TPU VM images ship an older python3 than this package needs), then checks
every worker reports the same version. 'run' trains with that venv's ppgd-tpu.
  (default)        build a wheel of this checkout ($REPO_ROOT) and copy it to the workers
  --package FILE   a wheel or sdist you built
  --git-ref REF    pip install from git at REF; --git-url defaults to this checkout's origin
  --python V       the venv's Python (default $PYTHON; 3.11 or later)
EOF
}

usage_run() {
  cat <<EOF
usage: $PROG run --tpu NAME --zone ZONE --run_dir gs://B/R [--coordinator-port P]
                 [--env KEY=VALUE]... [--log-dir DIR] [--accelerator-type TYPE]
                 [--no-compile-check] [--dry-run] -- <ppgd-tpu train args>
First, here, 'ppgd-tpu compile --topology TYPE <train args>' compiles every step of the run
for the pod's accelerator type (TYPE, or the pod's own, read from its describe) and stops
the launch, before anything on the pod is touched, when one does not compile or fit its
HBM (this machine needs the package with its [tpu] extra: libtpu compiles without a TPU).
Then it runs 'ppgd-tpu train --run_dir R <args>' on ALL workers at once (never a subset: a
multi-host JAX job on part of a pod hangs at start-up). Before starting it checks the pod is
READY, then on every worker stops stale ppgd-tpu train processes, kills whatever holds the
TPU device and removes $LIBTPU_LOCKFILE; it refuses to start unless every worker passed.
Fail fast: the first worker to exit non-zero stops the others; the script names it and exits
with its code. Worker output goes to DIR/<stamp>/worker-I.log (DIR default
./tpu_pod_logs/NAME) and is copied to RUN_DIR/launch_logs/<stamp>/; each worker also keeps
\$HOME/ppgd_tpu/train.log (see 'logs').
  --run_dir gs://B/R      required, passed to train as --run_dir: on GCS (shared by all hosts)
  --coordinator-port P    exported as PPGD_COORDINATOR_PORT (default $PORT)
  --env KEY=VALUE         extra environment for train (repeatable)
  --accelerator-type TYPE the pod's type for the compile check (default: describe's)
  --no-compile-check      skip the local compile check (e.g. no libtpu here)
EOF
}

usage_status() {
  echo "usage: $PROG status --tpu NAME --zone ZONE"
  echo "Prints the pod (and queued resource) state and, when READY, whether each worker trains."
}

usage_logs() {
  echo "usage: $PROG logs --tpu NAME --zone ZONE [--worker N|all] [--lines K] [--follow]"
  echo "Prints the last K (default $LINES) lines of worker N's (default 0; all: every worker's) \$HOME/ppgd_tpu/train.log."
}

usage_stop() {
  echo "usage: $PROG stop --tpu NAME --zone ZONE [--dry-run]"
  echo "SIGTERM to 'ppgd-tpu train' on every worker (it checkpoints at the next step"
  echo "boundary), SIGKILL after TPU_POD_KILL_GRACE_S (default $KILL_GRACE_S) seconds."
}

usage_delete() {
  echo "usage: $PROG delete --tpu NAME --zone ZONE [--dry-run]"
  echo "Deletes the queued resource NAME (with its node) if there is one, else the TPU VM NAME."
}

usage_watch() {
  cat <<EOF
usage: $PROG watch --tpu NAME --zone ZONE --run_dir gs://B/R --accelerator-type TYPE
                   [create options] [setup options] [run options] [--max-retries K]
                   -- <ppgd-tpu train args>
First, once, the compile check of 'run' for TYPE (--no-compile-check skips it): a run that
does not compile or fit ends the watch before any pod is created or changed.
Requeue loop. Each attempt: if the pod is missing it is created and set up; if it was
preempted (or is otherwise dead) it is deleted, recreated and set up; then 'run' with the
same arguments, which resumes from RUN_DIR. A failed attempt is retried after a backoff of
TPU_POD_BACKOFF_S (default $BACKOFF_S) seconds, doubled each time up to TPU_POD_BACKOFF_MAX_S
(default $BACKOFF_MAX_S), at most K (default $MAX_RETRIES) times in a row: an attempt that
committed a new checkpoint in RUN_DIR starts the count (and the backoff) again. The run is
finished when RUN_DIR/summary.json exists: workers that all exit 0 without it were stopped
(a preemption's SIGTERM, or 'stop'), and that attempt is retried too; to end a watch, stop it
(Ctrl-C), then '$PROG stop'. Each attempt is logged to
DIR/watch-<stamp>/attempts.log and RUN_DIR/launch_logs/watch-<stamp>/attempts.log.
An existing pod is set up unless every worker already has the package (same version).
EOF
}

# ---------------------------------------------------------------- options

# Dies unless the current subcommand is one of "$@" (the option's name is in $OPT).
only_for() {
  [[ " $* " == *" $CMD "* ]] || die "option $OPT does not apply to '$CMD' (it is for: $*)"
}

parse_opts() {
  local val
  while (($#)); do
    OPT=$1
    if [[ $OPT == --*=* ]]; then val=${OPT#*=}; OPT=${OPT%%=*}; set -- "$OPT" "$val" "${@:2}"; fi
    case $OPT in
      -h|--help) "usage_$CMD"; exit 0 ;;
      --) only_for run watch; shift; TRAIN_ARGS=("$@"); return ;;
      --dry-run) DRY_RUN=1; shift; continue ;;
      --no-compile-check) only_for run watch; COMPILE_CHECK=0; shift; continue ;;
      --spot|--preemptible) only_for create watch; CAPACITY=$OPT; shift; continue ;;
      --queued) only_for create watch; QUEUED=1; shift; continue ;;
      --follow) only_for logs; FOLLOW=1; shift; continue ;;
      --internal-ip|--tunnel-through-iap)
        only_for setup run status logs stop watch; SSH_NET+=("$OPT"); shift; continue ;;
    esac
    (($# >= 2)) || die "option $OPT needs a value"
    val=$2
    case $OPT in
      --tpu) TPU=$val ;;
      --zone) ZONE=$val ;;
      --project) PROJECT=$val ;;
      --accelerator-type) only_for create run watch; ACCEL=$val ;;
      --runtime-version) only_for create watch; RUNTIME=$val ;;
      --package) only_for setup watch; PACKAGE=$val ;;
      --git-ref) only_for setup watch; GIT_REF=$val ;;
      --git-url) only_for setup watch; GIT_URL=$val ;;
      --python) only_for setup watch; PYTHON=$val ;;
      --run_dir|--run-dir) only_for run watch; RUN_DIR=$val ;;
      --coordinator-port) only_for run watch; PORT=$val ;;
      --env) only_for run watch; EXTRA_ENV+=("$val") ;;
      --log-dir) only_for run watch; LOG_ROOT=$val ;;
      --max-retries) only_for watch; MAX_RETRIES=$val ;;
      --lines) only_for logs; LINES=$val ;;
      --worker)
        [[ $CMD == logs ]] || die "--worker is refused: '$CMD' always uses every worker" \
          "(a multi-host JAX job started on a subset of a pod hangs at start-up)"
        WORKER=$val ;;
      *) [[ $CMD != run && $CMD != watch ]] ||
           die "unknown option '$OPT' (see $PROG $CMD --help); train's own flags (--config, --decomp.steps, ...) go after '--'"
         die "unknown option '$OPT' (see $PROG $CMD --help)" ;;
    esac
    shift 2
  done
}

check_opts() {
  [[ -n $TPU ]] || die "--tpu NAME is required (or set TPU_NAME)"
  [[ $TPU =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--tpu '$TPU' is not a valid TPU name (lowercase letters, digits, '-')"
  [[ -n $ZONE ]] || die "--zone ZONE is required (or set TPU_ZONE)"
  if ! [[ $PORT =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
    die "--coordinator-port '$PORT' is not a port number (1-65535)"
  fi
  [[ $MAX_RETRIES =~ ^[0-9]+$ ]] || die "--max-retries '$MAX_RETRIES' is not a non-negative integer"
  [[ $LINES =~ ^[0-9]+$ ]] || die "--lines '$LINES' is not a non-negative integer"
  [[ $WORKER =~ ^([0-9]+|all)$ ]] || die "--worker '$WORKER' is not a worker index (0, 1, ...) or 'all'"
  [[ -z $RUN_DIR || $RUN_DIR == gs://?* ]] || die "--run_dir '$RUN_DIR' must be a gs:// path: every worker reads and writes the same checkpoints"
  [[ -z $PACKAGE || -z $GIT_REF ]] || die "give --package or --git-ref, not both"
  [[ $PYTHON =~ ^3\.(1[1-9]|[2-9][0-9])$ ]] || die "--python '$PYTHON' is not a Python version this package runs on (3.11, 3.12, ...)"
  local kv
  for kv in ${EXTRA_ENV[@]+"${EXTRA_ENV[@]}"}; do
    [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env '$kv' is not KEY=VALUE"
    [[ $kv != PPGD_COORDINATOR_PORT=* ]] || die "--env cannot set PPGD_COORDINATOR_PORT; use --coordinator-port"
  done
  local a
  for a in ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}; do
    [[ -z $RUN_DIR || ( $a != --run_dir && $a != --run_dir=* ) ]] || die "--run_dir is given both to $PROG and after '--'; give it once, before '--'"
  done
  for a in BACKOFF_S BACKOFF_MAX_S POLL_S READY_TIMEOUT_S KILL_GRACE_S; do
    [[ ${!a} =~ ^[0-9]+$ ]] || die "TPU_POD_$a='${!a}' is not a whole number of seconds"
  done
  ((${#SSH_NET[@]} < 2)) || [[ ${SSH_NET[0]} == "${SSH_NET[1]}" ]] \
    || die "give --internal-ip or --tunnel-through-iap, not both"
  if [[ ($CMD == run || $CMD == watch) && -z $RUN_DIR ]]; then
    for a in ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}; do
      [[ $a != --run_dir && $a != --run_dir=* ]] || die "give --run_dir gs://B/R to $PROG, before '--' (it checks that every worker shares it, and copies the logs there)"
    done
    [[ $CMD != run ]] || die "--run_dir gs://B/R is required: without it each worker would write train's default runs/<name>-<stamp> on its own disk"
  fi
  SCOPE=("--zone=$ZONE")
  [[ -z $PROJECT ]] || SCOPE+=("--project=$PROJECT")
  LOG_ROOT=${LOG_ROOT:-tpu_pod_logs/$TPU}
}

# ---------------------------------------------------------------- helpers

# Quotes each argument for a POSIX shell (bare when safe), joined by spaces.
shquote() {
  local a out=()
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  printf '%s' "${out[*]}"
}

stamp() { date -u +%Y%m%dT%H%M%SZ; }

# A gcloud call that changes something: printed under --dry-run, run otherwise.
gc() {
  if ((DRY_RUN)); then echo "+ gcloud $(shquote "$@")"; return 0; fi
  gcloud "$@"
}

ssh_args() {  # gcloud argv for an ssh to worker $1 running remote command $2
  printf '%s\0' compute tpus tpu-vm ssh "$TPU" "${SCOPE[@]}" "--worker=$1" ${SSH_NET[@]+"${SSH_NET[@]}"} \
    --ssh-flag=-oConnectTimeout=30 --ssh-flag=-oServerAliveInterval=30 \
    --ssh-flag=-oServerAliveCountMax=6 "--command=$2"
}

remote() {  # remote WORKER CMD: one ssh (printed under --dry-run)
  local argv; mapfile -d '' -t argv < <(ssh_args "$1" "$2")
  gc "${argv[@]}"
}

# Prints the `value(...)` of a describe, or NOT_FOUND; dies on any other gcloud error.
describe() {  # describe tpu-vm|queued-resources FORMAT
  local out
  if out=$(gcloud compute tpus "$1" describe "$TPU" "${SCOPE[@]}" "--format=value($2)" 2>"$TMP/describe.err"); then
    echo "${out:-UNKNOWN}"
  elif grep -qiE 'NOT_FOUND|not found' "$TMP/describe.err"; then
    echo NOT_FOUND
  else
    cat "$TMP/describe.err" >&2
    die "could not describe $1 $TPU in $ZONE (gcloud error above)"
  fi
}

# Sets POD_STATE and POD_WORKERS (the number of worker network endpoints).
read_pod() {
  local line ips
  line=$(describe tpu-vm 'state,networkEndpoints[].ipAddress')
  IFS=$'\t' read -r POD_STATE ips <<<"$line"
  POD_WORKERS=0
  if [[ -n $ips ]]; then local arr; IFS=';' read -ra arr <<<"$ips"; POD_WORKERS=${#arr[@]}; fi
}

queued_state() { describe queued-resources state.state; }

# Waits until the queued resource (if any) is ACTIVE and the node READY, polling.
wait_ready() {
  local polls=$((READY_TIMEOUT_S / (POLL_S > 0 ? POLL_S : 1))) i qstate
  for ((i = 0; ; i++)); do
    qstate=ACTIVE
    if ((QUEUED)); then
      qstate=$(queued_state)
      case $qstate in
        FAILED|SUSPENDED|SUSPENDING|NOT_FOUND) die "queued resource $TPU is $qstate; it will not become ACTIVE (delete it, or use watch)" ;;
      esac
    fi
    read_pod
    if [[ $qstate == ACTIVE ]]; then
      case $POD_STATE in
        READY) note "TPU $TPU is READY with $POD_WORKERS worker(s)"; return 0 ;;
        CREATING|STARTING|RESTARTING|REPAIRING|REIMAGING|NOT_FOUND) ;;
        *) die "TPU $TPU is $POD_STATE; it will not become READY (delete it, or use watch)" ;;
      esac
    fi
    ((i < polls)) || die "TPU $TPU not READY after ${READY_TIMEOUT_S}s (queued resource: $qstate, node: $POD_STATE)"
    note "waiting for $TPU: queued resource $qstate, node $POD_STATE"
    sleep "$POLL_S"
  done
}

require_ready() {
  read_pod
  [[ $POD_STATE == READY ]] || die "TPU $TPU is $POD_STATE, not READY; refusing to continue (create it, or use watch)"
  ((POD_WORKERS > 0)) || die "TPU $TPU reports no worker endpoints"
}

# Remote shell snippets. Stopping sends SIGTERM so training checkpoints at a step boundary.
kill_command() {
  printf "sudo pkill -TERM -f '%s'; for _ in \$(seq %d); do pgrep -f '%s' >/dev/null || break; sleep 1; done; sudo pkill -KILL -f '%s'; true" \
    "$TRAIN_PATTERN" "$KILL_GRACE_S" "$TRAIN_PATTERN" "$TRAIN_PATTERN"
}

preflight_command() {  # ... and forgets the attempts of stopped trainings (train_command)
  printf '%s; sudo lsof -t -w /dev/accel* /dev/vfio/* 2>/dev/null | xargs -r sudo kill -9; sudo rm -f %s; rm -f "%s"/attempt-*; echo %s' \
    "$(kill_command)" "$LIBTPU_LOCKFILE" "$REMOTE_DIR" "$PREFLIGHT_OK"
}

# train_command ATTEMPT: ATTEMPT names this launch. gcloud re-runs a command whose ssh ended
# with 255 (a dropped connection) while the first run of it goes on: the re-run finds
# attempt-ATTEMPT.pid and follows that training's log to its end and exit code instead of
# starting a second training on the worker.
train_command() {
  local envs=("PPGD_COORDINATOR_PORT=$PORT" ${EXTRA_ENV[@]+"${EXTRA_ENV[@]}"}) args=(ppgd-tpu train)
  [[ -z $RUN_DIR ]] || args+=(--run_dir "$RUN_DIR")
  args+=(${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
  local attach
  # shellcheck disable=SC2016
  attach=$(printf 'if [ -e "$a.pid" ]; then echo "%s: attaching to the training this command started"; tail -n +1 -f --pid="$(cat "$a.pid")" "$d/train.log"; exit "$(cat "$a.rc" 2>/dev/null || echo %d)"; fi' \
    "$PROG" "$LOST_RC")
  # `tee -p`: when the launcher's ssh session ends (Ctrl-C, a dropped network), tee goes on
  # writing train.log instead of dying of SIGPIPE, which would take training down with it at
  # its next console write (a BrokenPipeError, no checkpoint); training is ended by `stop`.
  # shellcheck disable=SC2016
  printf 'set -o pipefail; d="%s"; a="$d/attempt-%s"; mkdir -p "$d" || exit; export PATH="%s/bin:$PATH"; %s; echo $$ >"$a.pid"; env %s %s 2>&1 | tee -p "$d/train.log"; rc=$?; echo "$rc" >"$a.rc"; exit "$rc"' \
    "$REMOTE_DIR" "${1//\//_}" "$REMOTE_VENV" "$attach" "$(shquote "${envs[@]}")" "$(shquote "${args[@]}")"
}

# Kills local ssh processes still running (their remote side is stopped separately).
reap() {
  local pid
  for pid in ${RUNNING[@]+"${RUNNING[@]}"}; do kill "$pid" 2>/dev/null || true; done
  for pid in ${RUNNING[@]+"${RUNNING[@]}"}; do wait "$pid" 2>/dev/null || true; done
  RUNNING=()
}

# on_all_workers DIR N CMD MODE: runs CMD on workers 0..N-1 at once, one ssh each, output to
# DIR/worker-I.log, and writes DIR/exit_status. MODE "collect" waits for every worker;
# MODE "failfast" names the first worker to exit non-zero and stops the others, on the pod
# and locally. Returns the first non-zero exit code (0 if none).
on_all_workers() {
  local dir=$1 n=$2 cmd=$3 mode=$4 i pid rc first_rc=0 failed=() argv
  local -A worker_of=()
  if ((DRY_RUN)); then
    for ((i = 0; i < n; i++)); do remote "$i" "$cmd"; done
    return 0
  fi
  mkdir -p "$dir"
  for ((i = 0; i < n; i++)); do
    mapfile -d '' -t argv < <(ssh_args "$i" "$cmd")
    gcloud "${argv[@]}" >"$dir/worker-$i.log" 2>&1 </dev/null &
    worker_of[$!]=$i
  done
  RUNNING=("${!worker_of[@]}")
  while ((${#worker_of[@]})); do
    rc=0
    wait -n -p pid "${!worker_of[@]}" || rc=$?
    i=${worker_of[$pid]}
    unset "worker_of[$pid]"
    ((rc == 0)) && continue
    failed+=("$i")
    ((first_rc)) || first_rc=$rc
    [[ $mode == failfast ]] || continue
    note "worker $i exited with code $rc; stopping the other workers: ${worker_of[*]:-none left}"
    tail -n 20 "$dir/worker-$i.log" | sed "s/^/  worker $i | /" >&2 || true
    remote all "$(kill_command)" >"$dir/stop.log" 2>&1 ||
      note "remote stop failed (see $dir/stop.log); ending the local ssh sessions"
    break
  done
  RUNNING=("${!worker_of[@]}")
  reap
  echo "rc=$first_rc failed_worker=$(IFS=,; echo "${failed[*]:-none}")" >"$dir/exit_status"
  return "$first_rc"
}

# ---------------------------------------------------------------- subcommands

cmd_create() {
  [[ -n $ACCEL ]] || die "--accelerator-type TYPE is required (e.g. v4-32)"
  create_pod
}

# create_pod [absent]: "absent" skips the existence check (the pod was just deleted).
create_pod() {
  local capacity=() state=NOT_FOUND
  [[ -z $CAPACITY ]] || capacity=("$CAPACITY")
  if ((QUEUED)); then
    [[ ${1:-} == absent ]] || state=$(queued_state)
    if [[ $state != NOT_FOUND ]]; then note "queued resource $TPU already exists ($state)"
    else
      [[ $CAPACITY != --preemptible ]] || die "--preemptible does not apply to queued resources; use --spot"
      gc compute tpus queued-resources create "$TPU" "${SCOPE[@]}" "--node-id=$TPU" \
        "--accelerator-type=$ACCEL" "--runtime-version=$RUNTIME" ${capacity[@]+"${capacity[@]}"}
    fi
  else
    [[ ${1:-} == absent ]] || { read_pod; state=$POD_STATE; }
    if [[ $state != NOT_FOUND ]]; then note "TPU $TPU already exists ($state)"
    else
      gc compute tpus tpu-vm create "$TPU" "${SCOPE[@]}" "--accelerator-type=$ACCEL" \
        "--version=$RUNTIME" ${capacity[@]+"${capacity[@]}"}
    fi
  fi
  ((DRY_RUN)) || wait_ready
}

delete_pod() {
  if [[ $(queued_state) != NOT_FOUND ]]; then
    gc compute tpus queued-resources delete "$TPU" "${SCOPE[@]}" --force --quiet
  else
    read_pod
    if [[ $POD_STATE == NOT_FOUND ]]; then note "TPU $TPU does not exist; nothing to delete"; return 0; fi
    gc compute tpus tpu-vm delete "$TPU" "${SCOPE[@]}" --quiet
  fi
}

cmd_delete() { delete_pod; }

# Sets PKG_FILE to a wheel/sdist to copy (empty for --git-ref) and PKG_VERSION (if known).
resolve_package() {
  PKG_FILE="" PKG_VERSION=""
  if [[ -n $GIT_REF ]]; then
    GIT_URL=${GIT_URL:-$(git -C "$REPO_ROOT" remote get-url origin 2>/dev/null)} ||
      die "--git-url URL is required: this checkout has no 'origin' remote"
    return 0
  fi
  if [[ -n $PACKAGE ]]; then
    [[ -f $PACKAGE ]] || die "--package '$PACKAGE' is not a file"
    PKG_FILE=$PACKAGE
  else
    local version
    version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO_ROOT/pyproject.toml")
    PKG_FILE=$TMP/dist/ppgd_tpu-$version-py3-none-any.whl
    if ((DRY_RUN)); then echo "+ $(shquote python3 -m pip wheel --no-deps --wheel-dir "$TMP/dist" "$REPO_ROOT")"
    else
      python3 -m pip wheel --no-deps --wheel-dir "$TMP/dist" "$REPO_ROOT" >&2 || die "building a wheel of $REPO_ROOT failed"
      [[ -f $PKG_FILE ]] || die "pip wheel did not produce $PKG_FILE"
    fi
  fi
  local base=${PKG_FILE##*/}
  [[ $base =~ ^ppgd_tpu-([^-]+)(-.*\.whl|\.tar\.gz)$ ]] ||
    die "--package '$PKG_FILE' is not a ppgd_tpu wheel (ppgd_tpu-V-*.whl) or sdist (ppgd_tpu-V.tar.gz)"
  PKG_VERSION=${BASH_REMATCH[1]}
}

install_package() {
  local spec tpu_spec venv pip="\"$REMOTE_VENV/bin/python\" -m pip"
  # A fresh venv each setup, with uv's Python $PYTHON (uv itself from the image's pip).
  venv="python3 -m pip install --user --upgrade uv && \"\$HOME/.local/bin/uv\" venv --clear --seed --python $PYTHON \"$REMOTE_VENV\""
  if [[ -n $GIT_REF ]]; then
    spec=$(shquote "ppgd-tpu[tpu] @ git+$GIT_URL@$GIT_REF") tpu_spec=$spec
  else
    local path="$REMOTE_DIR/dist/${PKG_FILE##*/}"
    spec="\"$path\"" tpu_spec="\"${path}[tpu]\""
    remote all "mkdir -p \"$REMOTE_DIR/dist\""
    gc compute tpus tpu-vm scp "$PKG_FILE" "$TPU:ppgd_tpu/dist/" "${SCOPE[@]}" --worker=all \
      ${SSH_NET[@]+"${SSH_NET[@]}"}
  fi
  # The second install replaces a same-version build that pip would otherwise keep.
  remote all "$venv && $pip install --upgrade $tpu_spec && $pip install --no-deps --force-reinstall $spec"
  verify_versions
}

# Sets VERSION_PROBLEM to why the workers cannot run this package (not installed, versions
# that disagree, not the built one), or to "" when every worker has the same, expected one.
check_versions() {
  local dir=$TMP/versions i v versions=() first=""
  VERSION_PROBLEM=""
  if ! on_all_workers "$dir" "$POD_WORKERS" "\"$REMOTE_VENV/bin/python\" -m pip show ppgd-tpu 2>/dev/null | sed -n 's/^Version: /ppgd-tpu-version /p'" collect; then
    VERSION_PROBLEM="checking the installed version failed on worker $(sed -n 's/.*failed_worker=//p' "$dir/exit_status")"
    return 0
  fi
  ((DRY_RUN)) && return 0
  for ((i = 0; i < POD_WORKERS; i++)); do
    v=$(sed -n 's/^ppgd-tpu-version //p' "$dir/worker-$i.log" | tail -n 1)
    [[ -n $v ]] || { VERSION_PROBLEM="worker $i: ppgd-tpu is not installed (see $dir/worker-$i.log)"; return 0; }
    versions+=("worker $i=$v")
    first=${first:-$v}
  done
  for v in "${versions[@]}"; do
    [[ ${v#*=} == "$first" ]] || { VERSION_PROBLEM="workers disagree on the ppgd-tpu version: ${versions[*]}"; return 0; }
  done
  [[ -z $PKG_VERSION || $first == "$PKG_VERSION" ]] || VERSION_PROBLEM="workers have ppgd-tpu $first, expected $PKG_VERSION"
  INSTALLED_VERSION=$first
}

verify_versions() {
  check_versions
  [[ -z $VERSION_PROBLEM ]] || die "$VERSION_PROBLEM"
  ((DRY_RUN)) || note "ppgd-tpu $INSTALLED_VERSION on all $POD_WORKERS workers"
}

cmd_setup() {
  require_ready
  resolve_package
  install_package
}

cmd_status() {
  local qstate i
  qstate=$(queued_state)
  [[ $qstate == NOT_FOUND ]] || echo "queued resource $TPU: $qstate"
  read_pod
  echo "TPU $TPU: $POD_STATE, $POD_WORKERS worker(s)"
  [[ $POD_STATE == READY ]] || return 0
  on_all_workers "$TMP/status" "$POD_WORKERS" "pgrep -af '$TRAIN_PATTERN' >/dev/null && echo training || echo idle" collect || true
  for ((i = 0; i < POD_WORKERS; i++)); do
    echo "worker $i: $(tail -n 1 "$TMP/status/worker-$i.log" 2>/dev/null || echo unknown)"
  done
}

cmd_logs() {
  local follow=""
  ((FOLLOW)) && follow=" -F"
  remote "$WORKER" "tail -n $LINES$follow \"$REMOTE_DIR/train.log\""
}

cmd_stop() { remote all "$(kill_command)"; }

# Copies an attempt's local logs to RUN_DIR/launch_logs/<rel>/ (best effort).
upload_logs() {  # upload_logs DIR REL
  [[ -n $RUN_DIR ]] || return 0
  local f files=()
  for f in "$1"/*.log "$1"/exit_status; do [[ ! -e $f ]] || files+=("$f"); done
  ((${#files[@]})) || return 0
  gc storage cp "${files[@]}" "${RUN_DIR%/}/launch_logs/$2/" || note "could not copy logs to $RUN_DIR (kept in $1)"
}

# One full start of training: READY check, preflight on every worker, train on every worker.
run_attempt() {  # run_attempt DIR REL
  local dir=$1 rc=0 i missing=()
  if ((DRY_RUN)) && [[ $ACTION == create || $ACTION == recreate ]]; then
    note "dry run: the pod was not really created, so the per-worker preflight and train commands are not shown"
    return 0
  fi
  require_ready
  note "preflight on all $POD_WORKERS workers"
  on_all_workers "$dir/preflight" "$POD_WORKERS" "$(preflight_command)" collect || true
  if ((!DRY_RUN)); then
    for ((i = 0; i < POD_WORKERS; i++)); do
      grep -qx "$PREFLIGHT_OK" "$dir/preflight/worker-$i.log" 2>/dev/null || missing+=("$i")
    done
    ((${#missing[@]} == 0)) || die "preflight failed on worker(s) ${missing[*]} of $POD_WORKERS" \
      "(logs: $dir/preflight); refusing to start on a subset of workers"
  fi
  note "starting ppgd-tpu train on all $POD_WORKERS workers; logs in $dir"
  on_all_workers "$dir" "$POD_WORKERS" "$(train_command "$2")" failfast || rc=$?
  upload_logs "$dir" "$2"
  ((DRY_RUN || rc != 0)) || note "all $POD_WORKERS workers finished"
  return "$rc"
}

# Compiles the run's config for the pod's accelerator type here, before the pod is touched:
# a config that does not compile or fit the chips' HBM fails in minutes, on this machine.
compile_check() {
  ((COMPILE_CHECK)) || { note "compile check skipped (--no-compile-check)"; return 0; }
  if [[ -z $ACCEL ]]; then
    ACCEL=$(describe tpu-vm acceleratorType)
    [[ $ACCEL != NOT_FOUND && $ACCEL != UNKNOWN ]] || die "TPU $TPU does not exist, so its accelerator type is unknown; give --accelerator-type TYPE (or --no-compile-check)"
  fi
  local cmd; read -ra cmd <<<"$LOCAL_PPGD_TPU"
  command -v "${cmd[0]}" >/dev/null || die "the compile check runs '$LOCAL_PPGD_TPU compile' here, which is not installed (pip install -e '.[tpu]'); or give --no-compile-check"
  cmd+=(compile --topology "$ACCEL" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
  note "compile check: $(shquote "${cmd[@]}")"
  local rc=0
  "${cmd[@]}" >&2 || rc=$?
  ((rc == 0)) || die "the compile check failed (exit $rc, above): the run does not compile or fit on $ACCEL; nothing was changed on the pod (skip the check with --no-compile-check)"
}

cmd_run() {
  ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)) || die "needs bash >= 5.1 for fail-fast waits (this is $BASH_VERSION)"
  compile_check
  local rel; rel=$(stamp)
  run_attempt "$LOG_ROOT/$rel" "$rel"
}

# Makes the pod exist, be READY and set up; sets ACTION to what it did.
ensure_pod() {
  local qstate=""
  ((QUEUED)) && qstate=$(queued_state)
  read_pod
  case $qstate/$POD_STATE in
    /READY|ACTIVE/READY) ACTION=reuse ;;
    NOT_FOUND/NOT_FOUND|/NOT_FOUND) ACTION=create ;;
    WAITING_FOR_RESOURCES/*|PROVISIONING/*|ACCEPTED/*|CREATING/*|*/CREATING|*/STARTING|*/RESTARTING|*/REPAIRING|*/REIMAGING)
      ACTION="wait"; wait_ready ;;
    *) ACTION=recreate; note "TPU $TPU is ${qstate:+$qstate/}$POD_STATE: deleting and recreating it"; delete_pod ;;
  esac
  if [[ $ACTION == create || $ACTION == recreate ]]; then
    create_pod absent
    install_package
    return 0
  fi
  # A pod this loop did not just create (made elsewhere, or set up by an attempt that
  # failed) is set up unless every worker already has this package.
  check_versions
  [[ -z $VERSION_PROBLEM ]] || { note "$VERSION_PROBLEM: setting the pod up"; install_package; }
}

backoff_for() {  # seconds to wait after failure number $1
  local s=$BACKOFF_S k
  for ((k = 1; k < $1 && s < BACKOFF_MAX_S; k++)); do s=$((s * 2)); done
  echo $((s < BACKOFF_MAX_S ? s : BACKOFF_MAX_S))
}

# The run's latest committed checkpoint step on GCS (-1 when none, or unreadable).
latest_step() {
  local step
  step=$(gcloud storage ls "${RUN_DIR%/}/ckpts/*/COMMITTED" 2>/dev/null |
    sed -n 's#.*/ckpts/\([0-9][0-9]*\)/COMMITTED$#\1#p' | sort -n | tail -n 1) || true
  echo "${step:--1}"
}

cmd_watch() {
  ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)) || die "needs bash >= 5.1 for fail-fast waits (this is $BASH_VERSION)"
  [[ -n $RUN_DIR ]] || die "--run_dir gs://... is required: every retry resumes from it"
  [[ -n $ACCEL ]] || die "--accelerator-type TYPE is required: it is used to recreate a preempted pod"
  resolve_package
  compile_check
  local rel attempt rc action status wait_s failures=0 step_before step_after
  rel=watch-$(stamp)
  if ((DRY_RUN)); then
    ensure_pod
    run_attempt "$LOG_ROOT/$rel/attempt-1" "$rel/attempt-1"
    note "dry run: showed the first attempt; a failed attempt is retried after a backoff"
    return 0
  fi
  mkdir -p "$LOG_ROOT/$rel"
  for ((attempt = 1; ; attempt++)); do
    step_before=$(latest_step)
    # A subshell with its own errexit: any failure inside ends only this attempt.
    set +e
    (
      set -e
      install_traps
      ensure_pod
      echo "$ACTION" >"$LOG_ROOT/$rel/action"
      run_attempt "$LOG_ROOT/$rel/attempt-$attempt" "$rel/attempt-$attempt"
    )
    rc=$?
    set -e
    if ((rc == 0)) && ! gcloud storage ls "${RUN_DIR%/}/summary.json" >/dev/null 2>&1; then
      note "every worker exited 0 but ${RUN_DIR%/}/summary.json does not exist: the run was stopped before its end (a preemption's SIGTERM saves a checkpoint and exits 0)"
      rc=$UNFINISHED_RC
    fi
    action=$(cat "$LOG_ROOT/$rel/action" 2>/dev/null || echo none)
    rm -f "$LOG_ROOT/$rel/action"
    status=$(cat "$LOG_ROOT/$rel/attempt-$attempt/exit_status" 2>/dev/null || echo "rc=$rc failed_worker=none")
    # Failures count (for the backoff and --max-retries) since the last attempt that moved
    # the run on: a multi-day run on spot capacity is preempted many times, each time after
    # committing new checkpoints.
    step_after=$(latest_step)
    ((step_after <= step_before)) || failures=0
    ((rc == 0)) || failures=$((failures + 1))
    wait_s=0
    ((rc == 0 || failures > MAX_RETRIES)) || wait_s=$(backoff_for "$failures")
    echo "$(stamp) attempt=$attempt pod=$action $status exit=$rc checkpoint=$step_after failures=$failures next_backoff_s=$wait_s" | tee -a "$LOG_ROOT/$rel/attempts.log" >&2
    upload_logs "$LOG_ROOT/$rel" "$rel"
    ((rc == 0)) && { note "run finished after $attempt attempt(s)"; return 0; }
    ((failures <= MAX_RETRIES)) || { note "giving up after $failures failed attempts in a row without a new checkpoint (last exit $rc); log: $LOG_ROOT/$rel/attempts.log"; return "$rc"; }
    note "retrying in ${wait_s}s (retry $failures of $MAX_RETRIES since the last new checkpoint); training resumes from $RUN_DIR"
    sleep "$wait_s"
  done
}

# ---------------------------------------------------------------- main

# Ctrl-C ends the local ssh sessions; training on the pod is ended by `stop`.
install_traps() {
  trap 'note "interrupted; ending local ssh sessions (stop training on the pod with: $PROG stop)"; reap; exit 130' INT TERM
}

cleanup() {
  reap
  [[ -z $TMP ]] || rm -rf "$TMP"
}

main() {
  (($#)) || { usage >&2; exit 2; }
  case " $SUBCOMMANDS " in
    *" $1 "*) CMD=$1; shift ;;
    *) case $1 in -h|--help|help) usage; exit 0 ;; esac
       die "unknown subcommand '$1' (valid: $SUBCOMMANDS)" ;;
  esac
  parse_opts "$@"
  check_opts
  TMP=$(mktemp -d)
  trap cleanup EXIT
  install_traps
  "cmd_$CMD"
}

main "$@"
