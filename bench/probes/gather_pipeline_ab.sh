#!/usr/bin/env bash
# The pipelined short-row gather (ops/host_gather_cuda.py PIPELINED) on the device: its cuda tests, the kernel alone
# (bench/probes/row_gather_pipeline.py), then sketch-ahead at CTX under a 24 GiB cap, A/B by bench/ab_patch.py variant.
#   PYTHONPATH=src OUT=dir CTX=128k bash bench/probes/gather_pipeline_ab.sh [VARIANT...]
set -u
OUT=${OUT:-out}; CTX=${CTX:-128k}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels.py -k gather 2>&1 | tail -4 | tee "$OUT/pytest_gather.txt"
    python3 bench/probes/row_gather_pipeline.py --json "$OUT/probe.json" 2>&1 | tee "$OUT/probe.txt" | tail -80
fi
[ $# -gt 0 ] || set -- none gather-pipelined-1 gather-pipelined-1+gather-unroll-2 none
i=0
for v in "$@"; do
    i=$((i + 1))
    python3 bench/ab_patch.py "$v" bench --model llama-3.1-8b --random-weights --ctx "$CTX" --methods tailorkv \
        --select "${SELECT:-sketch-ahead}" --gpu-mem-limit 24GiB --decode-steps 32 --out "$OUT/ab$i-$v" > "$OUT/ab$i-$v.log" 2>&1
    python3 - "$OUT/ab$i-$v" "$v" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.bench.json")):
    for c in json.load(open(f))["cells"]:
        d = c.get("decode_ms") or {}
        print(f"{sys.argv[2]:>40} {c['ctx']:>7} {c['status']:>4} median {d.get('median', float('nan')):7.3f} p90 {d.get('p90', float('nan')):7.3f} ms/token")
PY
done
