#!/usr/bin/env bash
# The one-node check list on the GPUs of one machine (up to 8), writing JSON and logs to OUT_DIR
# and a table of the results to OUT_DIR/summary.md.
#
# Usage: bash bench/node_runs.sh OUT_DIR [--dry-run] [bench] [equivalence] [resume]
#   (no part named: all three; --dry-run or DRY_RUN=1 prints every command and runs nothing)
#   bench:       bench_step.py, ERM and the fused IGA (LLaMA-2-7B shape, ZeRO-2, bf16) on 1, 2, 4
#                and 8 GPUs, as many of them as the machine has
#   equivalence: tests/engine/test_ds_hook_gpu.py at world size N (every visible GPU) against world size 1
#   resume:      the launch line of the Slurm templates run directly under torchrun on N GPUs (tiny
#                built-in base, ds_configs/zero2.json): midway, OUT_DIR/train/STOP and SIGUSR1
#                to the ranks (as the templates' trap does), the same command again, then a check
#                that the steps continue to the requested one
# N is the number of visible GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi), or NODE_GPUS when set.
# A dry run on a machine without GPUs plans for NODE_GPUS, default 8. Parts that need more GPUs
# than there are are skipped and listed in the summary. Each stage has its own time limit.
#
# Variables: IGA_PYTHON (default python3), NODE_GPUS, STEP_METHODS (default erm,iga_fused),
# STEP_STEPS (10), STEP_ROUNDS (2: erm, iga, iga, erm), STEP_LIMIT (900 s per benchmark size),
# EQUIV_LIMIT (900 s), TRAIN_STEPS (300),
# TRAIN_STOP_AT (TRAIN_STEPS / 2: the step after which the stop is asked), TRAIN_LIMIT (900 s per
# training run), TRAIN_GROUPS (300 synthetic isomer groups).
# Exit status: 0 when every stage that ran exited 0, else 1.
set -uo pipefail

usage="usage: bash bench/node_runs.sh OUT_DIR [--dry-run] [bench] [equivalence] [resume]"
case ${DRY_RUN:-0} in ""|0|false|no) dry_run=0 ;; *) dry_run=1 ;; esac
out=""
parts=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    bench|equivalence|resume) parts+=("$arg") ;;
    -*) echo "node_runs.sh: unknown option $arg; $usage" >&2; exit 2 ;;
    *)
      if [[ -n $out ]]; then echo "node_runs.sh: unknown part $arg; $usage" >&2; exit 2; fi
      out=$arg
      ;;
  esac
done
if [[ -z $out ]]; then echo "$usage" >&2; exit 2; fi
if ((${#parts[@]} == 0)); then parts=(bench equivalence resume); fi
[[ $out == /* ]] || out=$PWD/$out  # the script runs from the repository root

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 2
py=${IGA_PYTHON:-python3}
methods=${STEP_METHODS:-erm,iga_fused}
steps=${STEP_STEPS:-10}
rounds=${STEP_ROUNDS:-2}
train_steps=${TRAIN_STEPS:-300}
stop_at=${TRAIN_STOP_AT:-$((train_steps / 2))}

# the launch environment of slurm/pyxis.sbatch, less what only Slurm provides
# shellcheck source=slurm/job_lib.sh disable=SC1091  # followed under shellcheck -x
source "$repo/slurm/job_lib.sh"
iga_nccl_env
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

visible_gpus() {
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    local ids
    IFS=, read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
    echo "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true
  else
    echo 0
  fi
}

n=${NODE_GPUS:-$(visible_gpus)}
if ((n < 1)); then
  if ((dry_run)); then
    n=8
    echo "# no GPU visible: the dry run plans for $n (set NODE_GPUS for another count)"
  else
    echo "node_runs.sh: no GPU visible (set CUDA_VISIBLE_DEVICES or NODE_GPUS)" >&2
    exit 2
  fi
fi
echo "# node check list on $n GPU(s): ${parts[*]} -> $out$( ((dry_run)) && echo ' (dry run)')"
if ((!dry_run)); then
  mkdir -p "$out"
  : >"$out/stages.tsv"
  : >"$out/skipped.txt"
fi

show() {  # print a command as it would be typed (a last argument "&": run in the background)
  local arg line="+"
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ || $arg == "&" ]]; then
      line+=" $arg"
    elif [[ $arg != *"'"* ]]; then
      line+=" '$arg'"
    else
      line+=" $(printf '%q' "$arg")"
    fi
  done
  echo "$line"
}

failed=0
stage() {  # stage NAME LIMIT_SECONDS COMMAND...: run it under its own time limit, log to OUT/NAME.log
  local name=$1 limit=$2 rc
  shift 2
  echo "=== $name (limit ${limit} s)"
  show timeout "$limit" "$@"
  if ((dry_run)); then return 0; fi
  echo "=== $name start $(date -u +%H:%M:%S)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -n 40
  rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc"
  printf '%s\t%s\n' "$name" "$rc" >>"$out/stages.tsv"
  if ((rc != 0)); then failed=1; fi
  return "$rc"
}

skip() {  # skip NAME REASON
  echo "--- skipped $1: $2"
  if ((!dry_run)); then printf '%s\t%s\n' "$1" "$2" >>"$out/skipped.txt"; fi
}

want() {
  local p
  for p in "${parts[@]}"; do [[ $p == "$1" ]] && return 0; done
  return 1
}

# -- the machine ------------------------------------------------------------------------------
stage gpus 60 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
versions='import torch, deepspeed, transformers, peft
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
stage versions 120 "$py" -c "$versions"

# -- 1. the step benchmark on 1, 2, 4, 8 GPUs ---------------------------------------------------
if want bench; then
  for g in 1 2 4 8; do
    if ((g > n)); then
      skip "bench_step_${g}gpu" "needs $g GPUs, $n visible"
      continue
    fi
    stage "bench_step_${g}gpu" "${STEP_LIMIT:-900}" "$py" bench/bench_step.py --gpus "$g" --methods "$methods" \
      --steps "$steps" --rounds "$rounds" --out "$out/bench_step_${g}gpu.json"
  done
fi

# -- 2. ZeRO-2 bf16 equivalence, world size N against world size 1 --------------------------------
if want equivalence; then
  if ((n < 2)); then
    skip equivalence "needs 2 GPUs, $n visible"
  else
    stage equivalence "${EQUIV_LIMIT:-900}" env "IGA_DS_RESULTS=$out" "IGA_DS_GPU_WORLD=$n" \
      "$py" -m pytest -q -s -p no:cacheprovider tests/engine/test_ds_hook_gpu.py -m gpu
  fi
fi

# -- 3. the template's launch line under torchrun: a stop midway, then resume -------------------
if want resume; then
  # whole isomer groups per step: 8 when N divides it (the same global batch on 1, 2, 4, 8 GPUs)
  if ((8 % n == 0)); then groups_per_step=8; else groups_per_step=$((2 * n)); fi
  train_out=$out/train
  train=("$py" -m torch.distributed.run --standalone --nproc_per_node "$n" launch/train.py
         --config configs/tiny_cpu.yaml --deepspeed ds_configs/zero2.json
         "output_dir=$train_out" resume=auto "data.train=$out/train_data/train.jsonl"
         "data.groups_per_step=$groups_per_step" data.groups_per_micro_batch=1
         "schedule.max_steps=$train_steps" checkpoint.every_steps=100 logging.progress=false)
  limit=${TRAIN_LIMIT:-900}
  ok=1
  stage train_data 300 "$py" -m iga_ds.cli data synth --out "$out/train_data" --groups "${TRAIN_GROUPS:-300}" \
    --shortcut 0.9 --no-progress || ok=0
  # the built-in tiny base is pretrained once and cached; the ranks then only read it
  ((ok)) && { stage train_base 900 "$py" -m iga_ds.cli pretrain-tiny || ok=0; }
  if ((ok)); then
    echo "=== train_run1 (limit ${limit} s): stop file and SIGUSR1 once metrics.jsonl reaches step $stop_at"
    show timeout "$limit" "${train[@]}" "&"
    echo "# when $train_out/metrics.jsonl has $stop_at lines:" \
      ": > $train_out/STOP; kill -USR1 <every rank: the children of the torchrun process>"
    if ((!dry_run)); then
      rm -rf "$train_out"
      timeout "$limit" "${train[@]}" >"$out/train_run1.log" 2>&1 &
      job=$!
      signalled=0
      while kill -0 "$job" 2>/dev/null; do
        lines=0
        [[ -f $train_out/metrics.jsonl ]] && lines=$(wc -l <"$train_out/metrics.jsonl")
        if ((lines >= stop_at)); then
          # timeout -> the torchrun agent -> one process per rank, as srun would signal them
          agent=$(pgrep -P "$job" | head -n 1)
          ranks=()
          [[ -n $agent ]] && mapfile -t ranks < <(pgrep -P "$agent")
          if ((${#ranks[@]} == 0)); then
            echo "metrics at step $lines but no rank process found under pid $job"
            break
          fi
          # as the templates' trap: the stop file, then the signal; the trainer's "stopping (...)"
          # line says which of the two reached the ranks
          echo "metrics at step $lines: $train_out/STOP, then SIGUSR1 to the ranks, pids ${ranks[*]}"
          : >"$train_out/STOP"
          kill -USR1 "${ranks[@]}" && signalled=1
          # what each signalled process is, and whether it catches, blocks or still holds SIGUSR1
          # (bit 10 of the masks: 0x200): a rank that ignores the signal shows up here
          sleep 2
          for pid in "${ranks[@]}"; do
            echo "pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120)"
            grep -E '^(SigCgt|SigBlk|SigPnd|ShdPnd):' "/proc/$pid/status" 2>/dev/null | tr '\n' ' '
            echo
          done
          break
        fi
        sleep 0.2
      done
      wait "$job"
      rc=$?
      tail -n 20 "$out/train_run1.log"
      grep -m 1 "stopping (" "$out/train_run1.log" || echo "no rank reported stopping"
      if ((!signalled)); then
        echo "the first run ended before step $stop_at: no signal was sent"
        rc=1
      fi
      echo "=== train_run1 exit $rc"
      printf '%s\t%s\n' train_run1 "$rc" >>"$out/stages.tsv"
      if ((rc != 0)); then failed=1; fi
    fi
    # the same command again: resume=auto continues from the checkpoint the signal made
    stage train_run2 "$limit" "${train[@]}"
    stage train_check 60 "$py" bench/node_summary.py "$out" --check-train --train-steps "$train_steps"
  else
    skip train_runs "the data or the tiny base could not be built"
  fi
fi

# -- summary --------------------------------------------------------------------------------------
echo "=== summary"
show "$py" bench/node_summary.py "$out" --train-steps "$train_steps"
if ((!dry_run)); then
  "$py" bench/node_summary.py "$out" --train-steps "$train_steps" || failed=1
fi
exit "$failed"
