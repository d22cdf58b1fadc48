#!/usr/bin/env bash
# Which kernel breaks a CUDA test: each case in its own process (a device fault poisons the process), kernels
# launched synchronously so the fault lands on the culprit's call. Prints one line per case.
#   bash bench/bisect_kernels.sh
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} CUDA_LAUNCH_BLOCKING=1 PYTHONUNBUFFERED=1
run() {  # label, TAILORKV_KERNELS_OFF, pytest args...
    local label=$1 off=$2
    shift 2
    local out
    out=$(TAILORKV_KERNELS_OFF=$off timeout 120 python3 -m pytest -q -x -p no:cacheprovider "$@" 2>&1)
    echo "== $label (off: ${off:-none}): $(echo "$out" | tail -n 1)"
    echo "$out" | grep -m 3 -E "^E .*(Error|error)|^src/.*Error|cuda_launch|_cuda.py:[0-9]+" | cut -c1-200
}
run "select kernels" "" tests/test_kernels_select.py
run "attention kernels" "" tests/test_kernels_attention.py
run "quant kernels" "" tests/test_kernels_quant.py
run "fused + host copy + gather" "" tests/test_fused.py tests/test_host_copy.py tests/test_kernels.py
run "tailorkv graph, all kernels" "" tests/test_decode_paths.py -k tailorkv
run "tailorkv graph, topk off" "topk_tokens" tests/test_decode_paths.py -k tailorkv
run "tailorkv graph, sparse attention off" "sparse_decode_attention" tests/test_decode_paths.py -k tailorkv
run "tailorkv graph, topk + sparse off" "topk_tokens,sparse_decode_attention" tests/test_decode_paths.py -k tailorkv
run "full graph, attend off" "attend_decode" tests/test_decode_paths.py -k "full or decode_equals"
