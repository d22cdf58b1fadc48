"""Throughput of the warp-level binary MMA (mma.sync m16n8k256 .b1 AND.POPC, int32 accumulate) against the fp16
m16n8k16 MMA on this GPU: many warps, 4 independent accumulators each, CUDA events. Device only:
PYTHONPATH=src python3 bench/probes/probe_bmma.py  (instructions per clock per SM of each, and the bit-ops rate)."""
import cupy as cp
import numpy as np

from tailorkv.ops.quant_common_cuda import HELPERS

SRC = HELPERS + r'''
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) { mma_f16(c, a, b0, b1); }
__device__ __forceinline__ void mma(int* c, const unsigned* a, unsigned b0, unsigned b1) {   // binary AND.POPC
    asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n" : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// reps x 4 independent MMAs per warp; T (the accumulator) picks the instruction; fp16 inputs masked to finite values
template <class T> __device__ void run(const unsigned* in, int* out, int reps, unsigned mask) {
    unsigned a[4], b[2]; T c[4][4] = {};
    for (int i = 0; i < 4; ++i) a[i] = in[threadIdx.x * 4 + i] & mask;
    for (int i = 0; i < 2; ++i) b[i] = in[128 + threadIdx.x * 2 + i] & mask;
    for (int r = 0; r < reps; ++r)
        #pragma unroll
        for (int k = 0; k < 4; ++k) mma(c[k], a, b[0], b[1]);
    T s = 0;
    for (int k = 0; k < 4; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = (int)s;
}
extern "C" __global__ void bmma(const unsigned* in, int* out, int reps) { run<int>(in, out, reps, ~0u); }
extern "C" __global__ void hmma(const unsigned* in, int* out, int reps) { run<float>(in, out, reps, 0x3c003c00u); }'''
mod = cp.RawModule(code=SRC, options=("-arch=sm_90",))
sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
inp = cp.asarray(np.random.default_rng(0).integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32))
out = cp.zeros(sms * 8 * 256, cp.int32)
reps = 4096
for name, macs in (("bmma m16n8k256 b1", 16 * 8 * 256), ("hmma m16n8k16 f16", 16 * 8 * 16)):
    k = mod.get_function(name.split()[0])
    for warps in (4, 8, 16):
        k((sms * 2,), (32 * warps,), (inp, out, np.int32(64)))
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        k((sms * 2,), (32 * warps,), (inp, out, np.int32(reps)))
        e.record(); e.synchronize()
        ms = cp.cuda.get_elapsed_time(s, e)
        inst = sms * 2 * warps * reps * 4
        clk = 1.755e9  # the clock seen under load (bench/results/2026-12-01-h200-eighteenth-session), for a rate per clock
        print(f"{name}: {warps * 2:2d} warps/SM  {ms:8.3f} ms  {inst / ms / 1e9:8.2f} T instr/s  "
              f"~{inst / (ms * 1e-3) / clk / sms:5.2f} instr/clk/SM  {2 * inst * macs / ms / 1e9:9.1f} TOPS", flush=True)
