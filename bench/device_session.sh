#!/usr/bin/env bash
# One call on a lent GPU machine: install what the image lacks (wheels carried in .whl/), then run the steps
# named in STEPS, each under its own time limit, logging to $OUT/<step>.log, and print a summary last.
#   TAILORKV_COMMIT=<hash> TAILORKV_DIRTY=0 STEPS="tests kernels fused bench" bash bench/device_session.sh
# (the copy's .git is the session's first commit: results record the commit and the dirty flag named here, the
# flag read from `git status --porcelain --untracked-files=no` before the call)
# Steps: tests (pytest -m cuda), kernels (bench/kernels.py), fused (bench/fused.py), bench (BENCH_ARGS),
# sdpa (bench/sdpa_backends.py), equiv / equiv8b (bench/decode_equivalence.py on SmolLM2 / random 8B),
# chat (bench/chat_scenario.sh: the card's command, two turns at ~120k tokens), truncate
# (bench/probes/quant_truncate_gpu.py: a tailorkv cache cut back by a token against one that never held it).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export TAILORKV_COMMIT=${TAILORKV_COMMIT:-unknown}
# The SmolLM2 GGUF (98 MB) travels in parts, one per call (a call carries 64 MiB with the tree): .ggufK/partNN
# beside .ggufK/count (the number of parts), each copied to /tmp/gguf and joined when the last has arrived
# (bench/split_gguf.sh makes them).
mkdir -p /tmp/gguf
for p in .gguf*/part*; do [ -f "$p" ] && cp "$p" /tmp/gguf/ && cp "$(dirname "$p")/count" /tmp/gguf/count; done
if [ -f /tmp/gguf/count ] && [ ! -f /tmp/gguf/smollm2.gguf ] && \
   [ "$(ls /tmp/gguf/part* | wc -l)" -eq "$(cat /tmp/gguf/count)" ]; then
    cat /tmp/gguf/part* >/tmp/gguf/smollm2.gguf
fi
[ -f /tmp/gguf/smollm2.gguf ] && export TAILORKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf && md5sum /tmp/gguf/smollm2.gguf
summary=()
step() {  # name, limit in s, command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$name: rc=$rc in $((SECONDS - t0)) s")
    echo "== $name rc=$rc ($((SECONDS - t0)) s)"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}
for s in ${STEPS-tests}; do  # STEPS="" (set, empty): only the copies above
    case $s in
        tests) step tests "${TESTS_LIMIT:-360}" python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests/ ;;
        kernels) step kernels "${KERNELS_LIMIT:-200}" python3 bench/kernels.py --out "$OUT/kernels" ;;
        fused) step fused "${FUSED_LIMIT:-120}" python3 bench/fused.py --out "$OUT/fused" ;;
        bench) step bench "${BENCH_LIMIT:-400}" python3 -m tailorkv.cli bench ${BENCH_ARGS:-} --out "$OUT/bench" ;;
        bench2) step bench2 "${BENCH2_LIMIT:-300}" python3 -m tailorkv.cli bench ${BENCH2_ARGS:-} --out "$OUT/bench2" ;;
        bench3) step bench3 "${BENCH3_LIMIT:-300}" python3 -m tailorkv.cli bench ${BENCH3_ARGS:-} --out "$OUT/bench3" ;;
        sdpa) step sdpa "${SDPA_LIMIT:-60}" python3 bench/sdpa_backends.py --out "$OUT/sdpa" ;;
        equiv) step equiv "${EQUIV_LIMIT:-240}" python3 bench/decode_equivalence.py ${EQUIV_ARGS:-} --out "$OUT/equiv" ;;
        equiv8b) step equiv8b "${EQUIV_LIMIT:-240}" python3 bench/decode_equivalence.py --model llama-3.1-8b \
            --random-weights ${EQUIV8B_ARGS:-} --out "$OUT/equiv" ;;
        bisect) step bisect "${BISECT_LIMIT:-400}" bash bench/bisect_kernels.sh ;;
        truncate) step truncate "${TRUNCATE_LIMIT:-120}" python3 bench/probes/quant_truncate_gpu.py ${TRUNCATE_ARGS:-} ;;
        chat) step chat "${CHAT_LIMIT:-300}" env TAILORKV_SMOLLM2_GGUF="${TAILORKV_SMOLLM2_GGUF:-$PWD/.tok/smollm2-tokenizer.gguf}" \
            bash bench/chat_scenario.sh "$OUT/chat" ;;  # random weights borrow SmolLM2's tokenizer (.tok/: bench/tokenizer_gguf.py)
        *) echo "unknown step $s" ;;
    esac
done
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
printf '%s\n' "${summary[@]}"
