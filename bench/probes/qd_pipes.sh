#!/usr/bin/env bash
# Nsight Compute over one quant_decode_attention partial call at 128k (1 bit): instructions per pipe, each pipe's
# share of its peak, issue activity and warp cycles per issued instruction (WarpStateStats' summary; it gives no
# per-reason breakdown). Device only: bash bench/probes/qd_pipes.sh [bits] > out.txt
set -euo pipefail
bits=${1:-1}
names=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}' \
        | grep -E '^(smsp__inst_executed_pipe_[a-z0-9_]+|sm__pipe_[a-z0-9_]+_cycles_active|sm__inst_executed_pipe_[a-z0-9_]+)$' || true)
metrics="smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum"
for n in $names; do
    case $n in
        smsp__inst_executed_pipe_*) metrics+=",$n.sum" ;;
        *) metrics+=",$n.avg.pct_of_peak_sustained_active" ;;
    esac
done
ncu --clock-control none -k quant_attn_partial -c 1 -s 2 --metrics "$metrics" \
    --section WarpStateStats python3 bench/probes/qd_once.py "$bits"
