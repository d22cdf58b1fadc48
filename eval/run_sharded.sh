#!/usr/bin/env bash
# Runs `tailorkv eval` as N parallel shards on one GPU (batch-1 decode is launch-bound, so processes overlap
# well), then merges. Usage: eval/run_sharded.sh OUT_DIR N LENGTHS [extra eval args...]
set -u
out=$1; n=$2; lengths=$3; shift 3
mkdir -p "$out"
for i in $(seq 0 $((n - 1))); do
  python3 -c "import cli; cli.main()" eval --model smollm2-135m --device cuda --dtype bf16 \
    --methods full,tailorkv,streamingllm,snapkv,quest --lengths "$lengths" --out "$out" --shard "$i/$n" "$@" \
    > "$out/shard-$i.log" 2>&1 &
done
wait
tail -n 2 "$out"/shard-*.log | grep -v "^$" | tail -n 6
python3 -c "import cli; cli.main()" eval-merge "$out"
