#!/bin/bash
# As run on 2026-11-30 (comments added after): the code is a `git archive 9d74255 | tar -x -C /tmp/nf/code` export,
# the venv /work/main/.venv (torch 2.13.0+cpu), 2 CPU threads; then compare.py over /tmp/nf/out (see README.md).
# runs from a clean export of commit 9d74255 (git archive), so edits in the worktree cannot leak in
cd /tmp/nf/code
S=eval/results/2026-11-30-cpu-fidelity-1024-8k/fidelity_variants.py
OUT=/tmp/nf/out
for spec in "bf16 tailorkv_bf16" "fp32 tailorkv_fp32"; do
  set -- $spec
  echo "== $(date -u +%FT%TZ) start $1 $2"
  /usr/bin/time -v env PYTHONPATH=src /work/main/.venv/bin/python $S --dtype $1 --name $2 --out $OUT > /tmp/nf/$2.log 2>&1
  echo "== $(date -u +%FT%TZ) done $1 $2 rc=$?"
done
