"""Keys of chosen positions dequantized from a key sketch (ops/quant.py's quantize_sketch layout), on the device:
with `--sketch-keys` a sparse layer attends its top-K middle tokens over these keys and reads only their values
from host memory, so half the bytes cross PCIe.

The CUDA kernel (ops/sketch_rows_cuda.py) computes each element as this reference does, code * scale then + min
in fp32 (two roundings, no fused multiply-add), rounded once to the output's dtype: the same values.
"""
from __future__ import annotations

import torch

from tailorkv.ops import sketch_rows_cuda
from tailorkv.ops.dispatch import op, register_kernel
from tailorkv.ops.quant import unpack_sketch


@op("sketch_rows")
def sketch_rows(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int, group: int,
                pos: torch.Tensor, offset: int, out: torch.Tensor) -> torch.Tensor:
    """codes [B, H, T, D/CPW] int32, scale / mn [B, H, ceil(T/group), D] fp16 (a sketch whose position i is
    absolute position offset + i); pos [B, H, K] int64 absolute positions, offset <= pos < offset + T -> out
    [B, H, K, D] (its dtype) = the keys at pos, dequantized. Returns out."""
    B, H, K = pos.shape
    i = pos - offset
    c = codes.gather(2, i[..., None].expand(B, H, K, codes.shape[3]))
    g = (i // group)[..., None].expand(B, H, K, scale.shape[3])
    x = unpack_sketch(c, bits).float() * scale.gather(2, g).float() + mn.gather(2, g).float()
    return out.copy_(x)


register_kernel("sketch_rows", lambda: sketch_rows_cuda.load(sketch_rows.reference))
