#!/usr/bin/env bash
# Train on all GPUs of one node (MirroredStrategy, one process, one replica
# per GPU; the global batch is per_replica_batch_size * number of GPUs).
#
# Needs:
#   hardware  one node with one or more NVIDIA GPUs (NCCL all-reduce between
#             them; the trainer picks the cross-device ops)
#   software  the distributed_mpt package installed, so that
#             `distributed-mpt-train` is on PATH (pip install -e .)
#   storage   local disk for MODEL_DIR and DATA_DIR; CIFAR-10 is downloaded
#             into DATA_DIR on first use, or prepared beforehand with
#             `distributed-mpt-prepare-data --data_dir=$DATA_DIR`
#
# Example:
#   GPUS=0,1,2,3 launch/single_node.sh --per_replica_batch_size=256
#
# Environment (all optional):
#   GPUS       comma-separated GPU indices to use     (default: all visible)
#   RECIPE     recipe name shipped in the package (resnet9, mlp) or the path
#              of a flagfile                          (default resnet9)
#   MODEL_DIR  checkpoints, logs, summary.json        (default runs/cifar10-<recipe>)
#   DATA_DIR   tensorflow-datasets directory          (default $HOME/tensorflow_datasets)
#   PYTHON     interpreter that has distributed_mpt installed, used only to
#              find the shipped recipes               (default python3)
# Arguments are passed through to the trainer after the recipe, so they
# override it (absl reads flags left to right).
#
# To exercise the multi-worker path (MultiWorkerMirroredStrategy) on this one
# host, e.g. before going to several nodes, use the Python launcher instead:
# it starts N local worker processes with TF_CONFIG on 127.0.0.1 and restarts
# the group when one dies:
#   distributed-mpt-launch --num_workers=2 --max_restarts=1 -- \
#     --flagfile="$(python3 -c 'import importlib.resources as r; print(r.files("distributed_mpt") / "recipes" / "resnet9.flags")')" \
#     --model_dir=runs/cifar10-resnet9-2workers
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

local_run_defaults

if [[ -n ${GPUS:-} ]]; then
  export CUDA_VISIBLE_DEVICES=$GPUS
fi

exec distributed-mpt-train \
  --strategy=mirrored \
  --flagfile="$recipe_path" \
  --data_dir="$DATA_DIR" \
  --model_dir="$MODEL_DIR" \
  "$@"
