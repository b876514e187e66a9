#!/usr/bin/env bash
# Run the whole tokenmill vs llama.cpp suite for both models, then write the suite's summary.md.
#
# Run it on a quiet machine: every figure is a CPU timing on a few threads, and anything else
# running (a test suite, a profiler, a build) changes the numbers (how long it takes: README.md).
#
# Knobs (environment variables):
#   MACHINE         machine kind naming the results folder, e.g. zen5-avx512 (default: local,
#                   which git ignores)
#   BENCH_RESULTS   results folder (default: benchmarks/results/$MACHINE/<short commit>); the JSON
#                   and logs/ there are not committed, summary.md and the serving PNGs are
#   MODELS          catalog aliases or GGUF paths (default: "smollm2-135m-instruct gemma-3-270m")
#   REPS            offline repetitions (default: 3)
#   THREADS         threads for both engines (default: 2)
#   DTYPE           tokenmill dtype (default: auto: bf16 where the CPU multiplies it natively,
#                   else fp32)
#   OFFLINE_ARGS    extra offline.py flags, e.g. "--compile"
#   SERVING_ARGS    extra serving.py flags, e.g. "--concurrency 1,8,32 --prompts-per-concurrency 2"
#   PREFIX_ARGS     extra prefix_cache.py flags
#   FIRST_START_ARGS  extra first_start.py flags
#   SKIP            space-separated parts to skip: offline serving prefix first_start
#   PYTHON          interpreter with tokenmill installed (default: python)
#   LLAMA_CPP_PREFIX        llama.cpp directory whose build/bin holds its tools
#                           (default: ~/.cache/tokenmill-peers/llama.cpp)
#   LLAMA_CPP_BUILD_SCRIPT  script run as `bash SCRIPT PREFIX` to build missing tools (no default:
#                           without it, missing tools are reported with what to set)
set -uo pipefail
cd "$(dirname "$0")/.."

MODELS=${MODELS:-"smollm2-135m-instruct gemma-3-270m"}
REPS=${REPS:-3}
THREADS=${THREADS:-2}
DTYPE=${DTYPE:-auto}
PYTHON=${PYTHON:-python}
SKIP=${SKIP:-}
MACHINE=${MACHINE:-local}
REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export BENCH_RESULTS=${BENCH_RESULTS:-benchmarks/results/$MACHINE/$REV}
RESULTS=$BENCH_RESULTS
mkdir -p "$RESULTS/logs"
echo "results: $RESULTS"

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs (should be well below 1 for clean numbers)"
failed=()

run() {  # run NAME SLUG CMD...: tee the output to $RESULTS/logs, keep going on failure
  local name=$1 slug=$2; shift 2
  local log="$RESULTS/logs/$name-$slug.txt"
  echo
  echo "===== $name: $slug ====="
  echo "+ $*"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 130 ] || [ "$rc" -eq 143 ]; then
    echo "interrupted"; exit "$rc"
  fi
  [ "$rc" -eq 0 ] || failed+=("$name $slug (exit $rc, see $log)")
}

trap 'echo interrupted; exit 130' INT TERM

for model in $MODELS; do
  if [ -f "$model" ]; then  # a GGUF path
    slug=$(basename "$model" .gguf)
  else  # a catalog alias, pulled first
    slug=$model
    "$PYTHON" -c "from tokenmill.catalog import pull; print(pull('$model'))" || { failed+=("pull $model"); continue; }
  fi
  case " $SKIP " in *" offline "*) ;; *)
    # shellcheck disable=SC2086
    run offline "$slug" "$PYTHON" benchmarks/offline.py --model "$model" --reps "$REPS" --threads "$THREADS" \
      --dtype "$DTYPE" ${OFFLINE_ARGS:-} ;;
  esac
  case " $SKIP " in *" serving "*) ;; *)
    # shellcheck disable=SC2086
    run serving "$slug" "$PYTHON" benchmarks/serving.py --model "$model" --threads "$THREADS" --dtype "$DTYPE" \
      ${SERVING_ARGS:-} ;;
  esac
  case " $SKIP " in *" prefix "*) ;; *)
    # shellcheck disable=SC2086
    run prefix_cache "$slug" "$PYTHON" benchmarks/prefix_cache.py --model "$model" --threads "$THREADS" \
      --dtype "$DTYPE" ${PREFIX_ARGS:-} ;;
  esac
  case " $SKIP " in *" first_start "*) ;; *)
    # shellcheck disable=SC2086
    run first_start "$slug" "$PYTHON" benchmarks/first_start.py --model "$model" --threads "$THREADS" \
      --dtype "$DTYPE" ${FIRST_START_ARGS:-} ;;
  esac
done

# the suite's own command, knobs included, for the summary's list of commands
suite="MACHINE=$MACHINE REPS=$REPS THREADS=$THREADS DTYPE=$DTYPE"
for knob in MODELS OFFLINE_ARGS SERVING_ARGS PREFIX_ARGS FIRST_START_ARGS SKIP; do
  value=${!knob:-}
  case $value in
    "") ;;
    *" "*) suite+=" $knob=\"$value\"" ;;
    *) suite+=" $knob=$value" ;;
  esac
done
export BENCH_SUITE_COMMAND="$suite bash benchmarks/run_all.sh"
if "$PYTHON" benchmarks/summarize.py --results "$RESULTS"; then
  echo
  cat "$RESULTS/summary.md"
else
  failed+=("summarize")
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo
  echo "FAILED:"; printf '  %s\n' "${failed[@]}"
  exit 1
fi
