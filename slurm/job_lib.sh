# shellcheck shell=bash
# Shared by the sbatch templates in this folder (sourced from the batch script, never run).
#
# Provides: rendezvous and NCCL settings, a step runner that survives signals, and the
# checkpoint-then-requeue protocol:
#   1. Slurm sends SIGUSR1 to the batch shell some minutes before the time limit
#      (#SBATCH --signal=B:USR1@SECONDS);
#   2. the trap forwards it to the running srun, which forwards it to every rank, and writes
#      IGA_OUTPUT_DIR/STOP, the trainer's stop request that needs no signal (it still reaches a
#      rank whose handler was replaced or whose signal got lost); the trainer saves a checkpoint
#      and exits 0;
#   3. the batch script then runs `scontrol requeue`, and the requeued job (same job id, same
#      output_dir) resumes from that checkpoint through `resume=auto`.
# Preemption (SIGTERM to every process, then SIGKILL after the grace time) needs nothing here:
# the trainer saves on SIGTERM and Slurm requeues the job itself when PreemptMode=REQUEUE.

iga_log() {
    printf '[%s] iga-ds job %s: %s\n' "$(date '+%F %T')" "${SLURM_JOB_ID:-?}" "$*"
}

# MASTER_ADDR: first host of the job's node list; MASTER_PORT: derived from the job id so that
# jobs sharing a node do not collide. sbatch exports the submitting shell's environment, where a
# MASTER_ADDR/MASTER_PORT left by some earlier run would point every rank at a stale or busy
# address, so only IGA_MASTER_ADDR / IGA_MASTER_PORT override the job's own values.
iga_rendezvous() {
    local hosts
    # all of scontrol's output is read: `| head -n 1` would end it with SIGPIPE on a long node
    # list, and pipefail would end the job with it
    hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
    MASTER_ADDR=${IGA_MASTER_ADDR:-${hosts%%$'\n'*}}
    MASTER_PORT=${IGA_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
    export MASTER_ADDR MASTER_PORT
}

# A collective that fails or stalls must abort the job, not hang it until the time limit.
iga_nccl_env() {
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
    # Minutes: DeepSpeed's process-group timeout (its default is 10); a collective stuck longer
    # than this is aborted by the NCCL watchdog and the job fails instead of idling.
    export DEEPSPEED_TIMEOUT=${DEEPSPEED_TIMEOUT:-30}
}

# Caches on writable paths the job owns. The default base, ~/.cache, is where Hugging Face and
# torch look anyway, so builds and downloads are shared with runs outside Slurm; the container
# templates mount it, since a container run as the calling user cannot write the image's /root.
iga_cache_env() {
    export IGA_CACHE_DIR=${IGA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}}
    export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$IGA_CACHE_DIR}
    export HF_HOME=${HF_HOME:-$IGA_CACHE_DIR/huggingface}
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$IGA_CACHE_DIR/torch_extensions}
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$IGA_CACHE_DIR/triton}
    export IGA_DS_CACHE=${IGA_DS_CACHE:-$IGA_CACHE_DIR/iga-ds}
    mkdir -p "$HF_HOME" "$TORCH_EXTENSIONS_DIR" "$TRITON_CACHE_DIR" "$IGA_DS_CACHE"
}

# What every rank must see with the job's own values inside a container. Both runtimes let a
# variable the image sets win over the host's: Apptainer ("an environment variable set on the
# host will not override a variable of the same name that has been set inside the container
# image") and pyxis ("their existing values in the image take precedence"). So these are passed
# by name: APPTAINERENV_<NAME> for Apptainer, --container-env=<NAMES> for pyxis (0.15 or later).
IGA_CONTAINER_VARS=(XDG_CACHE_HOME HF_HOME TORCH_EXTENSIONS_DIR TRITON_CACHE_DIR IGA_DS_CACHE
                    PYTHONPATH OMP_NUM_THREADS)

iga_apptainer_env() {
    local name
    for name in "${IGA_CONTAINER_VARS[@]}"; do
        if [[ -n ${!name:-} ]]; then export "APPTAINERENV_$name=${!name}"; fi
    done
}

# The names, comma-separated, for pyxis's --container-env.
iga_pyxis_env_names() {
    local IFS=,
    echo "${IGA_CONTAINER_VARS[*]}"
}

# CPUs per rank: from Slurm 22.05 on, srun no longer takes the job's --cpus-per-task ("srun will
# no longer read in SLURM_CPUS_PER_TASK", its release notes), and a rank bound to one CPU starves
# its data loading, tokenization and the capture's host work. The templates pass --cpus-per-task
# to their srun; SRUN_CPUS_PER_TASK covers the srun calls made by others (DeepSpeed's slurm
# launcher, mpirun starting its daemons).
# A rank's threads match its CPUs (sbatch exports the submitting shell's OMP_NUM_THREADS, which
# says nothing about this job).
iga_cpus_per_rank() {
    IGA_CPUS_PER_RANK=${SLURM_CPUS_PER_TASK:-1}
    export SRUN_CPUS_PER_TASK=$IGA_CPUS_PER_RANK
    export OMP_NUM_THREADS=$IGA_CPUS_PER_RANK
}

iga_step_pid=""
iga_requeue_requested=0

iga_on_usr1() {
    iga_requeue_requested=1
    iga_log "SIGUSR1: asking the ranks to checkpoint, then requeueing"
    if [[ -n ${IGA_OUTPUT_DIR:-} ]]; then
        : > "$IGA_OUTPUT_DIR/STOP" || iga_log "could not write $IGA_OUTPUT_DIR/STOP; relying on the signal"
    fi
    if [[ -n $iga_step_pid ]]; then
        kill -USR1 "$iga_step_pid" 2>/dev/null || true
    fi
}

iga_on_term() {
    # Preemption or scancel: the ranks got SIGTERM from Slurm too and are saving; wait for them.
    iga_log "SIGTERM: waiting for the ranks to finish their checkpoint"
}

iga_install_traps() {
    trap iga_on_usr1 USR1
    trap iga_on_term TERM
}

# Run a command (an srun) in the background and wait for it; `wait` returns early when a trapped
# signal arrives, so keep waiting until the step has really ended and return its status.
iga_run_step() {
    local status
    "$@" &
    iga_step_pid=$!
    while true; do
        wait "$iga_step_pid"
        status=$?
        if ((status > 128)) && kill -0 "$iga_step_pid" 2>/dev/null; then
            continue
        fi
        break
    done
    iga_step_pid=""
    return "$status"
}

# After the training step: requeue when the time-limit signal came, within IGA_MAX_REQUEUES.
iga_maybe_requeue() {
    local restarts=${SLURM_RESTART_COUNT:-0}
    # training is over, and with it any stop it was asked for: the next run must not see it
    if [[ -n ${IGA_OUTPUT_DIR:-} ]]; then rm -f "$IGA_OUTPUT_DIR/STOP"; fi
    if ((iga_requeue_requested == 0)); then
        return 0
    fi
    if ((restarts >= ${IGA_MAX_REQUEUES:-20})); then
        iga_log "not requeueing: already requeued $restarts times (IGA_MAX_REQUEUES=${IGA_MAX_REQUEUES:-20})"
        return 0
    fi
    iga_log "requeueing (restart $((restarts + 1))); the next run resumes from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
}
