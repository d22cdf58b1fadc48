"""The model cache's scheduler: the one place for streams, events and the buffer sets that alternate by layer
(two, or predict_ahead + 1), so that what layer l reads can be filled while the layers before it compute.

On a GPU there are three streams: the compute stream (torch's current stream), a copy stream and a select
stream. Work goes to a side stream with `copy_stream(...)` or `select_stream(...)`: it first waits for
everything queued on the compute stream so far (so it sees the inputs it was handed, and memory the compute
stream freed before is not reused under it) and for the side events named in `after`, then records an event
under a name; the compute stream `wait`s for that name before it reads the results. The select stream is for
the kernels that choose what the copy stream fetches next (sketch-ahead's scores and top-K): on the copy stream
they would queue behind the previous layer's row gather, which is bound by PCIe, not by the SMs.
Nothing here blocks the host, and all of it can be captured in a CUDA graph (the side streams fork from the
capturing stream and every one is joined before the step ends). On a CPU all of it is a no-op.

A buffer is allocated once, at its first request, and never moves (CUDA graphs hold its address): ask for
the largest size the policy will ever need.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

# The copy stream's priority (lower is higher, torch clamps to the device's range; CUDA graphs keep it per kernel
# node): its gathers take SM slots ahead of the compute stream's queued blocks instead of waiting behind a GEMV
# that fills every SM. Measured on the H200 (tailorkv, 8B shape): 32k 11.76 -> 10.32 ms/token, 8k and 128k equal.
COPY_STREAM_PRIORITY = -5
STREAMS = 3  # the compute, copy and select streams


class Scheduler:
    def __init__(self, device: torch.device, overlap: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.overlap = overlap and self.cuda
        self._copy = torch.cuda.Stream(self.device, priority=COPY_STREAM_PRIORITY) if self.overlap else None
        self._select = torch.cuda.Stream(self.device, priority=COPY_STREAM_PRIORITY) if self.overlap else None
        self._events: dict[str, torch.cuda.Event] = {}
        self.sets = 2  # buffer sets, alternating by layer (ModelCache raises it for predictions further ahead)
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._staging: dict[tuple[str, int, int], torch.Tensor] = {}
        self._staging_turns: dict[str, int] = {}

    @property
    def compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def copy_stream(self, name: str, after: tuple[str, ...] = ()):
        """Run the body on the copy stream after the compute stream's queued work and the events `after`;
        record event `name` after it."""
        return self._side(self._copy, name, after)

    def select_stream(self, name: str, after: tuple[str, ...] = ()):
        """As copy_stream, on the select stream."""
        return self._side(self._select, name, after)

    @contextmanager
    def _side(self, stream, name: str, after: tuple[str, ...]):
        if not self.overlap:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        for e in after:
            stream.wait_event(self._events[e])
        with torch.cuda.stream(stream):
            yield
            event = self._events.get(name)
            if event is None:
                event = self._events[name] = torch.cuda.Event()
            event.record(stream)

    def wait(self, name: str) -> None:
        """The compute stream waits for the side-stream work recorded under `name`."""
        if self.overlap:
            torch.cuda.current_stream(self.device).wait_event(self._events[name])

    def join(self) -> None:
        """The compute stream waits for everything queued on the side streams (e.g. host writes that later
        reads of host memory depend on); the staging tensors go back to the allocator after that wait."""
        if self.overlap:
            torch.cuda.current_stream(self.device).wait_stream(self._copy)
            torch.cuda.current_stream(self.device).wait_stream(self._select)
        self._staging.clear()

    def staging(self, name: str, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> tuple[list[torch.Tensor], str]:
        """Device tensors of these shapes to fill on the compute stream and hand to the copy stream, and the
        event name to run that copy under (`copy_stream(event)`). `name`'s calls alternate between two slots; a
        slot is handed out again only after the compute stream waits for the copy that read it last. Slots live
        until `join`. (Tensors made per call and kept alive with record_stream instead come back to the
        allocator only once the host sees their copy finished: a prefill's host runs layers ahead of the GPU,
        and 16 chunks of K and V, 1 GiB for an 8B model at 128k, stayed reserved.)"""
        turn = self._staging_turns.get(name, 0)
        self._staging_turns[name] = turn + 1
        slot, event = turn % 2, f"{name}:{turn % 2}"
        if event in self._events:
            self.wait(event)
        out = []
        for i, shape in enumerate(shapes):
            n, key = math.prod(shape), (name, slot, i)
            buf = self._staging.get(key)
            if buf is None or buf.dtype != dtype or buf.numel() < n:
                buf = self._staging[key] = torch.empty(n, dtype=dtype, device=self.device)
            out.append(buf[:n].view(shape))
        return out, event

    def buffer(self, name: str, layer_idx: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Buffer set layer_idx % sets of `name`: the same memory for every such layer, so one layer's data may
        be filled while the layers before it still read the other sets. The first request allocates it (outside
        any captured step); later requests must fit in it."""
        key = (name, layer_idx % self.sets)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(math.prod(shape), dtype=dtype, device=self.device)
        if buf.dtype != dtype or buf.numel() < math.prod(shape):
            raise RuntimeError(f"buffer {name}: {tuple(shape)} {dtype} does not fit the one allocated "
                               f"({buf.numel()} x {buf.dtype})")
        return buf[:math.prod(shape)].view(shape)

    def device_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
