"""How exact the tensor cores' fp16 m16n8k16 MMA (fp32 accumulate) is when A holds 0 or 2^k, from normal (k >= -14)
down to subnormal (k = -24), against float64, with B at mixed scales: ops/quant_decode.cu picks its code positions
from this. Device only:  PYTHONPATH=src python3 bench/probes/probe_mma.py  (one line per k: worst relative error, of the result and
per column). On the H200 (2026-12-01): ~1e-7 for k >= -15, 3e-7 at -17, 2e-6 at -19, then doubling per power of
two down to 9e-5 at -24."""
import cupy as cp
import numpy as np

from tailorkv.ops.quant_common_cuda import HELPERS

src = HELPERS + r'''
extern "C" __global__ void k(const unsigned* A, const unsigned* B, float* C) {   // one warp: C = A B
    const int lane = threadIdx.x;
    unsigned a[4], b[2]; float c[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; ++i) a[i] = A[lane * 4 + i];
    for (int i = 0; i < 2; ++i) b[i] = B[lane * 2 + i];
    mma_f16(c, a, b[0], b[1]);
    for (int i = 0; i < 4; ++i) C[lane * 4 + i] = c[i];
}'''
kern = cp.RawModule(code=src).get_function("k")
rng = np.random.default_rng(0)
def frag_a(M):  # M [16,16] fp16 -> per-lane regs
    out = np.zeros((32, 4, 2), np.float16)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        out[lane, 0] = M[g, 2*c:2*c+2]; out[lane, 1] = M[g+8, 2*c:2*c+2]
        out[lane, 2] = M[g, 2*c+8:2*c+10]; out[lane, 3] = M[g+8, 2*c+8:2*c+10]
    return out.view(np.uint32).reshape(-1)
def frag_b(M):  # M [16,8]
    out = np.zeros((32, 2, 2), np.float16)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        out[lane, 0] = M[2*c:2*c+2, g]; out[lane, 1] = M[2*c+8:2*c+10, g]
    return out.view(np.uint32).reshape(-1)
def unc(Cl):
    C = np.zeros((16, 8))
    Cl = Cl.reshape(32, 4)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        C[g, 2*c:2*c+2] = Cl[lane, 0:2]; C[g+8, 2*c:2*c+2] = Cl[lane, 2:4]
    return C
for name, scale in [(f"A=2^{k}", 2.0**k) for k in (0, -14, -15, -17, -18, -19, -20, -21, -22, -24)]:
    errs, colerr = [], []
    for trial in range(50):
        bits = rng.integers(0, 2, (16, 16)).astype(np.float64)
        A = (bits * scale).astype(np.float16)
        Bm = (rng.standard_normal((16, 8)) * rng.choice([1, 1e-2, 1e-3], (16, 8))).astype(np.float16)
        C = cp.zeros(128, cp.float32)
        kern((1,), (32,), (cp.asarray(frag_a(A)), cp.asarray(frag_b(Bm)), C))
        got = unc(cp.asnumpy(C))
        want = A.astype(np.float64) @ Bm.astype(np.float64)
        errs.append(np.abs(got - want).max() / np.abs(want).max())
        colerr.append((np.abs(got - want).max(0) / np.maximum(np.abs(want).max(0), 1e-300)).max())
    print(f"{name:10s} max rel err {max(errs):.2e}, per column {max(colerr):.2e}")
