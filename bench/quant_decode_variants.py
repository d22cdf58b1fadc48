"""quant_decode_attention's partial kernel at several chunk sizes and register budgets, each checked against the
torch reference (8k tokens) and timed at 128k (Llama-3.1-8B shape: Hq 32, Hkv 8, D 128), against the HBM ceiling.
From the repo root:  PYTHONPATH=src python3 bench/quant_decode_variants.py --out DIR [--tokens-per-warp 512,256,1024]
[--blocks-per-sm 4,3] [--bits 1,2]. Writes DIR/quant_decode_variants.json; the module's defaults are the first row
of each bit width."""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernels import DEV, HBM, decode_state, gpu_time, max_rel, n_sets  # noqa: E402

from tailorkv.engine.results import environment, write_json  # noqa: E402
from tailorkv.ops import dispatch, quant_decode_cuda  # noqa: E402
from tailorkv.ops.quant_attention import quant_decode_attention as qda  # noqa: E402


def split(bits, sets, sc) -> dict:
    """The default variant's kernels (partial, reduce) in us, averaged over 10 calls under torch.profiler."""
    k = dispatch.kernel_for("quant_decode_attention", sets[0][0], *sets[0][1])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(10):
            s = sets[i % len(sets)]
            k(s[0], *s[1], *s[2], s[3], *sc, bits, 64, 64, 0.088)
        torch.cuda.synchronize()
    out = {e.key: e.device_time_total / e.count for e in prof.key_averages() if "quant_attn" in e.key}
    print(f"{bits}-bit default: " + ", ".join(f"{n} {t:.1f} us" for n, t in out.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens-per-warp", default="512,256,1024")
    ap.add_argument("--blocks-per-sm", default="4,3")
    ap.add_argument("--bits", default="1,2")
    a = ap.parse_args()
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, Hq, Hkv, T, D = 1, 32, 8, 131072, 128
    rows = []
    defaults = (quant_decode_cuda.TOKENS_PER_WARP, dict(quant_decode_cuda.BLOCKS_PER_SM))
    for bits in map(int, a.bits.split(",")):
        small = decode_state(bits, 1, Hq, Hkv, 8192, D)
        small_sc = (torch.tensor(8064, device=DEV), torch.tensor([8150], device=DEV))
        want = qda.reference(small[0], *small[1], *small[2], small[3], *small_sc, bits, 64, 64, 0.088)
        packed = 2 * Hkv * T * D * (bits / 8 + 4 / 64)
        sets = [decode_state(bits, B, Hq, Hkv, T, D) for _ in range(n_sets(packed))]
        sc = (torch.tensor(T - 128, device=DEV), torch.tensor([T - 1], device=DEV))
        for tpw in map(int, a.tokens_per_warp.split(",")):
            for minb in map(int, a.blocks_per_sm.split(",")):
                quant_decode_cuda.TOKENS_PER_WARP, quant_decode_cuda.BLOCKS_PER_SM[bits] = tpw, minb
                k = dispatch.kernel_for("quant_decode_attention", small[0], *small[1])
                got = k(small[0], *small[1], *small[2], small[3], *small_sc, bits, 64, 64, 0.088)
                err = max(max_rel(got[0], want[0]), (got[1] - want[1]).abs().max().item())  # o: relative; lse: abs
                ms, mode = gpu_time([lambda s=s, bits=bits: k(s[0], *s[1], *s[2], s[3], *sc, bits, 64, 64, 0.088)
                                     for s in sets])
                row = dict(bits=bits, tokens_per_warp=tpw, blocks_per_sm=minb, max_rel_err=err, time_us=ms * 1e3,
                           timing=mode, packed_bytes=packed, fraction_of_hbm=packed / ms / 1e6 / HBM)
                rows.append(row)
                print(f"{bits}-bit tokens/warp {tpw:4d} blocks/SM {minb}: {ms * 1e3:7.1f} us  "
                      f"{row['fraction_of_hbm']:6.1%} of HBM  max rel err {err:.1e}", flush=True)
        quant_decode_cuda.TOKENS_PER_WARP, quant_decode_cuda.BLOCKS_PER_SM = defaults[0], dict(defaults[1])
        rows.append(dict(bits=bits, kernels_us=split(bits, sets, sc)))
    write_json(os.path.join(a.out, "quant_decode_variants.json"),
               dict(environment=environment(DEV), command=" ".join(sys.argv), rows=rows))


if __name__ == "__main__":
    main()
