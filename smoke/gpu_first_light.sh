#!/usr/bin/env bash
# First light: the first run of a patched build on a GPU host, from the kit (docs/gpu-smoke.md),
# and its plans at the shapes users run (docs/gpu-shapes.md).
#
#   bash smoke/gpu_first_light.sh --out DIR [--plan first-light|shapes|served] [--budget S] [--steps a,b]
#   bash smoke/gpu_first_light.sh --cpu --python PY --root-wheel VLLM_CPU_WHEEL --out DIR   (dry run)
#   bash smoke/gpu_first_light.sh --cpu --no-kit --python PY --plan shapes --out DIR   (PY holds vLLM)
#
# Installs the kit (.kit/p1 ... pN) into a folder, runs the selfcheck and `info`, then, with CUDA
# graphs on and async scheduling at vLLM's default, each step of the plan (smoke/first_light.py)
# with its own timeout, in priority order: steps of a group side by side on the one GPU (each
# engine with a share of its memory), the others alone. A step that no longer fits the budget
# is skipped and says so. Results are appended as they come (WORK/results/), and OUT gets at
# most 8 files of at most 16 MiB: summary.json, summary.txt, logs.tar.gz, artifacts.tar.gz.
# The summary table is printed last; exit 1 if a step failed. `--no-kit`: PY already holds the
# patched vLLM (an engine venv): no install. `--nemotron-layers N`: NemotronH's first N layers.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SMOKE="$ROOT/smoke"
PY=python3
KIT="$ROOT/.kit"
BASE=/tmp/kvwarm-first-light
DEVICE=cuda
OUT=""
BUDGET=""
PLAN=first-light
STEPS=""
ROOT_WHEEL=""
SERIAL=0
NO_KIT=0
LAYERS=()

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --cpu) DEVICE=cpu; shift ;;
    --python) PY=$2; shift 2 ;;
    --kit) KIT=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --root-wheel) ROOT_WHEEL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --serial) SERIAL=1; shift ;;
    --plan) PLAN=$2; shift 2 ;;
    --no-kit) NO_KIT=1; shift ;;
    --nemotron-layers) LAYERS=(--nemotron-layers "$2"); shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "gpu_first_light.sh: unknown argument $1" >&2; usage 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "gpu_first_light.sh: --out DIR is required (on the device: --out \$OUT/fl)" >&2; exit 2; }
# Each plan's steps and its budget on the GPU host (docs/gpu-shapes.md says how they were sized).
case "$PLAN" in
  first-light) PLAN_STEPS="install,info,models,generate,sweep,shadows,hybrid,fidelity,served"; PLAN_BUDGET=450 ;;
  shapes) PLAN_STEPS="install,info,models,nemotron-exact,shadows,nemotron-inplace,fidelity,nemotron-copy,mla"
    PLAN_BUDGET=540 ;;
  served) PLAN_STEPS="install,models,served-moe"; PLAN_BUDGET=560 ;;
  *) echo "gpu_first_light.sh: --plan $PLAN: the plans are first-light, shapes, served" >&2; exit 2 ;;
esac
STEPS=${STEPS:-$PLAN_STEPS}
# The CPU engine is slow and shares two cores: one engine at a time, no budget to speak of.
# Its timeouts are the GPU's times SCALE.
if [ "$DEVICE" = cpu ]; then SERIAL=1; SCALE=8; BUDGET=${BUDGET:-18000}; else SCALE=1; BUDGET=${BUDGET:-$PLAN_BUDGET}; fi
SITE="$BASE/site"
WORK="$BASE/work"
START=$(date +%s)
rm -rf "$WORK" && mkdir -p "$WORK/logs" "$WORK/results" "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

say() { echo "[first light $(($(date +%s) - START))s] $*"; }
wanted() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
record() { "$PY" "$SMOKE/first_light_report.py" record --work "$WORK" "$@"; }

# run_step NAME TIMEOUT CMD...: CMD under its timeout (cut to the budget left), its output in
# WORK/logs/NAME.log; a step that writes no result of its own gets one here.
run_step() {
  local name=$1 limit=$(($2 * SCALE)); shift 2
  wanted "$name" || return 0
  local left=$((BUDGET - ($(date +%s) - START) - 20))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    record "$name" skip "not started: ${left}s of the ${BUDGET}s budget left"
    say "$name: skipped (budget)"; return 0
  fi
  say "$name: started (timeout ${limit}s)"
  local began=$(date +%s) rc
  timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$WORK/logs/$name.log" 2>&1
  rc=$?
  local took=$(($(date +%s) - began))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    record "$name" timeout "killed at its ${limit}s timeout" --seconds "$took"
  elif [ "$rc" != 0 ]; then
    record "$name" fail "exit $rc (see logs/$name.log)" --seconds "$took"
  else
    record "$name" pass "$(tail -n 1 "$WORK/logs/$name.log" | cut -c1-160)" --seconds "$took"
  fi
  say "$name: ended (exit $rc, ${took}s)"
}

STEP=("$PY" "$SMOKE/first_light.py" --work "$WORK" --device "$DEVICE" --site "$SITE" "${LAYERS[@]}")

# run_group NAME:TIMEOUT ...: side by side on the GPU, one after another on the CPU.
run_group() {
  local entry name limit
  for entry in "$@"; do
    name=${entry%%:*}; limit=${entry##*:}
    if [ "$SERIAL" = 1 ]; then run_step "$name" "$limit" "${STEP[@]}" "$name"; else run_step "$name" "$limit" "${STEP[@]}" "$name" & fi
  done
  wait
}

finish() {
  say "packing $OUT"
  "$PY" "$SMOKE/first_light_report.py" pack --work "$WORK" --out "$OUT"
  "$PY" "$SMOKE/first_light_report.py" summary --work "$WORK" --out "$OUT" --steps "$STEPS"
  exit $?
}

if [ "$DEVICE" = cuda ]; then
  nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1 || { say "no nvidia-smi: use --cpu for the dry run"; exit 2; }
fi

# The kit, installed (or found installed: a rerun skips the install), then its environment.
if [ "$NO_KIT" = 1 ]; then
  wanted install && record install skip "--no-kit: $PY holds the patched vLLM"
  mkdir -p "$SITE" && : >"$SITE/kit.env"
else
  install_args=(--target "$SITE" --work "$BASE")
  [ -n "$ROOT_WHEEL" ] && install_args+=(--root-wheel "$ROOT_WHEEL")
  run_step install 300 "$PY" "$KIT/p1/install.py" "${install_args[@]}"
  cp "$KIT/p1/manifest.json" "$WORK/kit-manifest.json" 2>/dev/null
fi
if [ ! -f "$SITE/kit.env" ]; then say "the kit is not installed: nothing else can run"; finish; fi
# shellcheck disable=SC1091
source "$SITE/kit.env"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT/tests/support"
if [ "$DEVICE" = cpu ] && [ -n "$ROOT_WHEEL" ]; then
  # vLLM reads version("vllm") for its platform and CLI: vllm-cpu needs the alias the cpu image has.
  "$PY" "$ROOT/images/vllm_dist_alias.py" vllm_cpu >>"$WORK/logs/install.log" 2>&1
fi

run_step info 120 "${STEP[@]}" info
run_step models 180 "${STEP[@]}" models

case "$PLAN" in
  first-light)
    run_group generate:300 sweep:300 shadows:300 hybrid:360  # the correctness steps
    [ "$DEVICE" = cuda ] && nvidia-smi >>"$WORK/nvidia-smi.txt" 2>&1
    run_step fidelity 300 "${STEP[@]}" fidelity  # the timing step: alone on the GPU
    run_step served 540 "${STEP[@]}" served
    ;;
  shapes)
    # NemotronH's first boot (compile, capture) overlaps the two fixed checks and the in-place refusal
    run_group nemotron-exact:420 shadows:300 nemotron-inplace:240 fidelity:240
    [ "$DEVICE" = cuda ] && nvidia-smi >>"$WORK/nvidia-smi.txt" 2>&1
    run_step nemotron-copy 300 "${STEP[@]}" nemotron-copy  # alone: its rows' times are the clean ones
    run_step mla 300 "${STEP[@]}" mla
    ;;
  served)
    run_step served-moe 580 "${STEP[@]}" served-moe
    ;;
esac
[ "$DEVICE" = cuda ] && nvidia-smi >>"$WORK/nvidia-smi.txt" 2>&1
finish
