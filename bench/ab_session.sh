#!/usr/bin/env bash
# One device call for A/B runs: the sketch/top-K/row-cache cuda tests (unless SKIP_TESTS), then tailorkv
# sketch-ahead at CTX once per bench/ab_patch.py variant (default: none, reuse-on), each with a profiled stage
# table, printed as one summary per variant.
#   TAILORKV_COMMIT=... OUT=... [AB_ARGS="--sketch-bits 4"] bash bench/ab_session.sh [CTX] [VARIANTS...]
set -u
OUT=${OUT:-out}
CTX=${1:-128k}
shift || true
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_row_cache.py tests/test_sparse.py \
        tests/test_kernels_select.py tests/test_kernels_topk_carry.py > "$OUT/tests.log" 2>&1
    echo "== tests rc=$?"; tail -n 6 "$OUT/tests.log"
fi
for v in "${@:-none reuse-on}"; do
    for one in $v; do
        timeout 150 python3 bench/ab_patch.py "$one" bench --model llama-3.1-8b --random-weights --ctx "$CTX" \
            --methods tailorkv --select sketch-ahead ${AB_ARGS:-} --decode-steps 16 --warmup 4 --profile 2 --out "$OUT/$one" \
            > "$OUT/$one.log" 2>&1
        echo "== $one rc=$?"
        python3 - "$OUT/$one/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["cells"]:
    if c.get("status") != "ok":
        print(c.get("status"), c.get("error")); continue
    st = c.get("stages", {})
    print(f"ctx {c['ctx']}: prefill {c['prefill_s']:.2f} s, {c['decode_ms']['median']:.3f} ms/token (p90 {c['decode_ms']['p90']:.3f}), "
          f"PCIe {c['pcie_bytes_per_token'] / 2**20:.1f} MiB/token, row cache {c.get('row_cache')}, "
          f"peak {c['peak_device_bytes'] / 2**30:.2f} GiB (prefill {c['peak_device_prefill_bytes'] / 2**30:.2f})")
    print(f"   gpu busy {st.get('gpu_busy_ms', 0):.3f}, streams {st.get('stream_busy_ms')}")
    for k, v in (st.get("stage_ms") or {}).items():
        print(f"   {k:28s} {v:.3f}")
PY
        rm -f "$OUT/$one"/*.png
    done
done
