#!/usr/bin/env bash
# The model card's own command, end to end, on a GPU: a ~120k-token first turn read from a file (piped to the
# chat), then a short second turn; the transcript with each turn's stats goes to $1/transcript.txt.
#   bash bench/chat_scenario.sh OUTDIR [COPIES]
set -u
out=$1
copies=${2:-7}
mkdir -p "$out"
python3 - "$copies" >/tmp/chat_input.txt <<'PY'
import pathlib, sys
text = (pathlib.Path("engine/evaluation/essays.txt").read_text() + "\n") * int(sys.argv[1])
print("Read this and remember it. " + " ".join(text.split()))   # one line: one chat turn
print("Now answer in five words: what was the text about?")
print("/stats")
print("/exit")
PY
cmd=(python3 -m tailorkv.cli run --model llama-3.1-8b --random-weights --ctx 128k --method tailorkv
     --gpu-mem-limit 24GiB --max-new-tokens 32 --seed 1)
echo "\$ ${cmd[*]} < chat_input.txt  (turn 1: $copies copies of engine/evaluation/essays.txt on one line)" \
    >"$out/transcript.txt"
"${cmd[@]}" </tmp/chat_input.txt >>"$out/transcript.txt" 2>&1
echo "exit status $?" >>"$out/transcript.txt"
