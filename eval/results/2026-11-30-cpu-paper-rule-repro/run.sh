#!/bin/bash
COMMON="--model smollm2-135m --device cpu --dtype fp32 --methods full,tailorkv --lengths 2k,4k --samples 3 --tasks passkey,niah_single,variable_tracking --budget-frac 0.03 --bits 2 --fidelity-tokens 0"
cd OLD_WORKTREE_AT_9fc5f0d && /usr/bin/time -f "old wall %e s" env PYTHONPATH=. python3 cli.py eval $COMMON --out OUT/old > OUT/old.log 2>&1
cd REPO && /usr/bin/time -f "new wall %e s" env PYTHONPATH=src python3 -m tailorkv.cli eval $COMMON --protocol legacy --question both --select-rule paper --channel-rule paper --own-query-below 0 --out OUT/new > OUT/new.log 2>&1
echo done > OUT/DONE
