"""Causal prefill attention over T tokens in key blocks: each (query block i, key block j <= i) is one cuDNN call
(causal on the diagonal) returning its output and logsumexp, merged into the rows of block i. At 128k tokens one
causal cuDNN call runs at ~560 TFLOP/s against ~650 at 32k (bench/sdpa_backends.py): a head's K and V (64 MB at
128k) no longer fit the 50 MB L2. Checks the merge against one SDPA call, then times block sizes.
    PYTHONPATH=src python3 bench/prefill_attention_split.py --tokens 131072 --blocks 16384,32768,65536 --out DIR"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdpa_backends import time_ms  # bench/, the script's folder, leads sys.path
from tailorkv.engine.results import environment, write_json


def cudnn_attention(q, k, v, causal: bool):
    """-> (o [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] fp32); k, v with Hq heads or fewer (GQA)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    return out[0], out[1].reshape(q.shape[:3]).float()


def split_causal(q, k, v, block: int, gqa_native: bool):
    B, Hq, T, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    for j in range(0, T, block):
        kb, vb = k[:, :, j:j + block], v[:, :, j:j + block]
        if not gqa_native and Hq != k.shape[1]:
            g = Hq // k.shape[1]
            kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
        for i in range(j, T, block):
            o_p, l_p = cudnn_attention(q[:, :, i:i + block], kb, vb, causal=i == j)
            if j == 0:   # the first key block a row sees
                out[:, :, i:i + block], lse[:, :, i:i + block] = o_p, l_p
                continue
            lo = lse[:, :, i:i + block]
            m = torch.maximum(lo, l_p)
            a, b = torch.exp(lo - m), torch.exp(l_p - m)
            s = a + b
            o = out[:, :, i:i + block].float() * (a / s).unsqueeze(-1) + o_p.float() * (b / s).unsqueeze(-1)
            out[:, :, i:i + block] = o.to(q.dtype)
            lse[:, :, i:i + block] = m + torch.log(s)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="131072")
    ap.add_argument("--blocks", default="16384,32768,65536")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    rows = []
    # correctness at a small size: the merge against one causal SDPA call
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 32, 8192, 128, device=dev, dtype=dt, generator=g)
    k, v = (torch.randn(1, 8, 8192, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float()
    for native in (True, False):
        try:
            got = split_causal(q, k, v, 2048, native).float()
            err = ((got - ref).norm() / ref.norm()).item()
            rows.append({"check": "8k in blocks of 2k", "gqa_native": native, "rel_err": err,
                         "nan": bool(got.isnan().any())})
        except Exception as e:
            rows.append({"check": "8k in blocks of 2k", "gqa_native": native, "error": f"{type(e).__name__}: {e}"[:200]})
        print(rows[-1])
    native = any(r.get("gqa_native") and "rel_err" in r and r["rel_err"] < 1e-2 for r in rows)
    del q, k, v, ref
    for T in (int(t) for t in args.tokens.split(",")):
        q = torch.randn(1, 32, T, 128, device=dev, dtype=dt)
        k, v = (torch.randn(1, 8, T, 128, device=dev, dtype=dt) for _ in range(2))
        flops = 4 * 32 * 128 * T * T / 2
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = time_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 3)
        rows.append({"tokens": T, "block": T, "ms": ms, "tflops": flops / ms / 1e9})
        print(rows[-1])
        for blk in (int(b) for b in args.blocks.split(",")):
            if blk >= T:
                continue
            ms = time_ms(lambda q=q, k=k, v=v, blk=blk: split_causal(q, k, v, blk, native), 3)
            rows.append({"tokens": T, "block": blk, "gqa_native": native, "ms": ms, "tflops": flops / ms / 1e9})
            print(rows[-1])
        del q, k, v
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "prefill_attention_split.json"), {"env": environment(torch.device(dev)),
                                                                         "rows": rows})


if __name__ == "__main__":
    main()
