"""host_empty: the host stores that kernels read in place (managed memory kept on the host)."""
import gc

import pytest
import torch

from tailorkv.ops import dispatch, host_memory
from tailorkv.ops.host_copy import host_copy
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.host_memory import gpu_readable, host_empty, managed_bytes


def test_without_cuda_a_store_is_plain_host_memory():
    t = host_empty((2, 3, 4), torch.bfloat16, torch.device("cpu"), managed=True)
    assert t.shape == (2, 3, 4) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert not gpu_readable(t)


@pytest.mark.cuda
def test_managed_store_is_read_and_written_in_place():
    B, H, N, X = 1, 4, 5000, 256
    before = managed_bytes()
    store = host_empty((B, H, N, X), torch.bfloat16, torch.device("cuda"), managed=True)
    assert managed_bytes() - before == store.numel() * 2, "expected a managed store"
    assert store.device.type == "cpu" and gpu_readable(store) and gpu_readable(store[:, 2, 4000:])
    assert not gpu_readable(store.clone())
    assert (store == 0).all()                                   # zeroed where it was first touched, the host
    src = torch.randn(B, H, N, X, generator=torch.Generator().manual_seed(0)).bfloat16()
    store.copy_(src)                                            # written by the CPU
    idx = torch.randint(0, N, (B, H, 900), device="cuda")
    out = torch.full((B, H, 900, X), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert dispatch.kernel_for("gather_rows", store, idx) is not None, "the gather kernel was not chosen"
    gather_rows(store, idx, torch.device("cuda"), out=out)      # read by the GPU, zero-copy
    assert torch.equal(out.cpu(), gather_rows.reference(src, idx.cpu(), torch.device("cpu")))
    k = torch.randn(B, H, 700, X, device="cuda").bfloat16()
    host_copy(store[:, :, 1000:1700], k)                        # written by the GPU (a 2D copy)
    torch.cuda.synchronize()
    assert torch.equal(store[:, :, 1000:1700], k.cpu()) and torch.equal(store[:, :, :1000], src[:, :, :1000])
    del store
    gc.collect()
    assert managed_bytes() == before                            # freed with its last tensor


@pytest.mark.cuda
def test_pinned_unless_asked_and_allowed(monkeypatch):
    before = managed_bytes()
    t = host_empty((4, 8), torch.float32, torch.device("cuda"))
    assert t.is_pinned() and gpu_readable(t) and managed_bytes() == before
    monkeypatch.setattr(host_memory, "MANAGED", False)
    t = host_empty((4, 8), torch.float32, torch.device("cuda"), managed=True)
    assert t.is_pinned() and gpu_readable(t) and managed_bytes() == before


@pytest.mark.cuda
def test_pinned_where_managed_stores_would_pass_the_devices_free_memory(monkeypatch):
    before = managed_bytes()
    monkeypatch.setattr(host_memory, "device_free_bytes", lambda index: before + 4 * 8 * 4 - 1)
    t = host_empty((4, 8), torch.float32, torch.device("cuda"), managed=True)
    assert t.is_pinned() and gpu_readable(t) and managed_bytes() == before
    monkeypatch.setattr(host_memory, "device_free_bytes", lambda index: before + 4 * 8 * 4)
    t = host_empty((4, 8), torch.float32, torch.device("cuda"), managed=True)
    assert managed_bytes() == before + t.numel() * 4


@pytest.mark.cuda
def test_free_memory_under_a_cap_is_what_the_cap_leaves():
    """Under torch's per-process memory fraction (--gpu-mem-limit), a store larger than the cap leaves is pinned."""
    import subprocess
    import sys
    code = ("import torch; from tailorkv.ops.host_memory import device_free_bytes, host_empty, managed_bytes; "
            "total = torch.cuda.mem_get_info(0)[1]; torch.cuda.set_per_process_memory_fraction(0.01, 0); "
            "x = torch.empty(int(0.004 * total), dtype=torch.uint8, device='cuda'); "
            "free = device_free_bytes(0); reserved = torch.cuda.memory_reserved(0); "
            "assert 0 < free <= int(0.01 * total) - reserved, (free, reserved); "
            "t = host_empty((free // 2 + 2,), torch.int16, torch.device('cuda'), managed=True); "
            "assert t.is_pinned() and managed_bytes() == 0, 'managed past the cap'; "
            "t = host_empty((free // 4,), torch.int16, torch.device('cuda'), managed=True); "
            "assert managed_bytes() == t.numel() * 2, 'pinned under the cap'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.cuda
@pytest.mark.parametrize("sm_writes", [True, False])
def test_device_rows_into_a_managed_store_by_the_sms_or_the_dma(sm_writes, monkeypatch):
    """host_copy into a managed store: the prompt's chunks (K and V interleaved, [B, H, m, 2, D] into the middle of
    [B, H, N, 2, D]), one head's K rows (per-head copies), and rows that are not whole 16-byte words (the DMA);
    each equal to the source, nothing outside written, whichever path writes them."""
    from tailorkv.ops import cuda_launch
    from tailorkv.ops import host_copy as host_copy_module
    monkeypatch.setattr(host_copy_module, "SM_WRITES", sm_writes)
    launched, launch = [], cuda_launch.launch
    monkeypatch.setattr(cuda_launch, "launch", lambda *a, **kw: launched.append(a) or launch(*a, **kw))
    B, H, N, D = 2, 8, 3000, 64
    kv = host_empty((B, H, N, 2, D), torch.bfloat16, torch.device("cuda"), managed=True)
    assert host_memory.is_managed(kv[:, :, 5:]) and not host_memory.is_managed(kv.clone())
    kv.fill_(float("nan"))
    k = torch.randn(B, H, 700, D, device="cuda").bfloat16()
    host_copy(kv[:, :, 1000:1700], torch.stack([k, -k], 3))
    host_copy(kv[:, :, 1700:2400, 0], k)                        # host_k's rows, head by head
    odd = torch.randn(B, H, 5, 3, device="cuda").bfloat16()     # 6-byte rows: no 16-byte words
    host_copy(kv[:, :, 2400:2405, 0, :3], odd)
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :, 1000:1700, 0], k.cpu()) and torch.equal(kv[:, :, 1000:1700, 1], -k.cpu())
    assert torch.equal(kv[:, :, 1700:2400, 0], k.cpu()) and kv[:, :, 1700:2400, 1].isnan().all()
    assert torch.equal(kv[:, :, 2400:2405, 0, :3], odd.cpu()) and kv[:, :, 2400:2405, 0, 3:].isnan().all()
    assert kv[:, :, :1000].isnan().all() and kv[:, :, 2405:].isnan().all()
    assert len(launched) == (1 + B * H if sm_writes else 0)   # the chunk in one launch, host_k's rows per head


@pytest.mark.cuda
def test_a_managed_store_as_the_first_cuda_work_of_a_process():
    """host_empty before anything else in the process has touched the device (no context yet) is still managed."""
    import subprocess
    import sys
    code = ("import torch; from tailorkv.ops.host_memory import host_empty, managed_bytes; "
            "t = host_empty((4, 1024), torch.bfloat16, torch.device('cuda'), managed=True); "
            "assert managed_bytes() == t.numel() * 2, 'pinned, not managed'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
