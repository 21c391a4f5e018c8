#!/usr/bin/env bash
# One 15-minute GPU lease, as one command: every phase of examples/gpu_session.py --plan $PLAN (default: capture,
# the replayed round's check) under its own time limit (a phase that runs over loses only itself), and the files a
# lease brings back (8 at most) gathered in $OUT.
#
#   bash examples/gpu_lease.sh                # with OUT set; wheels in .whl/ (the tested transformers) are installed first
#   PLAN=lease PHASES="tests kernel" bash examples/gpu_lease.sh
#   PLAN=trained PHASES="tests e2e" E2E_S=400 bash examples/gpu_lease.sh   # a 158M/15M pair trained, then benched
set -u
: "${OUT:?set OUT to the results folder}"
work=/tmp/gpu_session
mkdir -p "$work" "$OUT"
export PYTHONUNBUFFERED=1
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then  # the machine's image may hold another transformers release
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" | tee "$OUT/log.txt"

gather() {  # what comes back: 8 files
    cp "$work"/{tests.txt,kernel.md,kernel.json,steps.md,steps.json} "$OUT"/ 2>/dev/null
    cp "$work/bench_results/results.md" "$OUT/bench.md" 2>/dev/null
    cp "$work/bench_results/results.json" "$OUT/bench.json" 2>/dev/null
}

phase() {  # phase seconds
    local start=$SECONDS
    timeout "$2" python3 examples/gpu_session.py --plan "${PLAN:-capture}" --phase "$1" --out "$work" >>"$OUT/log.txt" 2>&1
    echo "== $1: exit $? after $((SECONDS - start)) s (limit $2 s)" | tee -a "$OUT/log.txt"
    gather
}

limits="tests=${TESTS_S:-150} kernel=${KERNEL_S:-75} steps=${STEPS_S:-180} e2e=${E2E_S:-180}"
for name in ${PHASES:-tests steps e2e}; do
    phase "$name" "$(echo "$limits" | tr ' ' '\n' | sed -n "s/^$name=//p")"
done
tail -n 3 "$work/tests.txt" 2>/dev/null
[ -f "$work/e2e.json" ] && { echo "== e2e.json"; cat "$work/e2e.json"; } >>"$OUT/log.txt"  # a trained pair's facts (9th file)
cat "$work/kernel.md" "$work/steps.md" 2>/dev/null | grep -E "^\| (1024|4096|8192) " | head -40
