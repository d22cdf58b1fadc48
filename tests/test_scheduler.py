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
