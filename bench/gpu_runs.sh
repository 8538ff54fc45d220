#!/usr/bin/env bash
# Runs the GPU checks and benchmarks in one go on a machine with 1-4 GPUs, writing JSON and logs
# to OUT_DIR. Usage: bash bench/gpu_runs.sh OUT_DIR [checks|capture|targets1|step1|step2|step4]...
#   checks: every GPU test (the 2-GPU bf16 equivalence where 2 GPUs are visible), bench_method
#           (128 LLaMA-2-7B modules)
#   capture: bench_capture.py's capture against PyTorch's own LoRA gradients, the 128 layers alone
#           and in the 7B model
#   targetsN: the step as docs/PERFORMANCE.md's targets read it: DeepSpeed's ERM against
#           iga_bf16 (the shipped method in bf16), 2 rounds of 16 steps, on N GPUs
#   stepN:  bench_step.py on N GPUs (erm and the fused iga; add iga=reference with STEP_METHODS)
#   tf32stepN: the fused iga with TF32 tensor cores on N GPUs
#   bf16stepN: erm, the fused iga, its bf16 form and the SVD ablation in bf16 on N GPUs
#   rule:   bench_method with the precision rule on the model file or folder in RULE_MODEL
# Each stage has its own time limit so one slow stage cannot eat the others' output.
set -uo pipefail
out=${1:?usage: gpu_runs.sh OUT_DIR [stage...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
methods=${STEP_METHODS:-erm,iga_fused}
steps=${STEP_STEPS:-10}

stage() {  # stage NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -n 40
  echo "=== $name exit ${PIPESTATUS[0]}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.csv"
python3 -c 'import torch, deepspeed, transformers, peft; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'

for s in "$@"; do
  case "$s" in
    checks)
      IGA_DS_RESULTS="$out" stage gpu_tests 560 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
        tests/engine/test_ds_hook_gpu.py tests/methods/test_batched.py tests/lora/test_capture.py \
        tests/bench/test_bench_profile.py tests/methods/test_jacobi.py tests/methods/test_iga_tangent.py \
        tests/methods/test_iga_variance.py tests/train/test_varlen_attention.py tests/train/test_liger_kernel.py \
        tests/lora/test_lora_fused.py tests/train/test_padding_free.py
      stage bench_method 240 python3 bench/bench_method.py --out "$out/bench_method.json"
      ;;
    capture)
      stage bench_capture_lora_only 200 python3 bench/bench_capture.py --device cuda --owns --lora-only \
        --rounds 5 --iters 10
      stage bench_capture 300 python3 bench/bench_capture.py --device cuda --owns
      ;;
    targets*)
      n=${s#targets}
      stage "bench_step_${n}gpu_targets" 560 python3 bench/bench_step.py --gpus "$n" \
        --methods erm,iga_bf16 --rounds 2 --steps 16 --out "$out/bench_step_${n}gpu_targets.json"
      ;;
    rule)
      stage bench_method_rule 420 python3 bench/bench_method.py --model "${RULE_MODEL:?set RULE_MODEL}" \
        --reps "${METHOD_REPS:-10}" --skip-naive --out "$out/bench_method_rule.json"
      ;;
    bf16step*)
      n=${s#bf16step}
      stage "bench_step_${n}gpu_bf16" 560 python3 bench/bench_step.py --gpus "$n" \
        --methods "${BF16_METHODS:-erm,iga_fused,iga_bf16,iga_svd_bf16_q1p16}" --rounds "${STEP_ROUNDS:-2}" \
        --steps "${STEP_STEPS:-8}" --warmup 2 --out "$out/bench_step_${n}gpu_bf16.json"
      ;;
    tf32step*)
      n=${s#tf32step}
      stage "bench_step_${n}gpu_tf32" 420 python3 bench/bench_step.py --gpus "$n" --methods iga_fused \
        --precision tf32 --steps "$steps" --out "$out/bench_step_${n}gpu_tf32.json"
      ;;
    step*)
      n=${s#step}
      stage "bench_step_${n}gpu" 420 python3 bench/bench_step.py --gpus "$n" --methods "$methods" \
        --steps "$steps" --out "$out/bench_step_${n}gpu.json"
      ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
