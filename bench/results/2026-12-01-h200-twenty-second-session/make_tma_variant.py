"""The bulk-copy (TMA engine) staging variant of ops/quant_decode.cu at b0d16df: lane 0 of a warp stages a group
with six cp.async.bulk copies completing on the stage's mbarrier (no per-lane cp.async, no L1 path), the warp waits
on the barrier's phase; values from position vq on are zeroed in shared memory after the copy.
Usage (repo root at b0d16df): python3 make_tma_variant.py OUT.cu"""
import sys

with open("ops/quant_decode.cu") as f:
    s = f.read()

helpers = r'''
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
    unsigned ok;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                     : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
'''
anchor = 'extern "C" __global__ void __launch_bounds__(NTHR, MINB) quant_attn_partial('
assert anchor in s
s = s.replace(anchor, helpers + anchor, 1)

old_issue_start = s.index("    auto issue = [&](int i) {")
old_issue_end = s.index("    auto body = [&](int i) {")
new_issue = r'''    __shared__ __align__(8) unsigned long long bars[WARPS][STAGES];
    if (lane == 0) {
        #pragma unroll
        for (int j = 0; j < STAGES; ++j)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(smem_addr(&bars[warp][j])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncwarp();
    auto issue = [&](int i) {
        if (lane != 0) return;
        unsigned* st = wst + (i % STAGES) * STAGE_WORDS;
        const long long tg = w0 + 64LL * i;
        const unsigned bar = smem_addr(&bars[warp][i % STAGES]);
        constexpr unsigned total = KROWS * D * 4 + D * 4 + 64 * WPT * 4 + 64 * NGD * 4;
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(total) : "memory");
        bulk_copy(st, kc_b + (tg / CPW) * D, KROWS * D * 4, bar);
        bulk_copy(st + OFF_KS, ks_b + (tg / 64) * D, D * 2, bar);
        bulk_copy(st + OFF_KS + D / 2, km_b + (tg / 64) * D, D * 2, bar);
        bulk_copy(st + OFF_V, vc_b + tg * WPT, 64 * WPT * 4, bar);
        bulk_copy(st + OFF_VS, vs_b + tg * NGD, 64 * NGD * 2, bar);
        bulk_copy(st + OFF_VS + 32 * NGD, vm_b + tg * NGD, 64 * NGD * 2, bar);
    };
    auto landed = [&](int i) {                             // the stage's copies, then zeros from position vq on
        bar_wait(smem_addr(&bars[warp][i % STAGES]), (unsigned)(i / STAGES) & 1u);
        const long long tg = w0 + 64LL * i;
        if (vq - tg < 64) {
            unsigned* st = wst + (i % STAGES) * STAGE_WORDS;
            const int nv = (int)max(0LL, vq - tg);
            for (int t = nv + lane; t < 64; t += 32) {
                for (int w = 0; w < WPT; ++w) st[OFF_V + t * WPT + w] = 0u;
                __half* vsz = reinterpret_cast<__half*>(st + OFF_VS);
                for (int gd = 0; gd < NGD; ++gd) { vsz[t * NGD + gd] = __float2half(0.f); vsz[64 * NGD + t * NGD + gd] = __float2half(0.f); }
            }
        }
        __syncwarp();
    };

'''
s = s[:old_issue_start] + new_issue + s[old_issue_end:]
old_pipe = "    warp_pipeline<STAGES>(ngrp, issue, body);"
assert old_pipe in s
s = s.replace(old_pipe, r'''    #pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) if (j < ngrp) issue(j);
    for (int i = 0; i < ngrp; ++i) {
        if (i + STAGES - 1 < ngrp) issue(i + STAGES - 1);
        landed(i);
        body(i);
        __syncwarp();
    }''')
with open(sys.argv[1], "w") as f:
    f.write(s)
