"""Throughput of the warp-level binary MMA (mma.sync m16n8k256 .b1 AND.POPC, int32 accumulate) against the fp16
m16n8k16 MMA on this GPU: many warps, 4 independent accumulators each, CUDA events. Device only:
python3 bench/probes/probe_bmma.py  (instructions per clock per SM of each, and the bit-ops rate)."""
import cupy as cp
import numpy as np

SRC = r'''
extern "C" __global__ void bmma(const unsigned* in, int* out, int reps) {
    unsigned a[4], b[2]; int c[4][4] = {};
    for (int i = 0; i < 4; ++i) a[i] = in[threadIdx.x * 4 + i];
    for (int i = 0; i < 2; ++i) b[i] = in[128 + threadIdx.x * 2 + i];
    for (int r = 0; r < reps; ++r)
        #pragma unroll
        for (int k = 0; k < 4; ++k)
            asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};\n" : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    int s = 0;
    for (int k = 0; k < 4; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void hmma(const unsigned* in, int* out, int reps) {
    unsigned a[4], b[2]; float c[4][4] = {};
    for (int i = 0; i < 4; ++i) a[i] = in[threadIdx.x * 4 + i] & 0x3c003c00u;
    for (int i = 0; i < 2; ++i) b[i] = in[128 + threadIdx.x * 2 + i] & 0x3c003c00u;
    for (int r = 0; r < reps; ++r)
        #pragma unroll
        for (int k = 0; k < 4; ++k)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};\n" : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    float s = 0;
    for (int k = 0; k < 4; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = (int)s;
}'''
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
