#!/usr/bin/env bash
# Prove the GPU paths on one CUDA GPU in at most 8 minutes, every step under its own time limit.
#
#   tests/gpu_check.sh OUTDIR [--shared DIR]             # run it (on the GPU machine)
#   tests/gpu_check.sh OUTDIR [--shared DIR] --dry-run   # print the steps, check what they need
#   tests/gpu_check.sh OUTDIR --only 1b,4                 # a rerun of some steps (ids as the dry run prints them)
#
# Steps: 1a the CUDA tests (pytest -m cuda), 1b the core suite with CUDA visible, 2 the GPU
# Shakespeare config (configs/shakespeare_char.yaml, compiled) to completion + a full-pass eval,
# 3 scripts/bench.py --suite gpu, 4 torchrun --nproc_per_node 1 with NCCL for DDP and FSDP
# (start, step, checkpoint, resume). OUTDIR gets summary.txt (each step: pass/fail, time, figures)
# and one log per step, 7 files in all; runs and data go to a scratch directory under $TMPDIR.
#
# Offline files (Tiny Shakespeare, tiktoken's GPT-2 cache) come from the first of --shared DIR,
# $QUILL_SHARED, ./shared, ../shared. The device tool copies ./shared with the checkout (never
# ../shared), so before a device run: mkdir -p shared && cp -r ../shared/data ../shared/tiktoken_cache shared/
# (git ignores /shared/). The machine's python3 must hold torch with CUDA; pytest-xdist is used if there.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
TOTAL_S=480  # the whole check, checks included; each step gets min(its limit, what is left); limits sum to 460
OUT="" SHARED="" DRY="" ONLY=""
while (($#)); do
  case $1 in
    --dry-run) DRY=1 ;;
    --shared) SHARED=${2:?--shared needs a directory}; shift ;;
    --only) ONLY=",${2:?--only needs step ids, e.g. 1b,4},"; shift ;;
    -h|--help) sed -n '2,${/^#/!q;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
[[ -n $OUT ]] || { echo "usage: tests/gpu_check.sh OUTDIR [--shared DIR] [--only IDS] [--dry-run]" >&2; exit 2; }
for id in ${ONLY//,/ }; do
  [[ " 1a 1b 2 3 4 " == *" $id "* ]] || { echo "--only: no step $id; the steps are 1a 1b 2 3 4" >&2; exit 2; }
done
[[ $OUT == /* ]] || OUT=$PWD/$OUT  # paths as the caller meant them: the steps run in the checkout's root
[[ -z $SHARED || $SHARED == /* ]] || SHARED=$PWD/$SHARED
if [[ -z $SHARED ]]; then  # --shared is taken as given; else the first that holds the text
  for dir in "${QUILL_SHARED:-}" "$ROOT/shared" "$ROOT/../shared"; do
    [[ -n $dir && -f $dir/data/tinyshakespeare.txt ]] && { SHARED=$(cd "$dir" && pwd); break; }
  done
fi
TEXT=$SHARED/data/tinyshakespeare.txt
cd "$ROOT" || exit 2
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} QUILL_SHARED=$SHARED TIKTOKEN_CACHE_DIR=$SHARED/tiktoken_cache PYTHONUNBUFFERED=1

# --- what the steps need: checked first in both modes ---------------------------------------
# The tests that run there: serve, data and lint need fastapi, rustbpe, zstandard and ruff, which the GPU
# image lacks, and pick no device; test_gpu_check.py checks this script on CPU.
TESTS=(tests --ignore=tests/serve --ignore=tests/data --ignore=tests/test_lint.py --ignore=tests/test_gpu_check.py)
missing=0
need() {  # need WHAT COMMAND...: COMMAND must succeed, else WHAT is reported missing
  local what=$1; shift
  "$@" >/dev/null 2>&1 || { echo "missing: $what" >&2; missing=1; }
}
need "Tiny Shakespeare: data/tinyshakespeare.txt under --shared DIR, \$QUILL_SHARED, ./shared or ../shared" test -f "$TEXT"
need "tiktoken's cache: $SHARED/tiktoken_cache" test -d "$SHARED/tiktoken_cache"
for f in configs/shakespeare_char.yaml scripts/bench.py tests/gpu_check.py tests/conftest.py; do need "$f" test -f "$f"; done
need "the command timeout (coreutils)" command -v timeout
((missing)) && { echo "gpu_check: fix what is missing above first" >&2; exit 2; }  # before the slow checks
need "$PY with torch, numpy, yaml, typer, tqdm, tiktoken and pytest (PYTHON=... picks another)" \
  "$PY" -c "import torch, torch.distributed.run, numpy, yaml, typer, tqdm, tiktoken, pytest"
need "a working python -m quillgpt" "$PY" -m quillgpt --help
need "a working scripts/bench.py" "$PY" scripts/bench.py --help
need "a working tests/gpu_check.py" "$PY" tests/gpu_check.py --help
CUDA_TESTS=$("$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda "${TESTS[@]}" 2>/dev/null | grep -c '::')
need "tests marked cuda (pytest -m cuda collects none)" test "$CUDA_TESTS" -gt 0
[[ -n $DRY ]] || need "a CUDA device (this check is for a GPU machine; --dry-run runs anywhere)" \
  "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"
((missing)) && { echo "gpu_check: fix what is missing above first" >&2; exit 2; }

XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)

WORK=SCRATCH  # made below (mktemp) unless --dry-run
if [[ -z $DRY ]]; then
  mkdir -p "$OUT" || exit 2
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/quill-gpu-check.XXXXXX")
  SUMMARY=$OUT/summary.txt
  {
    echo "QuillGPT GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| device:',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE', '| bf16:', torch.cuda.is_available() and torch.cuda.is_bf16_supported())"
    echo "offline files: $SHARED; scratch: $WORK; $CUDA_TESTS CUDA tests; core suite ${XDIST[*]:-serial}"
  } >"$SUMMARY" 2>&1
  cat "$SUMMARY"
fi

# step LOG LIMIT_S TITLE -- COMMAND...: run COMMAND under min(LIMIT_S, time left), output to
# OUTDIR/LOG; append its result to summary.txt. --dry-run prints it instead. RAN: it ran.
step() {
  local log=$1 limit=$2 title=$3; shift 4
  RAN=""
  [[ -z $ONLY || $ONLY == *",${title%% *},"* ]] || return 0  # not among --only's steps
  if [[ -n $DRY ]]; then printf '%-44s limit %3s s  ' "$title" "$limit"; printf '%q ' "$@"; echo; return 0; fi
  RAN=1
  local left=$((TOTAL_S - SECONDS))  # SECONDS: since the script started
  ((limit > left)) && limit=$left
  if ((limit < 10)); then echo "SKIP  $title: out of time (${TOTAL_S} s in all)" >>"$SUMMARY"; return 1; fi
  local t0=$SECONDS rc
  timeout -s INT -k 20 "$limit" "$@" >"$OUT/$log" 2>&1  # SIGINT: pytest prints its summary, train saves
  rc=$?
  local verdict=PASS
  ((rc == 124 || rc == 137)) && verdict="TIMEOUT (limit ${limit} s)" || { ((rc)) && verdict="FAIL (exit $rc)"; }
  printf '%-7s %s — %d s; log %s\n' "${verdict%% *}" "$title" $((SECONDS - t0)) "$log" >>"$SUMMARY"
  [[ $verdict == PASS ]] || echo "        $verdict" >>"$SUMMARY"
  tail -n 1 "$SUMMARY"
  return $rc
}
# figures LOG: the step's SUMMARY lines (gpu_check.py), else pytest's closing line, into summary.txt
figures() {
  [[ -n $RAN ]] || return 0
  local lines
  lines=$(sed -n 's/^SUMMARY //p' "$OUT/$1")
  [[ -n $lines ]] || lines=$(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$OUT/$1" | tail -n 1)
  [[ -n $lines ]] && sed 's/^/        /' <<<"$lines" | tee -a "$SUMMARY"
}

step cuda_tests.log 60 "1a CUDA tests (pytest -m cuda)" -- "$PY" -m pytest -v -p no:cacheprovider -m cuda "${TESTS[@]}"
figures cuda_tests.log
step core_suite.log 60 "1b core suite, CUDA visible" -- "$PY" -m pytest -v -p no:cacheprovider "${XDIST[@]}" -m "not cuda" "${TESTS[@]}"
figures core_suite.log
step train.log 170 "2 shakespeare_char.yaml, compiled, + eval" -- "$PY" tests/gpu_check.py train "$WORK" --text "$TEXT"
figures train.log
step bench_gpu.log 130 "3 bench.py --suite gpu" -- "$PY" scripts/bench.py --suite gpu --text "$TEXT" --json "$OUT/bench_gpu.json"
[[ -n $RAN ]] && sed -n -e '/^gpu: skipped/p' -e '/^## gpu/,/^$/p' "$OUT/bench_gpu.log" | sed 's/^/        /' | tee -a "$SUMMARY"
step torchrun.log 40 "4 torchrun x1, NCCL: DDP + FSDP resume" -- "$PY" tests/gpu_check.py torchrun "$WORK" --text "$TEXT"
figures torchrun.log

if [[ -n $DRY ]]; then
  echo "dry run: every file and command above is here ($CUDA_TESTS CUDA tests; offline files from $SHARED); nothing ran"
  exit 0
fi
echo "done in $SECONDS s (limit $TOTAL_S s)" | tee -a "$SUMMARY"
! grep -qE '^(FAIL|TIMEOUT|SKIP)' "$SUMMARY"
