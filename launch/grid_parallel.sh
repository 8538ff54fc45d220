#!/usr/bin/env bash
# Runs the cells of one experiment grid in parallel processes, then writes its report.
#
#   bash launch/grid_parallel.sh configs/experiments/replication.yaml runs/replication 8
#
# Each cell is exactly what the sequential command runs for it
# (`iga-ds experiment --grid GRID --out OUT --only CELL`), so results do not depend on how many
# run at once. First `--prepare` makes what the cells share (the data; each built-in tiny base,
# pretrained on a GPU when there is one); then the cells run JOBS at a time, one CPU thread
# each, round-robin over the visible GPUs (CPU only when there are none). Logs:
# OUT/logs/CELL.log. Rerun the same line to resume after a kill: finished cells are skipped,
# killed ones rerun. NO_REPORT=1 skips the
# report; IGA_DS_CLI overrides the command (default: iga-ds).
set -euo pipefail
usage="usage: grid_parallel.sh GRID OUT [JOBS]"
grid=${1:?$usage}
out=${2:?$usage}
jobs=${3:-4}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "grid_parallel.sh: JOBS must be a positive integer, got '$jobs'" >&2; exit 2; }
read -r -a cli <<< "${IGA_DS_CLI:-iga-ds}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

pending() {  # unfinished cells, in grid order
  local listing
  # a listing that fails must not read as a finished grid (a missing command lists no cells);
  # called as $(pending), the exit ends the script through set -e
  listing=$("${cli[@]}" experiment --grid "$grid" --out "$out" --dry-run) \
    || { echo "grid_parallel: could not list the cells with '${cli[*]} experiment --dry-run'" \
           "(set IGA_DS_CLI to the command, e.g. 'python -m iga_ds')" >&2; exit 2; }
  awk 'NF >= 4 && $2 != "done" {print $1}' <<< "$listing"
}

run_cells() {  # run the named cells JOBS at a time; returns non-zero if one failed
  ((${#@} > 0)) || return 0
  # shellcheck disable=SC2016  # the script is expanded by the bash that xargs starts
  printf '%s\n' "$@" | awk 'NF {print NR - 1, $1}' | xargs -r -P "$jobs" -L 1 bash -c '
    i=$0 cell=$1
    read -r -a cli <<< "$IGA_DS_CLI_WORDS"
    if ((ngpu > 0)); then export CUDA_VISIBLE_DEVICES=$((i % ngpu)); fi
    if "${cli[@]}" experiment --grid "$grid" --out "$out" --only "$cell" --no-report --no-progress \
        > "$out/logs/$cell.log" 2>&1; then
      echo "grid_parallel: $cell done"
    else
      echo "grid_parallel: $cell FAILED (see $out/logs/$cell.log)" >&2
      exit 1
    fi'
}

listing=$(pending)
todo=()
[[ -z $listing ]] || mapfile -t todo <<< "$listing"
mkdir -p "$out/logs/selection"
echo "grid_parallel: ${#todo[@]} cells to run, $jobs at a time"
if ((${#todo[@]} > 0)); then
  # every core for it: pretraining a base on the CPU is one process's work
  env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "${cli[@]}" experiment --grid "$grid" --out "$out" --prepare \
    --no-progress > "$out/logs/prepare.log" 2>&1 \
    || { tail -n 20 "$out/logs/prepare.log" >&2; exit 1; }
  echo "grid_parallel: data and bases ready"
fi
ngpu=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
export grid out ngpu
export IGA_DS_CLI_WORDS="${cli[*]}"
status=0
# a grid with a selection stage: its candidates first, then the choices (selection.json), then
# the cells, which train at the chosen schedule
selection=()
for cell in "${todo[@]}"; do [[ $cell == selection/* ]] && selection+=("$cell"); done
if ((${#selection[@]} > 0)); then
  run_cells "${selection[@]}" || status=$?
  if ((status == 0)); then
    "${cli[@]}" experiment --grid "$grid" --out "$out" --only 'selection/*' --no-report --no-progress \
      > "$out/logs/selection.log" 2>&1 || status=$?
  fi
  listing=$(pending)
  todo=()
  [[ -z $listing ]] || mapfile -t todo <<< "$listing"
fi
if ((status == 0)); then
  cells=()
  for cell in "${todo[@]}"; do [[ $cell == selection/* ]] || cells+=("$cell"); done
  run_cells "${cells[@]}" || status=$?
fi
left_cells=$(pending)
left=$(grep -c . <<< "$left_cells" || true)
if ((status != 0 || left > 0)); then
  echo "grid_parallel: $left cells unfinished; rerun the same command to resume" >&2
  exit 1
fi
if [[ -z ${NO_REPORT:-} ]]; then
  "${cli[@]}" report "$out"
fi
