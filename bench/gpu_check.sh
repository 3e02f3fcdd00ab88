#!/usr/bin/env bash
# The GPU path in one shot: the real-model audit of the reference decoders and three planted
# bugs, in float16 and bfloat16, on a config-built 12-layer Llama pair (bench/gpu_model.py),
# then transformers' continuous batching on the same target judged by the paged checks
# (bench/gpu_cb.py), then the cost bench; figures under bench/results/gpu/ and a summary.md
# built from the report.json files (bench/gpu_summary.py). See bench/README.md, "gpu_check.sh".
#
#   bash bench/gpu_check.sh                              # on a CUDA machine, from the repo root
#   bash bench/gpu_check.sh --smoke                      # tiny config on the CPU, results in /tmp (CI)
#   SPECAUDIT_GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh  # the same
#
# Environment: PYTHON (default python3), SPECAUDIT_GPU_CHECK_SECONDS (total budget, default
# 480), SPECAUDIT_GPU_CHECK_JOBS (audits run at once; default 7 on the GPU, 2 in smoke mode),
# SPECAUDIT_GPU_CHECK_RESULTS (results folder), SPECAUDIT_GPU_CHECK_COPY_TO (a folder the
# results are copied into at the end, e.g. "$OUT" on a device machine).
#
# Every step runs under `timeout`, cut to what is left of the budget; a failing or timed-out
# step is recorded in steps.tsv and the script goes on. Exit 0 when every audit run and every
# transformers-cb run came out as expected (references pass, planted bugs fail), 1 otherwise.

set -u
for arg in "$@"; do
  case $arg in
    --smoke) SPECAUDIT_GPU_CHECK_SMOKE=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg (only --smoke)" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

START=$(date +%s)
BUDGET=${SPECAUDIT_GPU_CHECK_SECONDS:-480}
DEADLINE=$((START + BUDGET - 20))  # the last 20 s are the summary's and the copy's
PY=${PYTHON:-python3}
SMOKE=${SPECAUDIT_GPU_CHECK_SMOKE:-0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/specaudit-gpu-check.XXXXXX")
PROMPTS=harness/models/data/prompts.jsonl

if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu
  RESULTS=${SPECAUDIT_GPU_CHECK_RESULTS:-${TMPDIR:-/tmp}/specaudit-gpu-smoke}
  JOBS=${SPECAUDIT_GPU_CHECK_JOBS:-2}
  MODEL_ARGS=(--layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --draft-layers 1 --init-std 0.2 --head-std 0.6)
  AUDIT_ARGS=(--max-prompts 4 --batch-size 4 --max-new-tokens 12)
  AUDIT_CAP=150
  CB_DTYPES=(float32 bfloat16)  # bfloat16 on the CPU: the GPU's half-precision judging, end to end
  CB_CAP=45  # 28 s on two cores under a load of 8, 14 s of it the runs
  COST_RESERVE=90
else
  DEVICE=cuda
  RESULTS=${SPECAUDIT_GPU_CHECK_RESULTS:-bench/results/gpu}
  JOBS=${SPECAUDIT_GPU_CHECK_JOBS:-7}  # the audits are CPU-bound (checks, Python): 16 cores, 2 threads each
  MODEL_ARGS=()  # bench/gpu_model.py's defaults: 12 layers, hidden 768, draft = first 4 layers
  # One batch of the first 8 shipped prompts (one reaches position 1609): 14 audits fit a 15-minute
  # device lease; every prompt (25, four batches) took 146-209 s per audit, 4 at once.
  AUDIT_ARGS=(--max-prompts 8 --batch-size 8 --max-new-tokens 64)
  AUDIT_CAP=200
  CB_DTYPES=(float32 bfloat16 float16)  # float32 first: the one every paged-engine check judges
  CB_CAP=120
  COST_RESERVE=120
fi
DTYPES=(bfloat16 float16)
# In priority order (the audits start in this order, so a slow machine cuts the last ones):
DECODERS=(
  specaudit.reference.eqspec:EqSpec
  specaudit.reference.mutants:positions_in_model_dtype      # position-id: rounds' positions rounded in bfloat16
  specaudit.reference.mutants:cache_rows_permuted           # kv-drift: caches re-ordered, bookkeeping not
  specaudit.reference.batched:BatchedGreedy                 # the batched non-speculative control
  specaudit.reference.mutants:kv_cropped_to_min_acceptance  # kv-drift (DSD): one crop for the whole batch
  specaudit.reference.exspec:ExSpec
  specaudit.reference.lazy:LazySpec
)

CORES=$(nproc 2>/dev/null || echo 4)
THREADS=$((CORES / JOBS > 0 ? CORES / JOBS : 1))
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
export SPECAUDIT_CACHE="$WORK/cache"  # noise floors and the like, never the user's cache
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

rm -rf "$RESULTS/audit" "$RESULTS/cb" "$RESULTS/cost" "$RESULTS/steps.tsv" "$RESULTS/summary.md"
mkdir -p "$RESULTS/audit" || exit 2
printf 'step\texit\tseconds\ttimeout\n' > "$RESULTS/steps.tsv"

say() { echo "[gpu_check +$(($(date +%s) - START))s] $*"; }

# Seconds a step may take: at most CAP, and never past the deadline less RESERVE.
limit() {
  local cap=$1 reserve=$2 left
  left=$((DEADLINE - $(date +%s) - reserve))
  if [ "$left" -lt "$cap" ]; then echo "$left"; else echo "$cap"; fi
}

# step NAME LIMIT LOG CMD...: CMD under `timeout LIMIT` (then SIGKILL 5 s later), output in
# LOG, the exit status and seconds in steps.tsv. A step with under 10 s left is skipped.
step() {
  local name=$1 max=$2 log=$3 t0 rc
  shift 3
  if [ "$max" -lt 10 ]; then
    printf '%s\t-\t0\t%s\n' "$name" "$max" >> "$RESULTS/steps.tsv"
    say "skip $name: no time left"
    return 0
  fi
  say "start $name (timeout ${max}s)"
  t0=$(date +%s)
  timeout -k 5 "$max" "$@" > "$log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$max" >> "$RESULTS/steps.tsv"
  say "done $name: exit $rc in $(($(date +%s) - t0))s: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-160)"
}

# --- 1. environment: specaudit importable (installed, else an editable install, else a shim) ---
ensure_specaudit() {
  if "$PY" -c "import specaudit.reference.eqspec" 2>/dev/null; then
    echo "specaudit: already importable"
    return 0
  fi
  timeout 120 "$PY" -m pip install -q -e . --no-deps --no-build-isolation && \
    "$PY" -c "import specaudit.reference.eqspec" && { echo "specaudit: pip install -e ."; return 0; }
  # The shim: a `specaudit` folder of links to harness/*, plus its three subpackage folders.
  mkdir -p "$WORK/shim/specaudit"
  for entry in "$ROOT"/harness/*; do ln -sfn "$entry" "$WORK/shim/specaudit/"; done
  for sub in reference fixtures properties; do ln -sfn "$ROOT/$sub" "$WORK/shim/specaudit/$sub"; done
  echo "specaudit: PYTHONPATH shim at $WORK/shim"
}
say "results in $RESULTS; work in $WORK; device $DEVICE; budget ${BUDGET}s; $JOBS audits at once"
ensure_specaudit > "$RESULTS/setup.log" 2>&1
if [ -d "$WORK/shim" ]; then export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"; fi
say "$(tail -n 1 "$RESULTS/setup.log")"
{
  date -u
  if command -v nvidia-smi > /dev/null; then
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  timeout 60 "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.device_count())"
} > "$RESULTS/env.log" 2>&1
say "$(tr '\n' ' ' < "$RESULTS/env.log" | cut -c1-200)"

# Decoders that this checkout has (LazySpec may not exist), in one Python start.
mapfile -t DECODERS < <(timeout 120 "$PY" -c "
import importlib, sys
for spec in sys.argv[1:]:
    module, _, attr = spec.partition(':')
    try:
        getattr(importlib.import_module(module), attr)
        print(spec)
    except (ImportError, AttributeError) as exc:
        print(f'skipping {spec}: {exc}', file=sys.stderr)
" "${DECODERS[@]}" 2>> "$RESULTS/setup.log")
say "${#DECODERS[@]} decoders: ${DECODERS[*]+${DECODERS[*]##*:}}"

# --- 2. the model pair: 12-layer Llama target, 4-layer layer-skip draft, char tokenizer ---
step model "$(limit 120 "$COST_RESERVE")" "$RESULTS/model.log" "$PY" bench/gpu_model.py "$WORK/model" ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"}
if [ ! -f "$WORK/model/target/config.json" ] || [ ! -f "$WORK/model/draft/config.json" ]; then
  say "no model pair was built: see $RESULTS/model.log; skipping the audits"
  DECODERS=()
fi

# --- 3. the audits: every decoder x dtype, JOBS at a time, each in its own process ---
AUDIT_END=$((DEADLINE - COST_RESERVE - CB_CAP))  # what is left after them: the cb step, then the cost bench
audit() {  # audit DTYPE SPEC
  local dtype=$1 spec=$2 name=${2##*:} max
  max=$(limit "$AUDIT_CAP" $((DEADLINE - AUDIT_END)))
  mkdir -p "$RESULTS/audit/$dtype"
  step "audit/$dtype/$name" "$max" "$RESULTS/audit/$dtype/$name.log" \
    "$PY" -m specaudit audit --target "$WORK/model/target" --draft "$WORK/model/draft" --prompts "$PROMPTS" \
    --device "$DEVICE" --dtype "$dtype" --decoder "$spec" --check-rate 0.25 "${AUDIT_ARGS[@]}" \
    --timeout "$((max > 10 ? max : 10))" --out "$RESULTS/audit/$dtype/$name"
}
# The first decoder's audits measure each dtype's noise floor into the shared cache; the others
# start once it is there (or after 150 s), so no two processes measure the same floor.
floors() { find "$SPECAUDIT_CACHE" -name 'noise-*.json' 2>/dev/null | wc -l; }
first=1
for spec in ${DECODERS[@]+"${DECODERS[@]}"}; do
  for dtype in "${DTYPES[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    audit "$dtype" "$spec" &
    sleep 1  # staggered starts: imports and model loads do not all land at once
  done
  if [ "$first" = 1 ]; then
    first=0
    for _ in $(seq 150); do [ "$(floors)" -ge "${#DTYPES[@]}" ] && break; sleep 1; done
    say "$(floors) noise floor(s) cached; starting the other audits"
  fi
done
wait

# --- 4. transformers' continuous batching on the target, judged by the paged checks ---
mkdir -p "$RESULTS/cb"
CB_ARGS=()
for dtype in "${CB_DTYPES[@]}"; do CB_ARGS+=(--dtype "$dtype"); done
step cb "$(limit "$CB_CAP" "$COST_RESERVE")" "$RESULTS/cb/cb.log" \
  "$PY" bench/gpu_cb.py --model "$WORK/model/target" --device "$DEVICE" "${CB_ARGS[@]}" --out "$RESULTS/cb"

# --- 5. the cost bench on the same device ---
mkdir -p "$RESULTS/cost"
step cost "$(limit 240 0)" "$RESULTS/cost/cost.log" "$PY" bench/cost.py --quick --device "$DEVICE" --out "$RESULTS/cost"

# --- 6. greedy margins and draft agreement of the pair (float32, CPU), if time is left ---
if [ -f "$WORK/model/target/config.json" ]; then
  step model-stats "$(limit 60 0)" "$RESULTS/model-stats.log" "$PY" bench/gpu_model.py "$WORK/model" --stats-only
  grep '^gpu_model stats' "$RESULTS/model-stats.log" >> "$RESULTS/model.log" 2>/dev/null
fi

# --- 7. summary.md from the report.json files ---
LEFT=$((START + BUDGET - $(date +%s) - 3))
timeout "$((LEFT > 5 ? LEFT : 5))" "$PY" bench/gpu_summary.py "$RESULTS" > "$RESULTS/summary.log" 2>&1
STATUS=$?
cat "$RESULTS/summary.log"
rm -rf "$WORK"
if [ -n "${SPECAUDIT_GPU_CHECK_COPY_TO:-}" ]; then
  # One archive and the summary: a device machine returns few files, none deep in folders.
  mkdir -p "$SPECAUDIT_GPU_CHECK_COPY_TO" && \
    tar -czf "$SPECAUDIT_GPU_CHECK_COPY_TO/gpu-results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" && \
    cp "$RESULTS/summary.md" "$SPECAUDIT_GPU_CHECK_COPY_TO/" 2>/dev/null
fi
say "finished in $(($(date +%s) - START))s (budget ${BUDGET}s); summary: $RESULTS/summary.md; exit $STATUS"
exit "$STATUS"
