#!/usr/bin/env bash
# Multi-node through the DeepSpeed launcher inside a Slurm allocation (sbatch or salloc):
# writes a hostfile from SLURM_JOB_NODELIST and runs `deepspeed --launcher slurm`, which starts
# the ranks with srun (no pdsh or ssh; works where containers have neither).
#
#   salloc --nodes=2 --gpus-per-node=8 --ntasks-per-node=8 --exclusive
#   launch/deepspeed_slurm.sh --config configs/llama2_7b_iga.yaml --deepspeed ds_configs/zero2.json schedule.max_steps=100
#
# DeepSpeed's slurm launcher sets no RANK or LOCAL_RANK: each rank finds its own from SLURM_*
# (iga_ds.cluster.ranks), so ranks never all believe they are rank 0.
# Variables: IGA_PYTHON (default python3), IGA_SLOTS (ranks per node; default SLURM_GPUS_ON_NODE,
# else 8), IGA_DS_LAUNCHER (slurm, or openmpi to go through mpirun), MASTER_PORT (default from
# the job id), IGA_TRAIN_SCRIPT (default launch/train.py).
set -euo pipefail

if [[ -z ${SLURM_JOB_ID:-} ]]; then
    echo "launch/deepspeed_slurm.sh: run it inside a Slurm allocation (sbatch or salloc)" >&2
    exit 2
fi
python=${IGA_PYTHON:-python3}
slots=${IGA_SLOTS:-${SLURM_GPUS_ON_NODE:-8}}
tmpdir=$(mktemp -d)
trap 'rm -rf "$tmpdir"' EXIT
"$python" -m iga_ds.cli hostfile --slots "$slots" --output "$tmpdir/hostfile"

MASTER_ADDR=${MASTER_ADDR:-$(awk 'NF {print $1; exit}' "$tmpdir/hostfile")}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
export MASTER_ADDR MASTER_PORT
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# DeepSpeed's srun gives each rank the job's CPUs per task only when told (Slurm 22.05 and later
# no longer read SLURM_CPUS_PER_TASK; slurm/job_lib.sh).
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi

# The hostfile gives nodes and ranks per node; srun keeps the GPUs the allocation already has.
# --force_multi: srun starts the ranks even on one node. --no_ssh_check: the runner would
# otherwise insist on passwordless ssh to the first host, which srun does not need and
# containers rarely have.
"$python" -m deepspeed.launcher.runner --hostfile "$tmpdir/hostfile" --no_ssh_check --force_multi \
    --launcher "${IGA_DS_LAUNCHER:-slurm}" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "${IGA_TRAIN_SCRIPT:-launch/train.py}" "$@"
