"""The scheduler's streams: a no-op on the CPU; on a GPU the copy stream runs at the highest priority."""
import pytest
import torch

from tailorkv.engine.scheduler import Scheduler


def test_cpu_has_no_copy_stream():
    s = Scheduler(torch.device("cpu"))
    assert not s.overlap and s.compute is None
    with s.copy_stream("x"):
        y = torch.ones(3) * 2
    s.wait("x")
    assert y.sum().item() == 6


@pytest.mark.cuda
def test_copy_stream_has_the_highest_priority():
    s = Scheduler(torch.device("cuda"))
    assert s._copy.priority == min(torch.cuda.Stream.priority_range())
    assert s._copy.priority < torch.cuda.current_stream().priority


def test_staging_alternates_two_slots_until_join():
    s = Scheduler(torch.device("cpu"))
    (a,), ea = s.staging("store", [(2, 3)], torch.float32)
    (b,), eb = s.staging("store", [(2, 3)], torch.float32)
    (c, kt), ec = s.staging("store", [(1, 3), (4,)], torch.float32)
    assert ea == ec != eb
    assert a.data_ptr() != b.data_ptr() and c.data_ptr() == a.data_ptr()  # slot 0 again, the smaller view of it
    (d,), _ = s.staging("store", [(5, 3)], torch.float32)                 # slot 1 grows
    assert d.shape == (5, 3) and d.data_ptr() != b.data_ptr()
    s.join()
    (e,), ee = s.staging("store", [(2, 3)], torch.float32)
    assert ee == ea and not s.device_bytes()                               # staging is not a step buffer


@pytest.mark.cuda
def test_staging_slot_waits_for_the_copy_that_read_it():
    """Chunk i fills slot i % 2 on the compute stream (microseconds) and goes to its own host rows on the copy
    stream (a millisecond over PCIe): without the wait, chunk i + 2 would overwrite the slot under chunk i's copy."""
    s = Scheduler(torch.device("cuda"))
    n, chunks = 1 << 24, 6
    host = torch.empty(chunks, n, pin_memory=True)
    for i in range(chunks):
        (buf,), event = s.staging("store", [(n,)], torch.float32)
        buf.fill_(float(i))
        with s.copy_stream(event):
            host[i].copy_(buf, non_blocking=True)
    s.join()
    torch.cuda.synchronize()
    assert torch.equal(host[:, ::4096], torch.arange(chunks, dtype=torch.float32)[:, None].expand(chunks, n // 4096))
