# Sourced (from the repository root) by run_h200.sh and run_h200_hybrid.sh: the settings they share
# and `run`, which runs one benchmark bounded by the time left of BUDGET seconds.
#   results_dir NAME   sets RES ($OUT, or benchmarks/results/NAME-<time>) and TABLES (emptied)
#   gpu_line           the "# <UTC time> <GPU name, memory, driver>" header line
#   run NAME MIN_SECONDS ARGS...   `$PY ARGS... --out $RES/NAME.json`, stdout to TABLES, stderr to
#                      $RES/NAME.log; skipped when fewer than MIN_SECONDS are left
#   finish             prints every table and the total time
# No network there: make huggingface_hub fail fast (transformers probes the Hub for flash kernels).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python || command -v python3)}
BUDGET=${BUDGET:-530}
OFFLINE_LIMIT=${OFFLINE_LIMIT:-60}
COMMON=${COMMON:-"--dtype bfloat16 --device cuda"}  # overridable for a CPU dry run of a script
LAT_IN=${LAT_IN:-1024}
LAT_OUT=${LAT_OUT:-128}

results_dir() {
  RES=${OUT:-benchmarks/results/$1-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$RES"
  TABLES="$RES/tables.txt"
  : > "$TABLES"
}

gpu_line() {
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
}

run() {  # run NAME MIN_SECONDS ARGS...: one benchmark, bounded by the time left
  local name=$1 need=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt "$need" ]; then
    echo "## $name: skipped, ${left}s left of the ${BUDGET}s budget (needs ~${need}s)" | tee -a "$TABLES"
    return
  fi
  echo "## $name  (t=${SECONDS}s, ${left}s left)"
  echo "\$ $PY $*" >> "$TABLES"
  local t0=$SECONDS
  timeout -s INT -k 15 "$left" $PY "$@" --out "$RES/$name.json" >> "$TABLES" 2> "$RES/$name.log"
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s; stderr log: $RES/$name.log"
  if [ $rc -ne 0 ]; then
    echo "## $name: exit code $rc (124/130 = stopped by the time budget); last log lines:" | tee -a "$TABLES"
    tail -n 15 "$RES/$name.log" | tee -a "$TABLES"
  fi
  echo >> "$TABLES"
}

finish() {
  echo
  echo "================ all tables (also in $TABLES) ================"
  cat "$TABLES"
  echo "# total ${SECONDS}s"
}
