#!/usr/bin/env bash
# Run the whole tokenmill vs llama.cpp suite for both models, then regenerate
# benchmarks/results/summary.md (and the summary block of benchmarks/README.md).
#
# Run it on a quiet machine: every figure is a CPU timing on 2 threads, and anything else running
# (a test suite, a profiler, a build) changes the numbers. About 30-60 minutes in all.
#
# Knobs (environment variables):
#   MODELS          models to run (default: "smollm2-135m-instruct gemma-3-270m")
#   REPS            offline repetitions (default: 3)
#   THREADS         threads for both engines (default: 2)
#   DTYPE           tokenmill dtype (default: auto: bf16 where the CPU multiplies it natively, else fp32)
#   OFFLINE_ARGS    extra offline.py flags, e.g. "--dense-min-tokens 64"
#   SERVING_ARGS    extra serving.py flags, e.g. "--concurrency 1,8,32 --prompts-per-concurrency 3"
#   PREFIX_ARGS     extra prefix_cache.py flags
#   SKIP            space-separated parts to skip: offline serving prefix
#   BENCH_RESULTS   results directory (default: benchmarks/results; the README summary is only
#                   updated for the default)
#   PYTHON          interpreter with tokenmill installed (default: python)
#   LLAMA_CPP_PREFIX        llama.cpp checkout+build (default ~/.cache/tokenmill-peers/llama.cpp; built if missing)
#   LLAMA_CPP_BUILD_SCRIPT  its build script (default /work/shared/peers/build-llama-cpp.sh)
set -uo pipefail
cd "$(dirname "$0")/.."

MODELS=${MODELS:-"smollm2-135m-instruct gemma-3-270m"}
REPS=${REPS:-3}
THREADS=${THREADS:-2}
DTYPE=${DTYPE:-auto}
PYTHON=${PYTHON:-python}
SKIP=${SKIP:-}
export BENCH_RESULTS=${BENCH_RESULTS:-benchmarks/results}
RESULTS=$BENCH_RESULTS
mkdir -p "$RESULTS/logs"

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs (should be well below 1 for clean numbers)"
failed=()

run() {  # run NAME MODEL CMD...: tee the output to results/logs, keep going on failure
  local name=$1 model=$2; shift 2
  local log="$RESULTS/logs/$name-$model.txt"
  echo
  echo "===== $name: $model ====="
  echo "+ $*"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 130 ] || [ "$rc" -eq 143 ]; then
    echo "interrupted"; exit "$rc"
  fi
  [ "$rc" -eq 0 ] || failed+=("$name $model (exit $rc, see $log)")
}

trap 'echo interrupted; exit 130' INT TERM

for model in $MODELS; do
  # shellcheck disable=SC2086
  "$PYTHON" -c "from tokenmill.catalog import pull; print(pull('$model'))" || { failed+=("pull $model"); continue; }
  case " $SKIP " in *" offline "*) ;; *)
    # shellcheck disable=SC2086
    run offline "$model" "$PYTHON" benchmarks/offline.py --model "$model" --reps "$REPS" --threads "$THREADS" \
      --dtype "$DTYPE" ${OFFLINE_ARGS:-} ;;
  esac
  case " $SKIP " in *" serving "*) ;; *)
    # shellcheck disable=SC2086
    run serving "$model" "$PYTHON" benchmarks/serving.py --model "$model" --threads "$THREADS" --dtype "$DTYPE" \
      ${SERVING_ARGS:-} ;;
  esac
  case " $SKIP " in *" prefix "*) ;; *)
    # shellcheck disable=SC2086
    run prefix_cache "$model" "$PYTHON" benchmarks/prefix_cache.py --model "$model" --threads "$THREADS" \
      --dtype "$DTYPE" ${PREFIX_ARGS:-} ;;
  esac
done

if [ "$RESULTS" = benchmarks/results ]; then
  "$PYTHON" benchmarks/summarize.py --readme
else
  "$PYTHON" benchmarks/summarize.py  # results elsewhere: leave the README's summary alone
fi
echo
cat "$RESULTS/summary.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo
  echo "FAILED:"; printf '  %s\n' "${failed[@]}"
  exit 1
fi
