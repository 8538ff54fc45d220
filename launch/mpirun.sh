#!/usr/bin/env bash
# Start ranks with mpirun instead of the DeepSpeed launcher or srun (no pdsh/ssh setup needed
# beyond what MPI already uses).
#
#   launch/mpirun.sh -np 16 [--hostfile FILE] -- python launch/train.py --config CFG.yaml \
#       --deepspeed ds_configs/zero2.json [key=value ...]
#   launch/mpirun.sh -np 2 -- iga-ds selfcheck
#
# Inside a Slurm allocation without --hostfile, the hostfile is written from SLURM_JOB_NODELIST
# (`iga-ds hostfile`). MASTER_ADDR defaults to the first host (127.0.0.1 without a hostfile);
# each rank then reads its rank from OMPI_COMM_WORLD_* or, under another MPI, through mpi4py
# (iga_ds.cluster.ranks). Extra mpirun options: MPIRUN_ARGS="--mca btl_tcp_if_include ib0".
# Variables: IGA_PYTHON (interpreter for `iga-ds hostfile`, default python3), MASTER_PORT (29500).
set -euo pipefail

usage() {
    sed -n '2,14p' "$0" >&2
    exit 2
}

np=""
hostfile=""
while (($#)); do
    case $1 in
        -np | -n) np=${2:?-np needs a number}; shift 2 ;;
        --hostfile) hostfile=${2:?--hostfile needs a file}; shift 2 ;;
        --) shift; break ;;
        -h | --help) usage ;;
        *) echo "launch/mpirun.sh: unknown option $1 (put the command after --)" >&2; exit 2 ;;
    esac
done
[[ -n $np && $np =~ ^[0-9]+$ && $np -ge 1 ]] || { echo "launch/mpirun.sh: -np N is required" >&2; exit 2; }
(($#)) || { echo "launch/mpirun.sh: no command after --" >&2; exit 2; }

python=${IGA_PYTHON:-python3}
tmpdir=""
cleanup() { if [[ -n $tmpdir ]]; then rm -rf "$tmpdir"; fi; }
trap cleanup EXIT

if [[ -z $hostfile && -n ${SLURM_JOB_NODELIST:-} ]]; then
    tmpdir=$(mktemp -d)
    hostfile=$tmpdir/hostfile
    "$python" -m iga_ds.cli hostfile --output "$hostfile"
fi

if [[ -z ${MASTER_ADDR:-} ]]; then
    if [[ -n $hostfile ]]; then
        MASTER_ADDR=$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$hostfile")
    else
        MASTER_ADDR=127.0.0.1
    fi
fi
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}

args=(-np "$np" --bind-to none --map-by slot)
if [[ -n $hostfile ]]; then args+=(--hostfile "$hostfile"); fi
# By name (-x): the values travel with mpirun's launch, never on a command line (HF_TOKEN).
for var in MASTER_ADDR MASTER_PORT TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_ASYNC_ERROR_HANDLING \
           PATH LD_LIBRARY_PATH PYTHONPATH DS_ACCELERATOR OMP_NUM_THREADS TOKENIZERS_PARALLELISM \
           XDG_CACHE_HOME HF_HOME HF_DATASETS_CACHE HF_TOKEN TORCH_EXTENSIONS_DIR TRITON_CACHE_DIR \
           IGA_DS_CACHE NCCL_NVLS_ENABLE NCCL_DEBUG; do
    if [[ -n ${!var:-} ]]; then args+=(-x "$var"); fi
done
if [[ $(id -u) == 0 ]]; then
    # Containers often run as root; Open MPI refuses that unless told twice.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
read -r -a extra <<<"${MPIRUN_ARGS:-}"
exec mpirun "${args[@]}" "${extra[@]}" "$@"
