"""host_copy: strided blocks of rows between pinned host memory and the device (one cudaMemcpy2DAsync)."""
import pytest
import torch

from tailorkv.ops import dispatch
from tailorkv.ops.host_copy import host_copy, rows_plan


def test_rows_plan_of_the_host_store_views():
    N = 100
    hk, hkt = torch.empty(2, 8, N, 16), torch.empty(2, 8, 16, N)
    k = torch.randn(2, 8, 30, 16)
    assert rows_plan(hk[:, :, 10:40], k) == (16, 480, 1600, 480)           # the middle of [B, H, N, D]
    assert rows_plan(hkt[:, :, :, 10:40], k.transpose(2, 3).contiguous()) == (256, 30, 100, 30)  # K^T columns
    assert rows_plan(k.clone(), hk[:, :, 10:40]) == (16, 480, 480, 1600)   # back to the device
    assert rows_plan(hkt[:, :, :, 10:40], k.transpose(2, 3)) is None       # a transposed source: no rows
    assert rows_plan(hk[:, ::2, 10:40], k[:, :4].contiguous()) == (8, 480, 3200, 480)  # every other head
    assert rows_plan(hk[:, ::2, 10:40], k[:, :4]) is None  # a source whose batch rows do not step evenly
    assert rows_plan(hk[:, :, 10:40], k[:, :, :20]) is None                # shapes differ


def test_reference_copies():
    host, dev = torch.zeros(2, 3, 50, 8), torch.randn(2, 3, 10, 8)
    host_copy(host[:, :, 5:15], dev)
    assert torch.equal(host[:, :, 5:15], dev) and host[:, :, :5].abs().sum() == 0 and host[:, :, 15:].abs().sum() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_reference_both_ways(dtype):
    N, B, H, D = 3000, 2, 8, 128
    host = torch.full((B, H, N, D), float("nan"), dtype=dtype).pin_memory()
    host_t = torch.full((B, H, D, N), float("nan"), dtype=dtype).pin_memory()
    k = torch.randn(B, H, 700, D, device="cuda").to(dtype)
    assert dispatch.kernel_for("host_copy", host, k) is not None, "the host_copy kernel did not load"
    host_copy(host[:, :, 1000:1700], k)
    host_copy(host_t[:, :, :, 1000:1700], k.transpose(2, 3).contiguous())
    torch.cuda.synchronize()
    assert torch.equal(host[:, :, 1000:1700], k.cpu()) and torch.equal(host_t[:, :, :, 1000:1700], k.cpu().mT)
    assert host[:, :, :1000].isnan().all() and host[:, :, 1700:].isnan().all()  # nothing written outside
    back = torch.full((B, H, 700, D), float("nan"), dtype=dtype, device="cuda")
    host_copy(back, host[:, :, 1000:1700])
    assert torch.equal(back, k)


@pytest.mark.cuda
def test_kernel_copies_the_interleaved_store_views_head_by_head():
    """host_k / host_v of the sparse layers' [B, H, N, 2, D] store: the leading dims do not collapse into one
    pitch, so the copy goes one 2D copy per (batch, head); both ways, nothing written outside."""
    N, B, H, D = 3000, 2, 8, 64
    kv = torch.full((B, H, N, 2, D), float("nan"), dtype=torch.bfloat16).pin_memory()
    hk, hv = kv[:, :, :, 0], kv[:, :, :, 1]
    k = torch.randn(B, H, 700, D, device="cuda").to(torch.bfloat16)
    assert rows_plan(hk[:, :, 1000:1700], k) is None
    host_copy(hk[:, :, 1000:1700], k)
    host_copy(kv[:, :, 1700:2400], torch.stack([k, -k], 3))  # the prompt's chunks: one copy of K and V
    torch.cuda.synchronize()
    assert torch.equal(hk[:, :, 1000:1700], k.cpu()) and hv[:, :, 1000:1700].isnan().all()
    assert torch.equal(hv[:, :, 1700:2400], -k.cpu()) and hk[:, :, :1000].isnan().all()
    back = torch.empty_like(k)
    host_copy(back, hv[:, :, 1700:2400])
    assert torch.equal(back, -k)
