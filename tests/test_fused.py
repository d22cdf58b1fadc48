"""Fused elementwise ops: each torch reference equals the model code it replaces (CPU, bit for bit); each CUDA
kernel equals its reference within the dtype's rounding (GPU). Fresh random inputs per run (the seed is shown beside
a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailorkv.models.config import ModelConfig
from tailorkv.models.llama import MLP, Attention, RMSNorm
from tailorkv.models.rope import Rope
from tailorkv.ops import dispatch, fused_cuda
from tailorkv.ops.fused import add_rms_norm, rms_norm, rope_, silu_mul, silu_mul_halves
from helpers import SEED

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
ROPES = [(64, 1e5, None), (128, 5e5, LLAMA3)]  # SmolLM2, Llama-3.1


def gen(salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + salt)


def randn(*shape, g, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


# ---- references against the plain formulas they replaced in the model (CPU) ----

def norm_formula(x, w, eps):  # models.llama.RMSNorm before the fused ops
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_formula(x, positions, inv_freq):  # models.rope.Rope before the fused ops: fp32 tables, cast, rotate-half
    emb = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[:, :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[:, half:])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 4096])
def test_rms_norm_reference_is_the_formula(dtype, dim):
    g = gen(1)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = randn(dim, g=g, dtype=dtype)
    h, a = randn(2, 37, dim, g=g, dtype=dtype, scale=3), randn(2, 37, dim, g=g, dtype=dtype)
    with torch.inference_mode():
        want = norm_formula(h, norm.weight, 1e-5)
        assert torch.equal(rms_norm(h, norm.weight, 1e-5), want) and torch.equal(norm(h), want)
        res = h.clone()
        y, res_out = add_rms_norm(res, a, norm.weight, 1e-5)
    assert res_out is res and torch.equal(res, h + a) and torch.equal(y, norm_formula(h + a, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,theta,scaling", ROPES)
@pytest.mark.parametrize("start,T", [(0, 1), (5, 37), (131071 - 36, 37), (131071, 1)])
def test_rope_reference_is_the_formula(dtype, head_dim, theta, scaling, start, T):
    g = gen(2)
    cfg = ModelConfig(dim=4 * head_dim, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=8, vocab_size=8,
                      head_dim=head_dim)
    attn = Attention(cfg)
    rope = Rope(head_dim, theta, scaling)
    q = attn.heads(randn(2, T, 4 * head_dim, g=g, dtype=dtype), 4)  # [B, H, T, D] views, as the model makes them
    k = attn.heads(randn(2, T, 2 * head_dim, g=g, dtype=dtype), 2)
    pos = torch.arange(start, start + T)
    with torch.inference_mode():
        want_q, want_k = rope_formula(q, pos, rope.inv_freq), rope_formula(k, pos, rope.inv_freq)
        got_q, got_k = rope(q.clone(), k.clone(), pos)
        only_q, none = rope_(q.clone(), None, pos, rope.inv_freq)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(only_q, want_q) and none is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reference_is_the_formula(dtype):
    g = gen(3)
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=1, n_kv_heads=1, hidden_dim=96, vocab_size=8)
    mlp = MLP(cfg).to(dtype)
    mlp.gate_up_proj.weight.data = randn(192, 64, g=g, dtype=dtype)
    x = randn(2, 37, 64, g=g, dtype=dtype)
    with torch.inference_mode():
        gate_up = mlp.gate_up_proj(x)
        gate, up = gate_up[..., :96], gate_up[..., 96:]
        assert torch.equal(mlp(x), mlp.down_proj(F.silu(gate) * up))
        assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
        assert torch.equal(silu_mul_halves(gate_up), F.silu(gate) * up)


def test_host_tensors_take_the_reference():
    assert all(dispatch.kernel_for(name, torch.zeros(4)) is None
               for name in ("rms_norm", "add_rms_norm", "rope", "silu_mul"))


# ---- kernels against references (GPU) ----

TOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 2.0**-19}  # 2 eps (fp32: 16: sum order)


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None):
    """Every element within the dtype's rounding of the reference, relative to |want| (or to `scale`, the size
    of the terms, where the result may cancel); never NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "NaN in the output"
    size = want.float().abs() if scale is None else scale.float()
    err = (got.float() - want.float()).abs() / size.clamp_min(1e-3)
    assert err.max().item() <= TOL[want.dtype], f"max rel err {err.max().item():.3g} > {TOL[want.dtype]:.3g}"


def pair_size(x: torch.Tensor) -> torch.Tensor:  # |x| + |rotate_half(x)|: the size of rope's two terms
    return x.float().abs() + x.float().abs().roll(x.shape[-1] // 2, -1)


@pytest.fixture
def nan_outputs(monkeypatch):
    """Kernel outputs start as NaN: any element a kernel forgets to write fails the comparison."""
    monkeypatch.setattr(fused_cuda, "_empty",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def chosen(name: str, t: torch.Tensor):
    kern = dispatch.kernel_for(name, t)
    assert kern is not None, f"the {name} kernel did not load (CuPy missing?)"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 4096])
@pytest.mark.parametrize("T", [1, 37])
def test_rms_norm_kernels(dtype, dim, T, nan_outputs):
    g = gen(10)
    w = randn(dim, g=g, dtype=dtype, device="cuda")
    h, a = randn(2, T, dim, g=g, dtype=dtype, device="cuda", scale=3), randn(2, T, dim, g=g, dtype=dtype, device="cuda")
    chosen("rms_norm", h)
    chosen("add_rms_norm", h)
    close(rms_norm(h, w, 1e-5), rms_norm.reference(h, w, 1e-5))
    res, ref_res = h.clone(), h.clone()
    y, res_out = add_rms_norm(res, a, w, 1e-5)
    want_y, _ = add_rms_norm.reference(ref_res, a, w, 1e-5)
    assert res_out is res and torch.equal(res, ref_res)  # the add is exact: bit for bit
    close(y, want_y)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim,theta,scaling", [(9, 3, *ROPES[0]), (32, 8, *ROPES[1])])
@pytest.mark.parametrize("T", [1, 37])
def test_rope_kernel(dtype, hq, hkv, head_dim, theta, scaling, T):
    g = gen(11)
    rope = Rope(head_dim, theta, scaling).cuda()
    chosen("rope", rope.inv_freq)
    for start in (0, 3000, 131071 - T + 1):
        pos = torch.arange(start, start + T, device="cuda")
        # q, k: views into one NaN-padded qkv buffer with the model's [B, T, H, D] -> [B, H, T, D] layout
        buf = torch.full((2, T, hq + hkv + 1, head_dim + 8), float("nan"), dtype=dtype, device="cuda")
        buf[..., :hq + hkv, :head_dim] = randn(2, T, hq + hkv, head_dim, g=g, dtype=dtype, device="cuda")
        q, k = (buf[:, :, :hq, :head_dim].transpose(1, 2), buf[:, :, hq:hq + hkv, :head_dim].transpose(1, 2))
        sq, sk = pair_size(q), pair_size(k)
        want_q, want_k = rope_.reference(q.clone(), k.clone(), pos, rope.inv_freq)
        got_q, got_k = rope_(q, k, pos, rope.inv_freq)
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
        close(got_q, want_q, sq)
        close(got_k, want_k, sk)
        assert buf[..., hq + hkv, :].isnan().all() and buf[..., head_dim:].isnan().all(), "wrote outside q, k"
    # large frequencies turn nearly every pair far from the identity: elements left unwritten would show
    inv = torch.rand(head_dim // 2, generator=g).add(0.5).cuda()
    q = randn(1, hq, T, head_dim, g=g, dtype=dtype, device="cuda")
    k = randn(1, hkv, T, head_dim, g=g, dtype=dtype, device="cuda")
    pos = torch.randint(1, 4096, (T,), generator=g).cuda()
    sq, sk = pair_size(q), pair_size(k)
    want_q, want_k = rope_.reference(q.clone(), k.clone(), pos, inv)
    rope_(q, k, pos, inv)
    close(q, want_q, sq)
    close(k, want_k, sk)
    q = randn(1, hq, T, head_dim, g=g, dtype=dtype, device="cuda")  # q alone (a predicted query)
    sq, (want_q, _) = pair_size(q), rope_.reference(q.clone(), None, pos, inv)
    assert rope_(q, None, pos, inv)[1] is None
    close(q, want_q, sq)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1536, 14336, 100])
@pytest.mark.parametrize("T", [1, 37])
def test_silu_mul_kernel(dtype, hidden, T, nan_outputs):
    g = gen(12)
    gate_up = randn(2, T, 2 * hidden, g=g, dtype=dtype, device="cuda", scale=4)
    gate, up = gate_up[..., :hidden].contiguous(), gate_up[..., hidden:].contiguous()
    chosen("silu_mul", gate)
    want = silu_mul.reference(gate, up)
    close(silu_mul(gate, up), want)
    close(silu_mul_halves(gate_up), want)


@pytest.mark.cuda
def test_unsupported_arguments_fall_back_to_the_reference():
    g = gen(13)
    x, w = randn(3, 100, g=g, dtype=torch.float64, device="cuda"), randn(100, g=g, dtype=torch.float64, device="cuda")
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm.reference(x, w, 1e-5))  # float64
    x, w = randn(3, 36, g=g, dtype=torch.bfloat16, device="cuda"), randn(36, g=g, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm.reference(x, w, 1e-5))  # 36 * 2 bytes: not 16-byte rows
    x, w = randn(3, 128, g=g, dtype=torch.bfloat16, device="cuda")[:, ::2], w.new_ones(64)
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm.reference(x, w, 1e-5))  # not contiguous
    q, k = randn(1, 2, 3, 6, g=g, device="cuda"), randn(1, 1, 3, 6, g=g, device="cuda")
    pos32 = torch.arange(3, dtype=torch.int32, device="cuda")
    inv = torch.rand(3, generator=g).cuda()
    want = rope_.reference(q.clone(), k.clone(), pos32, inv)
    got = rope_(q, k, pos32, inv)  # int32 positions
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
