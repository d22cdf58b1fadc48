"""Kernels against their torch references (the dispatch rule on CPU; the kernels themselves on a CUDA GPU).

Inputs are random with a fresh seed per run (shown beside a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

from helpers import SEED, One

from tailorkv.ops import dispatch
from tailorkv.ops.host_gather import gather_rows


def test_rule_keeps_the_reference_for_host_tensors(monkeypatch):
    calls = []
    monkeypatch.setitem(dispatch._LOADERS, "probe_op", lambda: (lambda *a: calls.append(a) or "kernel"))

    @dispatch.op("probe_op")
    def probe(x):
        return "reference"

    assert probe(torch.zeros(3)) == "reference"  # plain host memory: the GPU cannot read it
    assert calls == []
    monkeypatch.setenv("TAILORKV_KERNELS", "0")
    assert probe(torch.zeros(3)) == "reference"


def test_calls_a_kernel_hands_to_its_reference_are_counted(monkeypatch):
    class OnGPU:  # stands in for a GPU tensor the kernel takes (fp32) or not (fp64)
        is_cuda = True

        def __init__(self, dtype):
            self.dtype = dtype

    @dispatch.op("probe_counted")
    def probe(x):
        return "reference"

    def loader():
        return lambda x: "kernel" if x.dtype == torch.float32 else probe.fallback(x)

    monkeypatch.setitem(dispatch._LOADERS, "probe_counted", loader)
    monkeypatch.setattr(dispatch, "gpu_readable", lambda t: True)
    monkeypatch.setattr(dispatch, "FALLBACKS", collections.Counter())
    assert probe(OnGPU(torch.float32)) == "kernel" and dispatch.FALLBACKS == {}
    assert probe(OnGPU(torch.float64)) == "reference" and dispatch.FALLBACKS == {"probe_counted": 1}
    assert probe.reference(OnGPU(torch.float64)) == "reference" and dispatch.FALLBACKS == {"probe_counted": 1}


def test_a_kernel_that_cannot_load_warns_once_and_the_reference_serves(monkeypatch):
    class OnGPU:  # stands in for a CUDA tensor: the rule only asks where it lives
        is_cuda = True

    def loader():
        raise ModuleNotFoundError("No module named 'cupy'")

    monkeypatch.setitem(dispatch._LOADERS, "probe_missing", loader)
    monkeypatch.setattr(dispatch, "_FAILED", set())
    with pytest.warns(RuntimeWarning, match="probe_missing: the CUDA kernel did not load .*cupy"):
        assert dispatch.kernel_for("probe_missing", OnGPU()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.kernel_for("probe_missing", OnGPU()) is None  # remembered: no second warning


def test_preload_loads_every_enabled_kernel_at_once(monkeypatch):
    """preload: the kernels load side by side (two that wait for each other), a failing one is remembered as
    absent with its warning, a switched-off one is left alone, and the first call then finds them loaded."""
    import importlib
    import pkgutil
    import sys
    import threading
    import types
    for info in pkgutil.iter_modules(importlib.import_module("tailorkv.ops").__path__):
        importlib.import_module(f"tailorkv.ops.{info.name}")      # every real kernel registered before the swap
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    both = threading.Barrier(2, timeout=10)
    loads = []

    def loader(tag):
        def load():
            loads.append(tag)
            if tag == "bad":
                raise RuntimeError("nvrtc: error")
            both.wait()                                           # raises if the other never loads beside it
            return lambda *a: tag
        return load

    monkeypatch.setattr(dispatch, "_LOADERS", {t: loader(t) for t in ("a", "b", "bad", "off")})
    monkeypatch.setattr(dispatch, "_KERNELS", {})
    monkeypatch.setattr(dispatch, "_FAILED", set())
    monkeypatch.setenv("TAILORKV_KERNELS_OFF", "off")
    with pytest.warns(RuntimeWarning, match="bad: the CUDA kernel did not load"):
        assert dispatch.preload(threads=3) == 2
    assert sorted(loads) == ["a", "b", "bad"] and dispatch._FAILED == {"bad"}

    class OnGPU:
        is_cuda = True
    assert dispatch.kernel_for("a", OnGPU())() == "a" and dispatch.kernel_for("bad", OnGPU()) is None
    assert sorted(loads) == ["a", "b", "bad"]                     # nothing loaded twice
    monkeypatch.setattr(dispatch, "_KERNELS", {})
    monkeypatch.setitem(sys.modules, "cupy", None)                # no CuPy: preload loads nothing
    assert dispatch.preload() == 0 and sorted(loads) == ["a", "b", "bad"]


def test_compile_module_builds_a_source_once_however_many_threads_ask(monkeypatch):
    import sys
    import threading
    import time
    import types
    from concurrent.futures import ThreadPoolExecutor
    from tailorkv.ops import cuda_launch
    built = []

    class RawModule:
        def __init__(self, code):
            self.code = code

        def compile(self):
            built.append(self.code)
            time.sleep(0.05)                                   # long enough for the other threads to arrive

    device = types.SimpleNamespace(id=0)
    fake = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(Device=lambda: device))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda_launch, "_MODULES", {})
    start = threading.Barrier(8)

    def ask(i):
        start.wait()
        return cuda_launch.compile_module("src A" if i % 2 else "src B")

    with ThreadPoolExecutor(8) as pool:
        mods = list(pool.map(ask, range(8)))
    assert sorted(built) == ["src A", "src B"]
    assert len({id(m) for m in mods[1::2]}) == 1 and len({id(m) for m in mods[::2]}) == 1 and mods[0] is not mods[1]
    device.id = 1                                              # another device: its own module
    assert cuda_launch.compile_module("src A") is not mods[1] and built.count("src A") == 2


def test_gather_rows_reference_writes_into_out():
    g = torch.Generator().manual_seed(SEED + 1)
    host = torch.randn(2, 3, 50, 8, generator=g)
    idx = torch.randint(0, 50, (2, 3, 7), generator=g)
    out = torch.full((2, 3, 7, 8), float("nan"))
    got = gather_rows(host, idx, torch.device("cpu"), out=out)
    assert got is out
    want = torch.stack([torch.stack([host[b, h, idx[b, h]] for h in range(3)]) for b in range(2)])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="out is"):
        gather_rows(host, idx, torch.device("cpu"), out=torch.empty(2, 3, 6, 8))


@pytest.mark.parametrize("view", ["padded rows", "a slice of the positions"])
def test_gather_rows_reference_reads_views(view):
    """Rows of a view: one whose (B, H, N) dims still flatten (rows wider than X) and one whose do not."""
    g = torch.Generator().manual_seed(SEED + 2)
    base = torch.randn(2, 3, 60, 16, generator=g)
    host = base[..., :8] if view == "padded rows" else base[:, :, 10:50, 4:12]
    idx = torch.randint(0, host.shape[2], (2, 3, 9), generator=g)
    want = torch.stack([torch.stack([host[b, h, idx[b, h]] for h in range(3)]) for b in range(2)])
    assert torch.equal(gather_rows(host, idx, torch.device("cpu")), want)


def test_gather_rows_reference_takes_e4m3_rows():
    """An 8-bit K^T store's rows (engine/policies/kt_store.py): torch's CPU gather has no e4m3."""
    g = torch.Generator().manual_seed(SEED + 3)
    base = torch.randn(2, 3, 16, 60, generator=g)
    host = base.to(torch.float8_e4m3fn)[:, :, :, 5:45]          # channel-major, a slice of the positions
    idx = torch.randint(0, 16, (2, 3, 4), generator=g)
    want = gather_rows(base[:, :, :, 5:45], idx, torch.device("cpu")).to(torch.float8_e4m3fn)
    got = gather_rows(host, idx, torch.device("cpu"))
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_gather_rows_kernel_equals_reference(dtype):
    g = torch.Generator().manual_seed(SEED)
    B, H, N, D = 2, 3, 1000, 64
    host = torch.randn(B, H, N, D, generator=g).to(dtype).pin_memory()
    host_t = host.transpose(2, 3).contiguous().pin_memory()  # channel-major, like the sparse store's K^T
    kernel = dispatch.kernel_for("gather_rows", host, torch.zeros(1, device="cuda"))
    assert kernel is not None, "the gather kernel did not load (CuPy missing?)"
    for src, n_idx in ((host, 37), (host[:, :, 5:905], 300), (host_t[:, :, :, 7:700], 12), (host_t, 64)):
        idx = torch.randint(0, src.shape[2], (B, H, n_idx), generator=g).cuda()
        got = gather_rows(src, idx, torch.device("cuda"))
        want = gather_rows.reference(src, idx.cpu(), torch.device("cpu"))
        assert got.is_cuda and got.shape == want.shape and got.dtype == dtype
        bits = lambda t: t.cpu().view(torch.uint8)  # noqa: E731  (e4m3 has no torch.equal)
        assert torch.equal(bits(got), bits(want))  # a copy: bit-exact
        out = torch.full(want.shape, float("nan"), device="cuda").to(dtype)
        assert kernel(src, idx, torch.device("cuda"), out=out) is out
        assert torch.equal(bits(out), bits(want))


@pytest.mark.cuda
@pytest.mark.parametrize("blocks", [0, 3, 8])
def test_gather_rows_kernel_copies_long_rows(blocks):
    """Rows of >= THREADS * UNROLL words (the K^T rows at long contexts): one block per row, or the loop kernel
    on `blocks` blocks."""
    g = torch.Generator().manual_seed(SEED + 1)
    host = torch.randn(2, 3, 16, 20000, generator=g).to(torch.bfloat16).pin_memory()
    kernel = dispatch.kernel_for("gather_rows", host, torch.zeros(1, device="cuda"))
    for src in (host, host[:, :, :, 3:19999]):  # 16-byte words; 2-byte words from an odd start
        idx = torch.randint(0, 16, (2, 3, 5), generator=g).cuda()
        want = gather_rows.reference(src, idx.cpu(), torch.device("cpu"))
        out = torch.full(want.shape, float("nan"), device="cuda").to(torch.bfloat16)
        assert kernel(src, idx, torch.device("cuda"), out=out, blocks=blocks) is out
        assert torch.equal(out.cpu(), want)


@pytest.mark.cuda
@pytest.mark.parametrize("blocks", [1, 5, 64])
def test_gather_rows_kernel_copies_short_rows_on_any_grid(blocks, monkeypatch):
    """Short rows on MAX_BLOCKS blocks, as bench/kernels.py and bench/ab_patch.py set it: fewer blocks loop more,
    more than needed are cut."""
    from tailorkv.ops import host_gather_cuda
    monkeypatch.setattr(host_gather_cuda, "MAX_BLOCKS", blocks)
    g = torch.Generator().manual_seed(SEED + 2)
    host = torch.randn(1, 8, 3000, 128, generator=g).to(torch.bfloat16).pin_memory()
    kernel = dispatch.kernel_for("gather_rows", host, torch.zeros(1, device="cuda"))
    idx = torch.randint(0, 3000, (1, 8, 211), generator=g).cuda()
    want = gather_rows.reference(host, idx.cpu(), torch.device("cpu"))
    out = torch.full(want.shape, float("nan"), device="cuda").to(torch.bfloat16)
    assert kernel(host, idx, torch.device("cuda"), out=out) is out
    assert torch.equal(out.cpu(), want)


def test_the_short_rows_one_pass_grid_covers_every_word_once(monkeypatch):
    """The loop kernel's grid before MAX_BLOCKS caps it, also the count bench/kernels.py times the gather on."""
    from tailorkv.ops import host_gather_cuda as hg
    per_block = hg.THREADS * hg.UNROLL
    assert [hg.one_pass_blocks(i) for i in (1, per_block, per_block + 1, 7 * per_block)] == [1, 1, 2, 7]
    assert hg.one_pass_blocks(hg.THREADS * 8, unroll=8) == 1 and hg.one_pass_blocks(hg.THREADS * 8, unroll=2) == 4
    monkeypatch.setattr(hg, "UNROLL", 1)  # as bench/ab_patch.py sets it for a process
    assert hg.one_pass_blocks(per_block) == per_block // hg.THREADS


@pytest.mark.cuda
def test_sparse_decode_with_kernels_equals_reference(monkeypatch):
    from tailorkv.engine.cache import LayerSpec
    from tailorkv.engine.policies.sparse import SparseOffloadCache
    from tailorkv.engine.settings import MethodSettings
    spec = LayerSpec(1, 9, 3, 64, 600, 1, torch.float32, torch.device("cuda"))
    s = MethodSettings(method="tailorkv", sink=4, recent=8, budget=40, channels=8)
    outs = {}
    for kernels in ("1", "0"):
        monkeypatch.setenv("TAILORKV_KERNELS", kernels)
        gg = torch.Generator().manual_seed(SEED + 2)
        cache = One(SparseOffloadCache(spec, s))
        q, k, v = (torch.randn(1, h, 500, 64, generator=gg).cuda() for h in (9, 3, 3))
        cache.attend(q, k, v, 0)
        steps = []
        for t in range(500, 540):
            q, k, v = (torch.randn(1, h, 1, 64, generator=gg).cuda() for h in (9, 3, 3))
            steps.append(cache.attend(q, k, v, t))
        outs[kernels] = torch.cat(steps, 2)
    assert torch.isfinite(outs["1"]).all()
    # the kernels sum in another order (approx_scores) and return the chosen set in index order (topk_tokens),
    # so the attended rows come in another order: equal up to fp32 rounding (on random fp32 data no score lands
    # within rounding of the k-th)
    torch.testing.assert_close(outs["1"], outs["0"], rtol=1e-4, atol=1e-5)
