"""Ways for a kernel to read the paper's K^T rows from pinned host memory, on a host where the SMs' zero-copy reads
run below the DMA engine's (bench/probes/kt_row_reads.py: 34 against 55 GB/s on some H100 hosts). The rows' indices
stay on the device, so the DMA engine itself cannot take them (a host-issued copy needs them on the host).
Variants, each checked against torch.gather on one layer:
  - sm R: the engine's kernel shape, uint4 loads, R blocks per row (1 = ops/host_gather_cuda's long-row kernel);
  - tma P x B, R: the Hopper bulk-copy unit (cp.async.bulk: one thread asks for P bytes at a time, B pieces in
    flight per block, through shared memory, then a bulk store), R blocks per row;
  - the same from host memory registered by cudaHostRegister on transparent huge pages (larger IOMMU pages);
  - the DMA engine's copy of the same bytes, contiguous: the host's ceiling.
    PYTHONPATH=src python3 bench/probes/host_read_paths.py [N] [LAYERS]
"""
import mmap
import sys
import time

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr

N = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
L = int(sys.argv[2]) if len(sys.argv) > 2 else 31
dev = torch.device("cuda")

SOURCE = r"""
extern "C" __global__ void sm_rows(const unsigned long long src_addr, const long long* __restrict__ idx,
                                   const unsigned long long dst_addr, const long long row_stride,
                                   const long long row_words, const int chunks) {
    const int row = blockIdx.x / chunks, c = blockIdx.x % chunks;
    const long long seg = row_words / chunks;
    const uint4* src = (const uint4*)src_addr + idx[row] * row_stride + c * seg;
    uint4* dst = (uint4*)dst_addr + row * row_words + c * seg;
    for (long long w = threadIdx.x; w < seg; w += blockDim.x) dst[w] = src[w];
}

__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

extern "C" __global__ void tma_rows(const unsigned long long src_addr, const long long* __restrict__ idx,
                                    const unsigned long long dst_addr, const long long row_stride_bytes,
                                    const long long row_bytes, const int chunks, const int piece, const int nbuf) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[8];
    if (threadIdx.x != 0) return;
    const int row = blockIdx.x / chunks, c = blockIdx.x % chunks;
    const long long seg = row_bytes / chunks;
    const unsigned char* src = (const unsigned char*)src_addr + idx[row] * row_stride_bytes + c * seg;
    unsigned char* dst = (unsigned char*)dst_addr + row * row_bytes + c * seg;
    const int n = (int)(seg / piece);
    const unsigned s0 = (unsigned)__cvta_generic_to_shared(smem), b0 = (unsigned)__cvta_generic_to_shared(bars);
    for (int b = 0; b < nbuf; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b0 + 8 * b));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    for (int k = 0; k < n && k < nbuf; ++k) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b0 + 8 * k), "r"(piece) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(s0 + k * piece), "l"(src + (long long)k * piece), "r"(piece), "r"(b0 + 8 * k) : "memory");
    }
    for (int k = 0; k < n; ++k) {
        const int b = k % nbuf;
        wait_parity(b0 + 8 * b, (k / nbuf) & 1);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst + (long long)k * piece), "r"(s0 + b * piece), "r"(piece) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (k + nbuf < n) {
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b0 + 8 * b), "r"(piece) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(s0 + b * piece), "l"(src + (long long)(k + nbuf) * piece), "r"(piece),
                            "r"(b0 + 8 * b) : "memory");
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def thp_pinned(shape):
    """A bf16 host tensor on transparent huge pages (2 MiB aligned), registered with CUDA; its device pointer."""
    import cupy
    nbytes = int(np.prod(shape)) * 2
    buf = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(buf, dtype=np.uint8)
    off = (-base.ctypes.data) % (2 << 20)
    buf.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    t = torch.frombuffer(buf, dtype=torch.bfloat16, count=nbytes // 2, offset=off).view(shape)
    t.zero_()
    cupy.cuda.runtime.hostRegister(t.data_ptr(), nbytes, 0)
    return t, t.data_ptr(), buf  # UVA: a registered host pointer is its device pointer on this platform


def main():
    import cupy
    mod = compile_module(SOURCE)
    sm_k, tma_k = mod.get_function("sm_rows"), mod.get_function("tma_rows")
    tma_k.max_dynamic_shared_size_bytes = 96 * 1024
    stores = [torch.empty(1, 8, 128, N, dtype=torch.bfloat16, pin_memory=True) for _ in range(L)]
    stores[-1].normal_()
    out = torch.empty(1, 8, 12, N, dtype=torch.bfloat16, device=dev)
    row_bytes = N * 2
    step_bytes = L * out.numel() * 2
    g = torch.Generator(device=dev).manual_seed(0)
    idx = [torch.randperm(128, generator=g, device=dev)[:96].view(1, 8, 12).sort(-1).values.contiguous()
           for _ in range(L)]
    # a [1, 8, 128, N] store's rows: row r of head h is row h * 128 + idx; fold the head into the index
    flat_idx = [(i + torch.arange(8, device=dev).view(1, 8, 1) * 128).reshape(-1).contiguous() for i in idx]
    ref = stores[-1].gather(2, idx[-1].cpu()[..., None].expand(1, 8, 12, N))

    def sm(addrs, chunks):
        def run():
            for a, i in zip(addrs, flat_idx):
                launch(sm_k, (96 * chunks,), (256,), (np.uint64(a), ptr(i), ptr(out), np.int64(row_bytes // 16),
                                                      np.int64(row_bytes // 16), np.int32(chunks)), dev)
        return run

    def tma(addrs, chunks, piece, nbuf):
        def run():
            for a, i in zip(addrs, flat_idx):
                launch(tma_k, (96 * chunks,), (32,), (np.uint64(a), ptr(i), ptr(out), np.int64(row_bytes),
                                                     np.int64(row_bytes), np.int32(chunks), np.int32(piece),
                                                     np.int32(nbuf)), dev, shared_mem=piece * nbuf)
        return run

    rows = []

    def measure(name, fn, check_last):
        out.fill_(float("nan"))
        t = timed(fn)
        ok = torch.equal(out.cpu(), check_last)
        rows.append((name, t * 1e3, step_bytes / t / 1e9, "ok" if ok else "WRONG"))
        print(rows[-1], flush=True)

    pinned = [s.data_ptr() for s in stores]
    for chunks in (1, 2, 4, 8):
        measure(f"sm, {chunks} block(s) per row", sm(pinned, chunks), ref)
    for piece, nbuf in ((16384, 2), (16384, 4), (32768, 2), (8192, 8)):
        for chunks in (1, 4):
            measure(f"tma {piece // 1024} KiB x {nbuf}, {chunks} block(s) per row", tma(pinned, chunks, piece, nbuf),
                    ref)
    thp_note = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    try:
        huge = [thp_pinned((1, 8, 128, N)) for _ in range(L)]
        huge[-1][0].copy_(stores[-1])
        addrs = [h[1] for h in huge]
        measure("sm, 1 block per row, THP registered", sm(addrs, 1), ref)
        measure("sm, 4 blocks per row, THP registered", sm(addrs, 4), ref)
        measure("tma 16 KiB x 4, 1 block per row, THP registered", tma(addrs, 1, 16384, 4), ref)
        for h in huge:
            cupy.cuda.runtime.hostUnregister(h[0].data_ptr())
    except Exception as e:  # noqa: BLE001 - a probe: report and go on
        print(f"THP variant failed: {type(e).__name__}: {e}")
    flat = torch.empty(step_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(flat, device=dev)
    t = timed(lambda: dst.copy_(flat, non_blocking=True))
    rows.append(("DMA copy of the same bytes (pinned, contiguous)", t * 1e3, step_bytes / t / 1e9, "-"))
    print(f"\n{torch.cuda.get_device_name(0)}; {L} layers x 96 rows of {row_bytes // 1024} KiB "
          f"({step_bytes / 2**20:.0f} MiB per step); THP: {thp_note}")
    print(f"{'variant':<52} {'ms/step':>8} {'GB/s':>7}  check")
    for name, ms, gbs, ok in rows:
        print(f"{name:<52} {ms:8.2f} {gbs:7.1f}  {ok}")


if __name__ == "__main__":
    main()
