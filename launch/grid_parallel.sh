#!/usr/bin/env bash
# Runs the cells of one experiment grid in parallel processes, then writes its report.
#
#   bash launch/grid_parallel.sh configs/experiments/replication.yaml runs/replication 8
#   bash launch/grid_parallel.sh configs/experiments/replication.yaml runs/replication 8 'iga-*' 'erm-*'
#
# Each cell is exactly what the sequential command runs for it
# (`iga-ds experiment --grid GRID --out OUT --only CELL`), so results do not depend on how many
# run at once. First `--prepare` makes what the cells share (the data; each built-in tiny base,
# pretrained on a GPU when there is one); then the cells run JOBS at a time, one CPU thread
# each, round-robin over the visible GPUs (CPU only when there are none), the longest expected
# first (`--dry-run` shows the estimates). In a grid with a selection stage the candidates go
# first, and a row's cells start as soon as its own choice is made. Logs: OUT/logs/CELL.log.
# Rerun the same line to resume after a kill: finished cells are skipped, killed ones rerun. A cell
# that runs out of GPU memory (too many beside it) runs once more, when fewer cells run.
# PATTERNs after JOBS keep the cells whose names match one (and their rows' selection
# candidates), as `--only` does; two runs on one OUT with disjoint patterns share the machine. LAUNCH_FOR=SECONDS starts no cell after that many seconds, so that
# a job with a time limit ends with its cells finished rather than killed. NO_REPORT=1 skips the
# report; IGA_DS_CLI overrides the command (default: iga-ds).
set -euo pipefail
usage="usage: grid_parallel.sh GRID OUT [JOBS [PATTERN...]]"
grid=${1:?$usage}
out=${2:?$usage}
jobs=${3:-4}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "grid_parallel.sh: JOBS must be a positive integer, got '$jobs'" >&2; exit 2; }
only=()
for pattern in "${@:4}"; do only+=(--only "$pattern"); done
launch_for=${LAUNCH_FOR:-}
[[ -z $launch_for || $launch_for =~ ^[0-9]+$ ]] \
  || { echo "grid_parallel.sh: LAUNCH_FOR must be a number of seconds, got '$launch_for'" >&2; exit 2; }
read -r -a cli <<< "${IGA_DS_CLI:-iga-ds}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

listing() {  # the dry run's "CELL STATE ..." lines
  local lines
  # a listing that fails must not read as a finished grid (a missing command lists no cells);
  # called as $(listing), the exit ends the script through set -e
  lines=$("${cli[@]}" experiment --grid "$grid" --out "$out" "${only[@]}" --dry-run --launch-order) \
    || { echo "grid_parallel: could not list the cells with '${cli[*]} experiment --dry-run'" \
           "(set IGA_DS_CLI to the command, e.g. 'python -m iga_ds')" >&2; exit 2; }
  awk 'NF >= 4 {print $1, $2}' <<< "$lines"
}

start_cell() {  # CELL INDEX: one cell in the background, on GPU INDEX mod the GPU count
  local cell=$1 i=$2
  (
    if ((ngpu > 0)); then export CUDA_VISIBLE_DEVICES=$((i % ngpu)); fi
    if "${cli[@]}" experiment --grid "$grid" --out "$out" --only "$cell" --no-report --no-progress \
        > "$out/logs/$cell.log" 2>&1; then
      echo "grid_parallel: $cell done"
    elif ((jobs > 1)) && [[ -z ${retried[$cell]:-} ]] \
        && grep -q -E 'CUDA out of memory|OutOfMemoryError' "$out/logs/$cell.log"; then
      # the processes beside it filled the GPU: the main loop retries it once, with fewer of them
      cp "$out/logs/$cell.log" "$out/logs/$cell.oom.log"
      touch "$out/logs/$cell.oom"
      echo "grid_parallel: $cell ran out of GPU memory; it runs once more with fewer cells beside it" >&2
      exit 3
    else
      echo "grid_parallel: $cell FAILED (see $out/logs/$cell.log)" >&2
      exit 1
    fi
  ) &
  running[$!]=$cell
}

retry_out_of_memory() {  # the cells that ran out of GPU memory may start once more
  local marker cell
  for marker in "$out"/logs/*.oom; do
    [[ -e $marker ]] || continue
    cell=$(basename "$marker" .oom)
    rm -f "$marker"
    retried[$cell]=1
    unset "tried[$cell]"
  done
}

state=$(listing)
left=$(awk '$2 != "done"' <<< "$state" | grep -c . || true)
mkdir -p "$out/logs/selection"
echo "grid_parallel: $left cells to run, $jobs at a time"
if ((left > 0)); then
  # every core for it: pretraining a base on the CPU is one process's work
  env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "${cli[@]}" experiment --grid "$grid" --out "$out" --prepare \
    --no-progress > "$out/logs/prepare.log" 2>&1 \
    || { tail -n 20 "$out/logs/prepare.log" >&2; exit 1; }
  echo "grid_parallel: data and bases ready"
fi
ngpu=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
declare -A running=() tried=() retried=()
status=0 launched=0 chose=0
while ((left > 0)); do
  # ready: not finished, not waiting for a choice, not started by this run (a failed cell is
  # not retried until the next run); the listing's launch order puts selection candidates
  # first, then the longest expected cell (the parallel processes then finish together)
  mapfile -t ready < <(awk '$2 == "todo" || $2 == "partial" {print $1}' <<< "$state")
  for cell in "${ready[@]}"; do
    ((${#running[@]} < jobs)) || break
    [[ -z ${tried[$cell]:-} ]] || continue
    # a retry after running out of GPU memory waits until fewer cells run than when it failed
    if [[ -n ${retried[$cell]:-} ]] && ((${#running[@]} > jobs - 2)); then continue; fi
    if [[ -n $launch_for ]] && ((SECONDS >= launch_for)); then break; fi
    tried[$cell]=1
    start_cell "$cell" "$launched"
    launched=$((launched + 1))
  done
  if ((${#running[@]} == 0)); then
    # rows still waiting with every candidate finished (a selection.json from an earlier version,
    # or written by hand): one more choice releases them. Only without PATTERNs: `--only
    # 'selection/*'` would also run candidates that another run on OUT may be training.
    if ((chose == 0 && ${#only[@]} == 0)) && grep -q ' waiting$' <<< "$state" \
        && ! grep -q '^selection/.* \(todo\|partial\)$' <<< "$state"; then
      chose=1
      "${cli[@]}" experiment --grid "$grid" --out "$out" --only 'selection/*' --no-report --no-progress \
        > "$out/logs/selection.log" 2>&1 || status=1
      state=$(listing)
      continue
    fi
    break
  fi
  ended=0
  wait -n || ended=$?  # one cell ended; 3: out of GPU memory, retried
  ((ended == 0 || ended == 3)) || status=1
  for pid in "${!running[@]}"; do kill -0 "$pid" 2>/dev/null || unset "running[$pid]"; done
  retry_out_of_memory
  state=$(listing)
done
wait || status=1
left=$(awk '$2 != "done"' <<< "$state" | grep -c . || true)
if ((status != 0 || left > 0)); then
  echo "grid_parallel: $left cells unfinished; rerun the same command to resume" >&2
  exit 1
fi
if [[ -z ${NO_REPORT:-} ]]; then
  "${cli[@]}" report "$out"
fi
