#!/usr/bin/env bash
# Nsight Compute over one quant_decode_attention partial call at 128k: the report with source counters (per SASS
# instruction: executions and warp stall samples by reason), its raw metrics, the SASS page and the details page.
# Device only: bash bench/probes/qd_source.sh OUTDIR [bits]
set -uo pipefail
out=$1; bits=${2:-1}
mkdir -p "$out"
ncu --clock-control none -k quant_attn_partial -c 1 -s 2 --import-source no \
    --section WarpStateStats --section SourceCounters --section InstructionStats --section SchedulerStats \
    -o "$out/qd" python3 bench/probes/qd_once.py "$bits" > "$out/ncu.log" 2>&1
ncu -i "$out/qd.ncu-rep" --page raw --csv > "$out/raw.csv" 2>&1
ncu -i "$out/qd.ncu-rep" --page details --print-details all > "$out/details.txt" 2>&1
ncu -i "$out/qd.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1 \
    || ncu -i "$out/qd.ncu-rep" --page source --csv > "$out/sass.csv" 2>&1
ls -la "$out"
