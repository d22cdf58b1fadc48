"""The scheduler's streams: a no-op on the CPU; on a GPU the copy and select streams run at the highest
priority, and work ordered by named events runs in that order."""
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


def test_cpu_select_then_copy_runs_in_program_order():
    s = Scheduler(torch.device("cpu"))
    x = torch.zeros(4)
    with s.select_stream("picked"):
        x.add_(1)
    with s.copy_stream("fetched", after=("picked",)):
        y = x * 3
    s.wait("fetched")
    assert torch.equal(y, torch.full((4,), 3.0))


@pytest.mark.cuda
def test_side_streams_have_the_highest_priority():
    s = Scheduler(torch.device("cuda"))
    for side in (s._copy, s._select):
        assert side.priority == min(torch.cuda.Stream.priority_range())
        assert side.priority < torch.cuda.current_stream().priority
    assert s._copy != s._select


@pytest.mark.cuda
@pytest.mark.parametrize("graphed", [False, True])
def test_copy_work_after_select_work_sees_its_result(graphed):
    """A long kernel chain on the select stream, then a copy-stream read of its output ordered by `after`, then
    the compute stream's wait: the read sees the finished result, eagerly and replayed from a CUDA graph (the
    select stream forks from the capturing stream and join() brings it back)."""
    s = Scheduler(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    out = torch.empty(2048, 2048, device="cuda")
    got = torch.empty_like(out)

    def step():
        with s.select_stream("picked"):
            x = a
            for _ in range(20):
                x = torch.tanh(x @ a * 1e-3)
            out.copy_(x)
        with s.copy_stream("fetched", after=("picked",)):
            got.copy_(out)
        s.wait("fetched")
        s.join()

    torch.cuda.synchronize()
    step()  # warm-up (and the eager check)
    torch.cuda.synchronize()
    assert torch.equal(got, out)
    if graphed:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        a.copy_(torch.randn_like(a))
        got.zero_()
        g.replay()
        torch.cuda.synchronize()
        want = a
        for _ in range(20):
            want = torch.tanh(want @ a * 1e-3)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5) and torch.equal(got, out)


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
