#!/usr/bin/env bash
# The serving measurements of issue 63, for a quiet machine (nothing else running): each writes its output and the
# command that made it into a folder of examples/results/, ready to commit and cite (<!-- figures: PATH -->).
#   bash examples/serve_measure.sh            # all five, about an hour on the 2-core CPU
#   bash examples/serve_measure.sh soak       # any of: demo, demo-unguarded, smollm2, overload, soak
# demo-unguarded is the demo pair's run with --no-latency-guard, to weigh the guard against the batch's goodput alone.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1

run() {  # run FOLDER COMMAND...: the command's output into examples/results/FOLDER/output.txt, beside command.txt
  local folder="examples/results/$1"; shift
  mkdir -p "$folder"
  echo "OMP_NUM_THREADS=1 $*   # $(nproc --all)-core CPU, nothing else running, $(date -u +%F)" > "$folder/command.txt"
  "$@" 2>&1 | grep -v -e '^INFO:' -e 'Loading weights' -e 'Writing model shards' | tee "$folder/output.txt"
}

for WHICH in demo demo-unguarded smollm2 overload soak; do
  if [ $# -gt 0 ] && [[ " $* " != *" $WHICH "* ]]; then continue; fi
  case $WHICH in
    demo) run cpu-serve-load-demo python examples/serve_latency.py --target-cb --swiftspec-cb --clients 1,2,4,8,16,32 ;;
    demo-unguarded) run cpu-serve-load-demo-unguarded python examples/serve_latency.py --target-cb --swiftspec-cb \
                      --clients 1,2,4,8,16,32 --no-latency-guard ;;
    smollm2) run cpu-serve-load-smollm2-135m python examples/serve_latency.py --target-cb --swiftspec-cb \
               --clients 1,2,4,8,16,32 --pair shape:smollm2-135m ;;
    overload) run cpu-serve-overload python examples/serve_soak.py --requests 400 --clients 32 --max-queue 8 \
                --cache-positions 1400 --retries 50 ;;
    soak) run cpu-serve-soak-64 python examples/serve_soak.py --requests 1200 --clients 64 --max-seconds 1800 \
            --suffix-cache-tokens 4096 ;;
  esac
done
