"""Which SDPA backend prefills fastest on this GPU: causal attention over T tokens at Llama-3.1-8B's shape
(32 query heads, 8 KV heads, head_dim 128, bf16, GQA without repeat), each backend alone, CUDA events, median.
Layouts: "bhsd" (q, k, v contiguous [B, H, T, D]) and "engine" (what a prefill hands SDPA: q a view of the fused
qkv projection's output [B, T, (Hq + 2 Hkv) D], k and v the first T slots of a [B, Hkv, max_len, D] cache), and
"engine-qc" (the same with q copied to contiguous [B, Hq, T, D] first, the copy timed too).
    PYTHONPATH=src python3 bench/sdpa_backends.py --tokens 8192,32768 --layouts bhsd,engine --out DIR"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tailorkv.engine.results import environment, write_json


def time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def inputs(layout: str, T: int):
    dev, dt = "cuda", torch.bfloat16
    if layout == "bhsd":
        return (torch.randn(1, 32, T, 128, device=dev, dtype=dt),
                *(torch.randn(1, 8, T, 128, device=dev, dtype=dt) for _ in range(2)))
    qkv = torch.randn(1, T, (32 + 2 * 8) * 128, device=dev, dtype=dt)
    q = qkv[..., :32 * 128].view(1, T, 32, 128).transpose(1, 2)
    k, v = (torch.randn(1, 8, T + 1024, 128, device=dev, dtype=dt)[:, :, :T] for _ in range(2))
    return q, k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--layouts", default="bhsd")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        flops = 4 * 32 * 128 * T * T / 2  # causal: half of QK^T and PV
        for layout in args.layouts.split(","):
            q, k, v = inputs(layout, T)
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                def run(q=q, k=k, v=v, copy_q=layout == "engine-qc"):
                    qq = q.contiguous() if copy_q else q
                    return F.scaled_dot_product_attention(qq, k, v, is_causal=True, enable_gqa=True)
                try:
                    with sdpa_kernel([backend]):
                        ms = time_ms(run, reps=5 if T > 16384 else 20)
                    rows.append({"tokens": T, "layout": layout, "backend": name, "ms": ms,
                                 "tflops": flops / ms / 1e9})
                except Exception as e:  # a backend that does not take these inputs
                    rows.append({"tokens": T, "layout": layout, "backend": name,
                                 "error": f"{type(e).__name__}: {str(e)[:120]}"})
            del q, k, v
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "sdpa_backends.json"), {"env": environment(torch.device("cuda")), "rows": rows})
    for r in rows:
        print(f"T={r['tokens']:>6} {r['layout']:>9} {r['backend']:>9} " + (f"{r['ms']:8.2f} ms {r['tflops']:6.0f} TFLOP/s"
                                                          if "ms" in r else r["error"]))


if __name__ == "__main__":
    main()
