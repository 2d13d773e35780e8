#!/usr/bin/env bash
# Train on one GPU of a workstation (OneDeviceStrategy).
#
# Needs:
#   hardware  one NVIDIA GPU with a CUDA driver TensorFlow 2.21 supports
#   software  the distributed_mpt package installed, so that
#             `distributed-mpt-train` is on PATH (pip install -e .)
#   storage   local disk for MODEL_DIR and DATA_DIR; CIFAR-10 is downloaded
#             into DATA_DIR on first use, or prepared beforehand with
#             `distributed-mpt-prepare-data --data_dir=$DATA_DIR`
#
# Example:
#   GPU=1 RECIPE=mlp launch/single_gpu.sh --epochs=5
#
# Environment (all optional):
#   GPU        GPU index to use                       (default 0)
#   RECIPE     recipe name shipped in the package (resnet9, mlp) or the path
#              of a flagfile                          (default resnet9)
#   MODEL_DIR  checkpoints, logs, summary.json        (default runs/cifar10-<recipe>)
#   DATA_DIR   tensorflow-datasets directory          (default $HOME/tensorflow_datasets)
#   PYTHON     interpreter that has distributed_mpt installed, used only to
#              find the shipped recipes               (default python3)
# Arguments are passed through to the trainer after the recipe, so they
# override it (absl reads flags left to right).
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

local_run_defaults

CUDA_VISIBLE_DEVICES=${GPU:-0} exec distributed-mpt-train \
  --strategy=one_device \
  --flagfile="$recipe_path" \
  --data_dir="$DATA_DIR" \
  --model_dir="$MODEL_DIR" \
  "$@"
