#!/usr/bin/env bash
# A/B of ChannelSelector.PREFETCH_ROWS on a lent GPU (run after bench/device_session.sh has installed the wheels
# and joined the SmolLM2 GGUF): tailorkv's paper path as is ("none") and with the predicted query's top-K rows read
# ahead ("prefetch-rows"), on SmolLM2's real weights at 8k and on random Llama-3.1-8B weights under a 24 GiB cap,
# the variants alternated. Logs and bench.json files under $OUT/ab-*.
set -u
OUT=${OUT:-out}
export PYTHONUNBUFFERED=1 PYTHONPATH=src:/tmp/site
[ -f /tmp/gguf/smollm2.gguf ] && export TAILORKV_SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf
run() {  # name, variant, bench args...
    local name=$1 variant=$2
    shift 2
    timeout "${AB_LIMIT:-150}" python3 bench/ab_patch.py "$variant" bench "$@" --out "$OUT/ab-$name-$variant" \
        >"$OUT/ab-$name-$variant.log" 2>&1
    echo "== $name $variant rc=$?"
    grep -E "^\[[0-9]+/[0-9]+\]|decode_reference|error" "$OUT/ab-$name-$variant.log" | tail -4
}
for v in ${SMOL_VARIANTS:-none prefetch-rows none prefetch-rows}; do
    run smol "$v" --model smollm2-135m --ctx 8k --methods tailorkv --decode-steps 32
done
for v in ${L8_VARIANTS:-none prefetch-rows}; do
    run l8 "$v" --model llama-3.1-8b --random-weights --ctx ${L8_CTX:-8k,32k,128k} --methods tailorkv \
        --gpu-mem-limit 24GiB --decode-steps 32
done
