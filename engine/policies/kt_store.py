"""The paper's K^T store of a sparse layer: its keys channel-major in host memory [B, Hkv, D, max_len], read a
row (one channel over a bucket of the middle) at a time for the approximate scores, the largest read of a decode
step over PCIe (25 MB per layer of an 8B model at 128k).

16 bits: the keys as they are. 8 bits: float8 e4m3 of the keys times a power of two per (KV head, channel), set at
the layer's first write from max|K| so far (to TARGET: keys up to 448 / TARGET times larger later stay in range,
larger ones saturate); the scores take the rows as stored and the query times the inverse scale (a power of two:
exact), so the rows never come back to 16 bits. Half the bytes, for a rank of scores, not attention itself."""
from __future__ import annotations

import torch

from tailorkv.ops.host_copy import host_copy
from tailorkv.ops.host_memory import host_empty

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TARGET = 32.0  # the first write's max|K| per channel maps here (14x headroom; below max / 2^11 e4m3 is subnormal)


class KtStore:
    def __init__(self, spec, bits: int):
        B, H, N, D = spec.batch, spec.n_kv_heads, spec.max_len, spec.head_dim
        self.bits = bits
        self.dtype = spec.dtype if bits == 16 else E4M3
        self.host = host_empty((B, H, D, N), self.dtype, spec.device)
        # keys x scale are stored; the query meets them times q_scale = 1 / scale (per query head: one op a step)
        self.scale = torch.ones(B, H, D, 1, dtype=spec.dtype, device=spec.device) if bits == 8 else None
        self.q_scale = torch.ones(B, spec.n_heads, 1, D, dtype=spec.dtype, device=spec.device) if bits == 8 else None
        self.scaled = False

    def reset(self) -> None:
        self.scaled = False  # the next first write sets the scales again

    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def write(self, scheduler, k: torch.Tensor, pos: int, kmax: torch.Tensor) -> None:
        """Keys k [B, Hkv, m, D] (device) to positions [pos, pos + m), transposed on the device and copied on the
        copy stream through the scheduler's staging slots. kmax [B, Hkv, D]: max|K| of every token held so far."""
        B, H, m, D = k.shape
        (kt,), event = scheduler.staging("store-kt", [(B, H, D, m)], k.dtype)
        kt.copy_(k.transpose(2, 3))
        host = self.host
        if self.bits == 8:
            if not self.scaled:
                self._set_scale(kmax)
            kt.mul_(self.scale).clamp_(-E4M3_MAX, E4M3_MAX)
            (k8,), event = scheduler.staging("store-kt8", [(B, H, D, m)], torch.uint8)
            k8.view(E4M3).copy_(kt)
            kt, host = k8, host.view(torch.uint8)
        with scheduler.copy_stream(event):
            host_copy(host[:, :, :, pos:pos + m], kt)

    def _set_scale(self, kmax: torch.Tensor) -> None:
        # 2^-14 .. 2^14: the scale and its inverse stay normal numbers in fp16 (a channel of keys below 2e-3 keeps a
        # smaller range, keys above 5e5 saturate)
        exp = torch.floor(torch.log2(TARGET / kmax.float().clamp_min(2.0 ** -30))).clamp_(-14, 14)
        self.scale.copy_(torch.exp2(exp)[..., None])
        self.q_scale.copy_(torch.exp2(-exp).repeat_interleave(self.q_scale.shape[1] // exp.shape[1], 1)[:, :, None])
        self.scaled = True

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """The query [B, Hq, 1, D] the stored rows are scored against (times the inverse scale for 8 bits)."""
        return q if self.q_scale is None else q * self.q_scale
