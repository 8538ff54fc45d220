#!/usr/bin/env bash
# Single node, no Slurm: selfcheck, then training on all GPUs of this machine in the image
# (`docker run --gpus all --ipc=host`, the DeepSpeed launcher inside the container).
#
#   IGA_IMAGE=iga-ds:0.1.0 launch/docker_run.sh --config configs/llama2_7b_iga.yaml \
#       --deepspeed ds_configs/zero2.json schedule.max_steps=100
#
# Runs as the calling user (files in the checkout stay yours); a root caller gets the image's own
# non-root user instead (the checkout and IGA_CACHE_DIR must then be writable by it). The checkout
# is mounted at /workspace and runs on the image's pinned dependencies (PYTHONPATH), and
# IGA_CACHE_DIR (default ~/.cache/iga-ds) at /cache for Hugging Face downloads, compiled ops and
# Triton kernels. The image's own entrypoint stays in front of each command. HF_TOKEN, if set, is
# passed by name (its value never appears on a command line), and so is OMP_NUM_THREADS.
# Variables: IGA_IMAGE (default iga-ds:0.1.0); IGA_ENGINE (docker, the default, or podman: GPUs
# through CDI, --device nvidia.com/gpu=all); IGA_ACCELERATOR (cuda, the default, or cpu: no GPU
# and no locked-memory limit asked of the engine, DS_ACCELERATOR=cpu, gloo between ranks);
# IGA_NUM_GPUS (DeepSpeed's --num_gpus: default all GPUs; on the CPU the number of ranks);
# IGA_CONTAINER_USER (uid:gid to run as; empty: the image's user); IGA_CACHE_DIR.
#
# On the CPU, with podman (2 ranks, gloo; tests/launch/test_container_image.py runs it on a smaller tiny base):
#   IGA_ENGINE=podman IGA_ACCELERATOR=cpu IGA_NUM_GPUS=2 IGA_IMAGE=localhost/iga-ds:cpu \
#       launch/docker_run.sh --config configs/tiny_cpu.yaml schedule.max_steps=2
set -euo pipefail

image=${IGA_IMAGE:-iga-ds:0.1.0}
engine=${IGA_ENGINE:-docker}
accelerator=${IGA_ACCELERATOR:-cuda}
cache=${IGA_CACHE_DIR:-$HOME/.cache/iga-ds}
if [[ $accelerator != cuda && $accelerator != cpu ]]; then
    echo "docker_run.sh: IGA_ACCELERATOR=$accelerator: expected cuda or cpu" >&2
    exit 2
fi
if [[ -z ${IGA_CONTAINER_USER+set} ]]; then
    if [[ $(id -u) == 0 ]]; then IGA_CONTAINER_USER=""; else IGA_CONTAINER_USER="$(id -u):$(id -g)"; fi
fi
mkdir -p "$cache"
common=(--rm --ipc=host -e HOME=/tmp
        -v "$PWD:/workspace" -v "$cache:/cache" -w /workspace -e PYTHONPATH=/workspace
        -e XDG_CACHE_HOME=/cache -e HF_HOME=/cache/huggingface -e TORCH_EXTENSIONS_DIR=/cache/torch_extensions
        -e TRITON_CACHE_DIR=/cache/triton -e IGA_DS_CACHE=/cache/iga-ds)
if [[ -n $IGA_CONTAINER_USER ]]; then common+=(--user "$IGA_CONTAINER_USER"); fi
if [[ $accelerator == cuda ]]; then
    if [[ $(basename "$engine") == podman ]]; then common+=(--device nvidia.com/gpu=all); else common+=(--gpus all); fi
    common+=(--ulimit memlock=-1 --ulimit stack=67108864)
else
    common+=(-e DS_ACCELERATOR=cpu)
fi
if [[ -n ${HF_TOKEN:-} ]]; then common+=(-e HF_TOKEN); fi
if [[ -n ${OMP_NUM_THREADS:-} ]]; then common+=(-e OMP_NUM_THREADS); fi

"$engine" run "${common[@]}" "$image" iga-ds selfcheck
gpus=()
if [[ -n ${IGA_NUM_GPUS:-} ]]; then gpus=(--num_gpus "$IGA_NUM_GPUS"); fi
exec "$engine" run "${common[@]}" "$image" deepspeed "${gpus[@]}" launch/train.py "$@"
