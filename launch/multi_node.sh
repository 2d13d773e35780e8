#!/usr/bin/env bash
# Train across several nodes (MultiWorkerMirroredStrategy): one worker process
# per node, each using all GPUs of its node, started over ssh from this host.
#
# Needs:
#   hardware  two or more nodes with NVIDIA GPUs, the same number on each,
#             and TCP port PORT open between all of them (gRPC for
#             collectives); this host needs only bash 4.3+, ssh and python3
#   software  passwordless ssh (keys, no prompt: BatchMode is on) from this
#             host to every node, each node's login shell POSIX-like
#             (sh/bash/zsh); the same distributed_mpt version installed at the
#             same path on every node, with `distributed-mpt-train` on the
#             PATH of a non-interactive ssh session (or set TRAIN_CMD to its
#             absolute path, e.g. /opt/venv/bin/distributed-mpt-train)
#   storage   a shared filesystem (NFS, Lustre, ...) mounted at the same path
#             on every node, holding MODEL_DIR, DATA_DIR, the recipe and the
#             current directory; CIFAR-10 prepared on it once, before the run:
#               distributed-mpt-prepare-data --data_dir=$DATA_DIR
#             (workers run with --nodownload so that they do not race to
#             download into the same directory)
#
# Example (hosts.txt: one hostname per line; blank lines and # comments are
# ignored; worker 0, the chief, is the first line; each name is used both
# for ssh from here and in TF_CONFIG, so it must resolve on every node):
#   DATA_DIR=/nfs/datasets MODEL_DIR=/nfs/runs/r9-2node \
#     launch/multi_node.sh hosts.txt --per_replica_batch_size=256
#
# Environment (all optional):
#   PORT            port every worker listens on       (default $DMPT_PORT, else 2222)
#   RECIPE          recipe name shipped in the package (resnet9, mlp) or the
#                   path of a flagfile                 (default resnet9)
#   MODEL_DIR       checkpoints, logs, summary.json    (default runs/cifar10-<recipe>)
#   DATA_DIR        tensorflow-datasets directory      (default $HOME/tensorflow_datasets)
#                   Relative paths are made absolute here, against this
#                   directory, which the workers also cd into.
#   TRAIN_CMD       trainer command on the nodes       (default distributed-mpt-train)
#   REMOTE_ENV      extra VAR=value words set for the trainer on every node,
#                   e.g. "NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=eth0"
#   SSH             ssh client                         (default ssh)
#   SSH_OPTS        ssh options  (default "-o BatchMode=yes -o ConnectTimeout=10")
#   PYTHON          interpreter with distributed_mpt installed, used only to
#                   find the shipped recipes           (default python3)
#   DRY_RUN=1       print the ssh command for each node, one per line, and exit
# Arguments after the host file are passed through to every worker after the
# recipe, so they override it (absl reads flags left to right).
#
# Each worker's output is prefixed with "[worker I] ". If a worker fails, the
# others are stopped (they could not go on without it); Ctrl-C stops all of
# them, on their nodes. The exit status is worker 0's.
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
log() { echo "multi_node.sh: $*" >&2; }

absolute() { if [[ $1 == /* ]]; then printf '%s\n' "$1"; else printf '%s\n' "$PWD/$1"; fi; }

# --- arguments and host list ------------------------------------------------

(( $# >= 1 )) || die "usage: multi_node.sh HOSTFILE [trainer flags...] (HOSTFILE: one hostname per line)"
host_file=$1
shift
[[ $host_file != -* ]] || die "the first argument must be the host file (one hostname per line), got '$host_file'"
[[ -r $host_file && ! -d $host_file ]] ||
  die "host file '$host_file' not found or not readable: write one hostname per line, worker 0 first"

hosts=()
declare -A line_of_host=()
line_number=0
while IFS= read -r line || [[ -n $line ]]; do
  line_number=$((line_number + 1))
  line=${line%%#*}
  read -r host extra <<<"$line" || true
  [[ -n ${host:-} ]] || continue
  [[ -z ${extra:-} ]] || die "$host_file:$line_number: expected one hostname, got '$line'"
  # It goes into TF_CONFIG as host:PORT, where user@ or an IPv6 address would not do.
  [[ $host =~ ^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$ ]] ||
    die "$host_file:$line_number: '$host' is not a hostname or IPv4 address (no user@, no port: set PORT)"
  # Two workers on one host would both listen on PORT.
  [[ -z ${line_of_host[$host]:-} ]] ||
    die "$host_file:$line_number: host '$host' already listed on line ${line_of_host[$host]}; list each node once"
  line_of_host[$host]=$line_number
  hosts+=("$host")
done <"$host_file"
(( ${#hosts[@]} > 0 )) || die "host file '$host_file' lists no hosts: write one hostname per line, worker 0 first"

PORT=${PORT:-${DMPT_PORT:-2222}}
if ! [[ $PORT =~ ^[0-9]+$ ]] || (( PORT < 1 || PORT > 65535 )); then
  die "PORT=$PORT is not a TCP port (1-65535)"
fi

recipe_path=$(absolute "$(resolve_recipe "${RECIPE:-resnet9}")")
MODEL_DIR=$(absolute "${MODEL_DIR:-runs/cifar10-$(basename "$recipe_path" .flags)}")
DATA_DIR=$(absolute "${DATA_DIR:-$HOME/tensorflow_datasets}")
SSH=${SSH:-ssh}
read -r -a ssh_opts <<<"${SSH_OPTS:--o BatchMode=yes -o ConnectTimeout=10}"
read -r -a remote_env <<<"${REMOTE_ENV:-}"
for assignment in "${remote_env[@]}"; do
  [[ $assignment =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "REMOTE_ENV: '$assignment' is not VAR=value"
done

command -v python3 >/dev/null || die "python3 is needed on this host to write TF_CONFIG"

# --- one TF_CONFIG and one ssh command per node -----------------------------

# json.dumps, not string pasting: hostnames end up inside JSON strings.
tf_configs_text=$(python3 - "$PORT" "${hosts[@]}" <<'PY'
import json
import sys

port, hosts = sys.argv[1], sys.argv[2:]
workers = [f"{host}:{port}" for host in hosts]
for index in range(len(hosts)):
    config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    print(json.dumps(config, separators=(",", ":")))
PY
)
mapfile -t tf_configs <<<"$tf_configs_text"
(( ${#tf_configs[@]} == ${#hosts[@]} )) || die "internal error: wrote ${#tf_configs[@]} TF_CONFIGs for ${#hosts[@]} hosts"

train_cmd=(
  "${TRAIN_CMD:-distributed-mpt-train}"
  --strategy=multi_worker
  --flagfile="$recipe_path"
  --data_dir="$DATA_DIR"
  --model_dir="$MODEL_DIR"
  --nodownload
  "$@"
)
printf -v train_cmd_quoted '%q ' "${train_cmd[@]}"
train_cmd_quoted=${train_cmd_quoted% }
remote_env_quoted=
if (( ${#remote_env[@]} > 0 )); then
  printf -v remote_env_quoted '%q ' "${remote_env[@]}"
fi
printf -v workdir_quoted '%q' "$PWD"

# PYTHONUNBUFFERED: through ssh's pipe, Python would otherwise hold back
# stdout for minutes. Each worker records its pid on its node so that Ctrl-C can stop it there:
# without a terminal, killing the local ssh does not stop the remote process.
run_id="$(date +%Y%m%d-%H%M%S)-$$-$RANDOM"
pidfiles=()
ssh_commands=()
for i in "${!hosts[@]}"; do
  pidfiles[i]="/tmp/distributed-mpt-$run_id-worker$i.pid"
  printf -v pidfile_quoted '%q' "${pidfiles[i]}"
  printf -v tf_config_quoted '%q' "TF_CONFIG=${tf_configs[i]}"
  ssh_commands[i]="cd $workdir_quoted && echo \$\$ > $pidfile_quoted && { env PYTHONUNBUFFERED=1 $tf_config_quoted $remote_env_quoted$train_cmd_quoted; rc=\$?; rm -f $pidfile_quoted; exit \$rc; }"
done

if [[ ${DRY_RUN:-0} == 1 ]]; then
  # Single quotes around the remote command read better than a second %q.
  for i in "${!hosts[@]}"; do
    printf '%q ' "$SSH" -n "${ssh_opts[@]}" "${hosts[i]}"
    printf "'%s'\n" "${ssh_commands[i]//\'/\'\\\'\'}"
  done
  exit 0
fi

# --- run, watch, stop -------------------------------------------------------

prefix_lines() {
  local line
  while IFS= read -r line || [[ -n $line ]]; do
    printf '[worker %s] %s\n' "$1" "$line"
  done
}

pids=()
# sshd starts each remote command in a session of its own, so the shell that
# wrote the pid file leads a process group holding the trainer and anything
# it started: the whole group is signalled.
# Only workers whose ssh is still connected are stopped: their remote process
# is then still alive, so its recorded pid cannot have been reused.
stop_workers() {
  local i pidfile_quoted killers=()
  for i in "${!pids[@]}"; do
    kill -0 "${pids[i]}" 2>/dev/null || continue
    printf -v pidfile_quoted '%q' "${pidfiles[i]}"
    "$SSH" -n "${ssh_opts[@]}" "${hosts[i]}" \
      "pid=\$(cat $pidfile_quoted) && kill -TERM -\$pid 2>/dev/null; rm -f $pidfile_quoted" </dev/null &
    killers+=("$!")
  done
  (( ${#killers[@]} == 0 )) && return 0
  wait "${killers[@]}" || true
  # Let the stopped workers' last lines through, then drop the connections.
  for _ in {1..25}; do
    for i in "${!pids[@]}"; do
      kill -0 "${pids[i]}" 2>/dev/null && { sleep 0.2; continue 2; }
    done
    return 0
  done
  for i in "${!pids[@]}"; do
    kill -TERM "${pids[i]}" 2>/dev/null || true
  done
}
trap stop_workers EXIT
trap 'trap - INT TERM HUP; log "interrupted: stopping all workers"; exit 130' INT TERM HUP

log "starting ${#hosts[@]} workers on port $PORT: ${hosts[*]}"
for i in "${!hosts[@]}"; do
  "$SSH" -n "${ssh_opts[@]}" "${hosts[i]}" "${ssh_commands[i]}" </dev/null > >(prefix_lines "$i") 2>&1 &
  pids[i]=$!
done

# Poll rather than `wait -n`: it works on bash 4 and tells which worker ended.
statuses=()
failed_worker=
while (( ${#statuses[@]} < ${#pids[@]} )); do
  for i in "${!pids[@]}"; do
    [[ -z ${statuses[i]+set} ]] || continue
    kill -0 "${pids[i]}" 2>/dev/null && continue
    status=0
    wait "${pids[i]}" || status=$?
    statuses[i]=$status
    if (( status != 0 )) && [[ -z $failed_worker ]]; then
      failed_worker=$i
      log "worker $i (${hosts[i]}) exited with status $status: stopping the other workers"
      stop_workers
    fi
  done
  sleep 0.2
done

log "exit statuses by worker: ${statuses[*]}"
exit "${statuses[0]}"
