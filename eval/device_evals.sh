#!/usr/bin/env bash
# One call on a lent GPU machine: the SmolLM2 evals of the accuracy issue, each under its own time limit, in
# /tmp/ev (kept between calls while the machine stays warm; every shard runs with --resume, so the same call
# again finishes what is left), then one tarball of the finished folders in $OUT.
#   EVALS="pct3 p1024 curve" SHARDS=28 bash eval/device_evals.sh
# The SmolLM2 GGUF travels in parts, one per call (bench/split_gguf.sh, bench/device_session.sh):
# TAILORKV_SMOLLM2_GGUF must name it. kt16 / kt8: full and tailorkv with the K^T host store at 16 / 8 bits.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT" /tmp/ev
n=${SHARDS:-28}
common=(--split paper --bits 2)
for e in ${EVALS:-pct3 p1024 curve}; do
    t0=$SECONDS
    case $e in
        pct3) TIME_LIMIT=${PCT3_LIMIT:-300} MPS=1 bash eval/run_sharded.sh /tmp/ev/pct3 "$n" 2k,4k,8k --samples 20 \
                  --budgets 3% "${common[@]}" --fidelity-tokens 64 ;;
        p1024) TIME_LIMIT=${P1024_LIMIT:-120} MPS=1 bash eval/run_sharded.sh /tmp/ev/p1024 "$n" 8k --samples 20 \
                  --budgets 1024 --bits 2 --fidelity-tokens 128 ;;
        curve) TIME_LIMIT=${CURVE_LIMIT:-140} MPS=1 bash eval/run_sharded.sh /tmp/ev/curve "$n" 4k \
                  --samples "${CURVE_SAMPLES:-6}" --budgets 1%,3%,6%,12%,25% "${common[@]}" --fidelity-tokens 0 ;;
        paper) TIME_LIMIT=${PAPER_LIMIT:-150} MPS=1 METHODS=full,tailorkv bash eval/run_sharded.sh /tmp/ev/paper "$n" \
                  2k,4k,8k --samples 10 --budgets 3% --split paper --bits 2 --fidelity-tokens 64 \
                  --select-rule paper ;;
        kt16|kt8) TIME_LIMIT=${KT_LIMIT:-200} MPS=1 METHODS=full,tailorkv bash eval/run_sharded.sh "/tmp/ev/$e" "$n" \
                  8k --samples 20 --budgets 1024 --bits 2 --fidelity-tokens 128 --kt-bits "${e#kt}" ;;
        *) echo "unknown eval $e"; continue ;;
    esac > "/tmp/ev/$e.log" 2>&1
    echo "== $e: $((SECONDS - t0)) s"
    tail -n 12 "/tmp/ev/$e.log"
done
tar -C /tmp/ev -czf "$OUT/evals.tgz" . && ls -la "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
