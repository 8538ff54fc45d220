#!/usr/bin/env bash
# Single node, no Slurm: selfcheck, then training on all GPUs of this machine in the image
# (`docker run --gpus all --ipc=host`, the DeepSpeed launcher inside the container).
#
#   IGA_IMAGE=iga-ds:0.1.0 launch/docker_run.sh --config configs/llama2_7b_iga.yaml \
#       --deepspeed ds_configs/zero2.json schedule.max_steps=100
#
# Runs as the calling user (files in the checkout stay yours); the checkout is mounted at
# /workspace and runs on the image's pinned dependencies (PYTHONPATH), and IGA_CACHE_DIR (default
# ~/.cache/iga-ds) at /cache for Hugging Face downloads, compiled ops and Triton kernels. The
# image's own entrypoint stays in front of each command. HF_TOKEN, if set, is passed by name (its
# value never appears on a command line).
# Variables: IGA_IMAGE (default iga-ds:0.1.0), IGA_NUM_GPUS (default: all), IGA_CACHE_DIR.
set -euo pipefail

image=${IGA_IMAGE:-iga-ds:0.1.0}
cache=${IGA_CACHE_DIR:-$HOME/.cache/iga-ds}
mkdir -p "$cache"
common=(--rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864
        --user "$(id -u):$(id -g)" -e HOME=/tmp
        -v "$PWD:/workspace" -v "$cache:/cache" -w /workspace -e PYTHONPATH=/workspace
        -e XDG_CACHE_HOME=/cache -e HF_HOME=/cache/huggingface -e TORCH_EXTENSIONS_DIR=/cache/torch_extensions
        -e TRITON_CACHE_DIR=/cache/triton -e IGA_DS_CACHE=/cache/iga-ds)
if [[ -n ${HF_TOKEN:-} ]]; then common+=(-e HF_TOKEN); fi

docker run "${common[@]}" "$image" iga-ds selfcheck
gpus=()
if [[ -n ${IGA_NUM_GPUS:-} ]]; then gpus=(--num_gpus "$IGA_NUM_GPUS"); fi
exec docker run "${common[@]}" "$image" deepspeed "${gpus[@]}" launch/train.py "$@"
