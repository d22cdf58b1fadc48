"""A GGUF file read quickly: the metadata as Python values in one pass over the header, the tensors as numpy views
of the memory-mapped file in the layout gguf.quants.dequantize takes. (gguf's GGUFReader makes a numpy view per
array element: 6-9 s for SmolLM2's 49k-token vocabulary and merges; this pass takes well under a second.)"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import gguf
import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
         10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
Q = gguf.GGMLQuantizationType
PLAIN = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32,
         Q.I64: np.int64}


@dataclass
class Tensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray        # numpy order (reversed); rows of quantized blocks as uint8 for quantized types


class GGUFFile:
    """fields: key -> value (arrays as lists); tensors: in file order. ValueError for a file that is not GGUF."""

    def __init__(self, path: str):
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.buf = memoryview(self.mm)
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic at the start")
        self.pos = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, Q(self._unpack("<I")), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def _value(self, kind: int):
        if kind in SCALARS:
            return self._unpack(SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item, n = self._unpack("<I"), self._unpack("<Q")
        if item in NUMPY:  # a numeric array in one read
            arr = np.frombuffer(self.buf, dtype=NUMPY[item], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        return [self._value(item) for _ in range(n)]

    def _tensor(self, name: str, dims: tuple[int, ...], kind, offset: int) -> Tensor:
        np_dims = tuple(reversed(dims))
        n = int(np.prod(dims))
        if kind in PLAIN:
            dtype, count = np.dtype(PLAIN[kind]), n
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), n // block * type_size
            np_dims = (*np_dims[:-1], np_dims[-1] // block * type_size)
        end = offset + count * dtype.itemsize
        if end > len(self.mm):
            raise ValueError(f"tensor {name} ends at byte {end} but the file has {len(self.mm)}: it is truncated")
        data = np.asarray(self.mm[offset:end]).view(dtype).reshape(np_dims)
        return Tensor(name, kind, dims, data)
