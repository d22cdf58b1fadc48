"""Variants of quant_decode.cu's partial kernel side by side: each checked against the torch reference on fresh
inputs (1 and 2 bits, three shapes) and timed at 128k (Llama-3.1-8B shape), the variants interleaved over three
rounds (best of them printed). A variant is `skip-keys`, `skip-values`, `skip-both` (the kernel without its key or
value products, or both: timing only, wrong results), `base` (the repo's), or LABEL=PATH (another quant_decode.cu);
any of them may end in @TPW/MINB: that many tokens per warp and resident blocks per SM (the launcher's
TOKENS_PER_WARP and BLOCKS_PER_SM for 1 and 2 bits), e.g. `base@448/5`.
Device only: PYTHONPATH=src python3 bench/probes/qd_ab.py OUT.json VARIANT..."""
import json
import os
import sys

import torch

sys.path.insert(0, "bench")
from kernels import DEV, HBM, QATTN_SHAPES, decode_state, gpu_time, max_rel, qattn_128k  # noqa: E402

from tailorkv.ops import quant_decode_cuda  # noqa: E402
from tailorkv.ops.quant_attention import quant_decode_attention as qda  # noqa: E402

SKIPS = {"base": "", "skip-keys": "#define QD_SKIP_KEYS\n", "skip-values": "#define QD_SKIP_VALUES\n",
         "skip-both": "#define QD_SKIP_KEYS\n#define QD_SKIP_VALUES\n"}
out_path, names = sys.argv[1], sys.argv[2:]
base_source = quant_decode_cuda.source
with open(os.path.join(os.path.dirname(quant_decode_cuda.__file__), "quant_decode.cu")) as f:
    repo_text = f.read()


def variant(label):
    """load() compiles per shape at a first call: the variant's source and split are set around every call."""
    name, _, split = label.partition("@")
    tpw, minb = (int(x) for x in split.split("/")) if split else (quant_decode_cuda.TOKENS_PER_WARP, None)
    if "=" in name:
        with open(name.split("=", 1)[1]) as f:
            alt = f.read()
        make = lambda *a, **k: base_source(*a, **k).replace(repo_text, alt)  # noqa: E731
    else:
        make = lambda *a, **k: SKIPS[name] + base_source(*a, **k)  # noqa: E731
    fn = quant_decode_cuda.load(qda.reference)

    base_tpw, base_minb = quant_decode_cuda.TOKENS_PER_WARP, dict(quant_decode_cuda.BLOCKS_PER_SM)

    def call(*args):
        quant_decode_cuda.source = make
        quant_decode_cuda.TOKENS_PER_WARP = tpw
        if minb is not None:
            quant_decode_cuda.BLOCKS_PER_SM = {1: minb, 2: minb}
        try:
            return fn(*args)
        finally:
            quant_decode_cuda.source = base_source
            quant_decode_cuda.TOKENS_PER_WARP, quant_decode_cuda.BLOCKS_PER_SM = base_tpw, dict(base_minb)
    return call


fns = {n: variant(n) for n in names}
rows = {n: dict(variant=n, max_err=0.0, us={1: [], 2: []}) for n in names}
for bits in (1, 2):
    for (B, Hq, Hkv, T, D, nk, p) in QATTN_SHAPES + ((1, 32, 8, 4096, 128, 4096, 4095),):
        q, keys, vals, ring = decode_state(bits, B, Hq, Hkv, T, D)
        sc = (torch.tensor(nk, device=DEV), torch.tensor([p], device=DEV))
        want = qda.reference(q, *keys, *vals, ring, *sc, bits, 64, min(64, D), 0.088)
        for n in names:
            got = fns[n](q, *keys, *vals, ring, *sc, bits, 64, min(64, D), 0.088)
            finite = bool(torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all())
            err = max(max_rel(got[0], want[0]), (got[1] - want[1]).abs().max().item()) if finite else float("inf")
            rows[n]["max_err"] = max(rows[n]["max_err"], err)
    packed, sets, call = qattn_128k(bits)
    for _ in range(3):
        for n in names:
            ms, _mode = gpu_time([lambda s=s, fn=fns[n], call=call: call(fn, s) for s in sets])
            rows[n]["us"][bits].append(ms * 1e3)
    for n in names:
        best = min(rows[n]["us"][bits])
        rows[n][f"best_us_{bits}bit"] = best
        rows[n][f"fraction_of_hbm_{bits}bit"] = packed / best / 1e3 / HBM
        rounds = " ".join("%.1f" % u for u in rows[n]["us"][bits])
        print(f"{n:12s} {bits}-bit 128k {best:6.1f} us ({packed / best / 1e3 / HBM:5.1%} of HBM)  rounds {rounds}  "
              f"max err (both widths so far) {rows[n]['max_err']:.1e}", flush=True)
with open(out_path, "w") as f:
    json.dump(dict(command=" ".join(sys.argv), rows=list(rows.values())), f, indent=1)
