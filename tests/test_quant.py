"""1/2-bit KIVI-style quantization, the packed decode ops and the QuantCache policy (CPU, fp32).

Inputs are random with a fresh seed per run (shown beside a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from helpers import SEED, One

import tailorkv.ops.quant_attention as qa
from tailorkv.engine.cache import LayerSpec
from tailorkv.engine.policies.full import FullCache
from tailorkv.engine.policies.quant import QuantCache
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops.quant import (codes_per_word, dequantize_keys, dequantize_values, pack, quantize_keys,
                       quantize_values, unpack)
from tailorkv.ops.quant_attention import av_quant, qk_quant


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(SEED + zlib.crc32(request.node.name.encode()))


def rand(g, *shape, outliers=True):
    """Gaussian with per-channel magnitudes spread over ~e^±2 (keys have outlier channels)."""
    x = torch.randn(*shape, generator=g)
    if outliers:
        x = x * torch.exp(torch.randn(shape[-1], generator=g))
    return x


def rel_err(a, b):
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "non-finite values"
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# --- packing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("dim", [2, 3])
def test_pack_roundtrip(gen, bits, dim):
    cpw = codes_per_word(bits)
    shape = [2, 3, 4 * cpw, 2 * cpw]
    codes = torch.randint(0, 1 << bits, shape, generator=gen, dtype=torch.uint8)
    words = pack(codes, bits, dim)
    assert words.dtype == torch.int32
    assert words.shape[dim] == shape[dim] // cpw
    assert torch.equal(unpack(words, bits, dim), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_is_lsb_first(bits):
    cpw = codes_per_word(bits)
    top = (1 << bits) - 1
    codes = torch.zeros(1, cpw, dtype=torch.uint8)
    codes[0, 0] = 1
    assert pack(codes, bits, 1).item() == 1
    codes[0, 0], codes[0, cpw - 1] = 0, top
    assert pack(codes, bits, 1).item() == (top << (32 - bits)) - (1 << 32)  # top field, sign bit set
    assert torch.equal(unpack(pack(codes, bits, 1), bits, 1), codes)


# --- quantize / dequantize --------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_key_quant_error_bound(gen, bits):
    B, H, T, D, G = 2, 3, 256, 64, 64
    k = rand(gen, B, H, T, D) * 3 + 1
    k[:, :, :, 5] = 0.75                      # zero-range groups (fp16-exact constant)
    codes, scale, mn = quantize_keys(k, bits, G)
    assert codes.shape == (B, H, T // codes_per_word(bits), D) and codes.dtype == torch.int32
    assert scale.shape == mn.shape == (B, H, T // G, D) and scale.dtype == mn.dtype == torch.float16
    deq = dequantize_keys(codes, scale, mn, bits, G)
    bound = scale.float().repeat_interleave(G, dim=2) / 2
    err = (deq - k).abs()
    assert torch.isfinite(deq).all()
    assert (err <= bound * (1 + 1e-5) + 1e-6 * k.abs()).all(), (err - bound).max()
    assert torch.equal(deq[:, :, :, 5], k[:, :, :, 5])
    # min-max: each group's extremes are (nearly) representable, the scale matches the range
    x = k.reshape(B, H, T // G, G, D)
    rng = (x.amax(3) - x.amin(3)) / ((1 << bits) - 1)
    assert torch.allclose(scale.float(), rng, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("D", [64, 128])
def test_sketch_is_the_key_quantization_packed_per_token(gen, bits, D):
    """quantize_sketch: the same groups, scales, mins and codes as quantize_keys; each token's codes in D / CPW
    words, channel 2j of a word at bits [j*bits, ..) and 2j+1 at [16 + j*bits, ..); any length dequantizes."""
    from tailorkv.ops.quant import dequantize_sketch, quantize_sketch, unpack
    k = rand(gen, 2, 3, 128, D) * 3
    codes, scale, mn = quantize_sketch(k, bits, 64)
    kc, ks, km = quantize_keys(k, bits, 64)
    cpw = codes_per_word(bits)
    assert codes.shape == (2, 3, 128, D // cpw) and torch.equal(scale, ks) and torch.equal(mn, km)
    want = unpack(kc, bits, dim=2).long()                                   # [B, H, T, D] codes
    words = codes.long() & 0xFFFFFFFF
    for j in range(cpw // 2):
        for half in (0, 1):
            got = (words >> (16 * half + bits * j)) & ((1 << bits) - 1)     # [B, H, T, D / cpw]
            assert torch.equal(got, want[..., 2 * j + half::cpw])
    deq = dequantize_keys(kc, ks, km, bits, 64)
    assert torch.equal(dequantize_sketch(codes, scale, mn, bits, 64), deq)
    assert torch.equal(dequantize_sketch(codes[:, :, :100], scale, mn, bits, 64), deq[:, :, :100])


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("D", [64, 128])
def test_value_quant_error_bound(gen, bits, D):
    B, H, T, G = 2, 3, 77, 64
    v = rand(gen, B, H, T, D, outliers=False) * 2 - 0.5
    v[:, :, 3] = -1.25                        # a zero-range token
    codes, scale, mn = quantize_values(v, bits, G)
    assert codes.shape == (B, H, T, D // codes_per_word(bits))
    assert scale.shape == mn.shape == (B, H, T, D // G)
    deq = dequantize_values(codes, scale, mn, bits, G)
    bound = scale.float().repeat_interleave(G, dim=3) / 2
    err = (deq - v).abs()
    assert torch.isfinite(deq).all()
    assert (err <= bound * (1 + 1e-5) + 1e-6 * v.abs()).all(), (err - bound).max()
    assert torch.equal(deq[:, :, 3], v[:, :, 3])
    # one token quantized alone gives the same as within a block
    one = quantize_values(v[:, :, 10:11], bits, G)
    assert torch.equal(one[0], codes[:, :, 10:11]) and torch.equal(one[1], scale[:, :, 10:11])


# --- packed decode ops ------------------------------------------------------------------------------------
GQA = [(4, 4), (8, 2), (9, 3), (32, 8)]


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("bits", [1, 2])
def test_qk_av_quant_match_dequantized_math(gen, monkeypatch, hq, hkv, bits):
    monkeypatch.setattr(qa, "CHUNK", 128)     # exercise the chunk loop
    B, D, T, Tv = 2, 64, 320, 201
    q = rand(gen, B, hq, 1, D, outliers=False)
    kc, ks, km = quantize_keys(rand(gen, B, hkv, T, D), bits, 64)
    vc, vs, vm = quantize_values(rand(gen, B, hkv, Tv, D, outliers=False), bits, 64)
    K = dequantize_keys(kc, ks, km, bits, 64).repeat_interleave(hq // hkv, dim=1)
    V = dequantize_values(vc, vs, vm, bits, 64).repeat_interleave(hq // hkv, dim=1)
    sm = 1 / math.sqrt(D)
    scores = qk_quant(q, kc, ks, km, bits, 64, sm_scale=sm)
    assert scores.shape == (B, hq, 1, T)
    assert rel_err(scores, (q @ K.transpose(-1, -2)) * sm) < 1e-5
    p = torch.softmax(torch.randn(B, hq, 1, Tv, generator=gen) * 3, -1)
    out = av_quant(p, vc, vs, vm, bits, 64)
    assert out.shape == (B, hq, 1, D)
    assert rel_err(out, p @ V) < 1e-5


# --- QuantCache -------------------------------------------------------------------------------------------
R = 128


def make_cache(hq=6, hkv=2, D=64, bits=1, max_len=640, B=1):
    spec = LayerSpec(layer_idx=0, n_heads=hq, n_kv_heads=hkv, head_dim=D, max_len=max_len, batch=B,
                     dtype=torch.float32, device=torch.device("cpu"))
    return One(QuantCache(spec, MethodSettings(method="tailorkv", bits=bits, group=64, residual=R)))


def expected_kv(Kt, Vt, held_before, end, bits):
    """What the cache should see for tokens [0, end) when it held `held_before` tokens before this step:
    keys [0, held//R*R) and values [0, held-R) quantized (built independently from the true K/V)."""
    nk, nv = held_before // R * R, max(0, held_before - R)
    vg = min(64, Kt.shape[-1])
    K = torch.cat([dequantize_keys(*quantize_keys(Kt[:, :, :nk], bits, 64), bits, 64), Kt[:, :, nk:end]], 2)
    V = torch.cat([dequantize_values(*quantize_values(Vt[:, :, :nv], bits, vg), bits, vg), Vt[:, :, nv:end]], 2)
    return K, V


def ref_attention(q, K, V, q_offset):
    """Plain causal softmax attention with repeated KV heads (independent of ops.attention)."""
    g = q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)
    s = q @ K.transpose(-1, -2) / math.sqrt(q.shape[-1])
    qpos = torch.arange(q_offset, q_offset + q.shape[2])[:, None]
    s = s.masked_fill(qpos < torch.arange(K.shape[2])[None, :], float("-inf"))
    return torch.softmax(s, -1) @ V


def run_steps(cache, Kt, Vt, Qt, chunks, bits):
    """Feed tokens in chunks (sizes), checking every output against the independent reference."""
    pos = 0
    for n in chunks:
        held = cache.length
        q, k, v = Qt[:, :, pos:pos + n], Kt[:, :, pos:pos + n], Vt[:, :, pos:pos + n]
        out = cache.attend(q, k, v, pos)
        K, V = expected_kv(Kt, Vt, held, pos + n, bits)
        err = rel_err(out, ref_attention(q, K, V, pos))
        assert err < 1e-5, f"chunk of {n} at {pos}: rel err {err}"
        pos += n
        assert cache.length == pos
        assert cache.held == pos and cache.nkq == pos // R * R and cache.held - cache.nkq == pos % R
        assert cache.nvq == max(0, pos - R)
    return pos


def tokens(gen, hq, hkv, D, T, B=1):
    return rand(gen, B, hq, T, D, outliers=False), rand(gen, B, hkv, T, D), rand(gen, B, hkv, T, D, outliers=False)


@pytest.mark.parametrize("prompt", [1, 63, 127, 128, 129, 200, 321])
@pytest.mark.parametrize("bits", [1, 2])
def test_cache_prefill_then_decode_across_flush(gen, prompt, bits):
    hq, hkv, D = 6, 2, 64
    steps = R - prompt % R + 2                 # always crosses the next key flush
    Qt, Kt, Vt = tokens(gen, hq, hkv, D, prompt + steps)
    cache = make_cache(hq, hkv, D, bits)
    run_steps(cache, Kt, Vt, Qt, [prompt] + [1] * steps, bits)


def test_cache_flush_at_exactly_residual(gen):
    Qt, Kt, Vt = tokens(gen, 4, 4, 64, 130)
    cache = make_cache(4, 4, 64)
    run_steps(cache, Kt, Vt, Qt, [127, 1], bits=1)
    assert cache.nkq == 128 and cache.held == 128 and cache.nvq == 0
    out = cache.attend(Qt[:, :, 128:129], Kt[:, :, 128:129], Vt[:, :, 128:129], 128)
    assert torch.isfinite(out).all()
    assert cache.nkq == 128 and cache.held == 129 and cache.nvq == 1


@pytest.mark.parametrize("hq,hkv,D,B", [(9, 3, 64, 1), (8, 2, 128, 2)])
def test_cache_multi_token_turns(gen, hq, hkv, D, B):
    chunks = [150, 40, 1, 1, 100, 3, 130, 1, 1]
    Qt, Kt, Vt = tokens(gen, hq, hkv, D, sum(chunks), B)
    cache = make_cache(hq, hkv, D, bits=2, max_len=512, B=B)
    run_steps(cache, Kt, Vt, Qt, chunks, bits=2)


def test_cache_long_decode_window_wraps(gen):
    """Many single steps: the value window moves through its buffer several times, keys flush twice."""
    Qt, Kt, Vt = tokens(gen, 6, 2, 64, 450)
    cache = make_cache()
    run_steps(cache, Kt, Vt, Qt, [10] + [1] * 440, bits=1)


def test_cache_reset_truncate_and_limits(gen):
    Qt, Kt, Vt = tokens(gen, 6, 2, 64, 300)
    cache = make_cache(max_len=256)
    run_steps(cache, Kt, Vt, Qt, [200], bits=1)
    cache.truncate(200)                        # no-op
    with pytest.raises(RuntimeError):
        cache.truncate(100)
    with pytest.raises(RuntimeError):          # ContextFull
        cache.attend(Qt[:, :, 200:300], Kt[:, :, 200:300], Vt[:, :, 200:300], 200)
    cache.reset()
    assert cache.length == 0
    run_steps(cache, Kt, Vt, Qt, [129, 1], bits=1)


@pytest.mark.parametrize("prompt,steps,back,ok", [
    (200, 5, 1, True),     # one token past the window: its value is still in the ring's extra slot
    (200, 5, 2, False),    # two: the older one's exact value is gone
    (10, 3, 2, True),      # nothing quantized yet: every value is in the ring
    (127, 1, 1, False),    # the last step quantized the residual keys (nkq = 128): the key is gone
])
def test_cache_truncates_back_by_what_is_still_exact(gen, prompt, steps, back, ok):
    """A chat's stop string over two tokens cuts one: the cache goes back and the steps after it see exactly
    what a cache that never held the cut token sees, across the next key flush and window moves."""
    hq, hkv, D, n = 6, 2, 64, prompt + steps + R + 4
    Qt, Kt, Vt = tokens(gen, hq, hkv, D, n)
    cache = make_cache(hq, hkv, D, 1, max_len=512)
    run_steps(cache, Kt, Vt, Qt, [prompt] + [1] * steps, bits=1)
    at = prompt + steps - back
    if not ok:
        with pytest.raises(RuntimeError, match="cannot be truncated there"):
            cache.truncate(at)
        return
    _, K2, V2 = tokens(gen, hq, hkv, D, n)   # other tokens from the cut on, as the next turn brings
    Kt, Vt = torch.cat([Kt[:, :, :at], K2[:, :, at:]], 2), torch.cat([Vt[:, :, :at], V2[:, :, at:]], 2)
    for pos in range(at, n):
        out = cache.attend(Qt[:, :, pos:pos + 1], Kt[:, :, pos:pos + 1], Vt[:, :, pos:pos + 1], pos)
        K, V = expected_kv(Kt, Vt, pos, pos + 1, 1)
        assert rel_err(out, ref_attention(Qt[:, :, pos:pos + 1], K, V, pos)) < 1e-5, pos
    assert cache.nkq == n // R * R and cache.nvq == n - R


@pytest.mark.parametrize("bits,ratio", [(1, 0.11), (2, 0.17)])
def test_device_bytes_below_full(bits, ratio):
    spec = dict(hq=32, hkv=8, D=128, bits=bits, max_len=32768)
    cache = make_cache(**spec)
    full = One(FullCache(LayerSpec(0, 32, 8, 128, 32768, 1, torch.float16, torch.device("cpu"))))
    fp16_bytes = full.device_bytes()
    assert fp16_bytes == 2 * 8 * 32768 * 128 * 2
    # fp32 residual buffers in this test cache; with fp16 they are half that
    assert cache.device_bytes() < ratio * fp16_bytes, cache.device_bytes() / fp16_bytes


def test_cache_bf16_close_to_fp32(gen):
    """The runtime dtype: a bf16 cache tracks the fp32 one. Inputs are bf16-exact, so both quantize the same
    numbers and only the bf16 output rounding differs."""
    Qt, Kt, Vt = (t.bfloat16().float() for t in tokens(gen, 6, 2, 64, 300))
    caches = [make_cache(), make_cache()]
    spec = caches[1].spec
    caches[1] = One(QuantCache(LayerSpec(0, 6, 2, 64, spec.max_len, 1, torch.bfloat16, spec.device),
                           MethodSettings(bits=1, group=64, residual=R)))
    outs = [[], []]
    for i, (c, dt) in enumerate(zip(caches, (torch.float32, torch.bfloat16))):
        pos = 0
        for n in [200, 1, 1, 50, 1]:
            sl = slice(pos, pos + n)
            outs[i].append(c.attend(Qt[:, :, sl].to(dt), Kt[:, :, sl].to(dt), Vt[:, :, sl].to(dt), pos))
            pos += n
    for a, b in zip(*outs):
        assert b.dtype == torch.bfloat16
        assert rel_err(b.float(), a) < 1e-2


@pytest.mark.parametrize("bits", [1, 2])
def test_cache_quantizes_a_long_prompt_in_parts(gen, monkeypatch, bits):
    """Prompts longer than STORE_CHUNK are quantized a part at a time: the same cache as one pass."""
    from tailorkv.engine.policies import quant
    monkeypatch.setattr(quant, "STORE_CHUNK", 100)  # parts of lcm(R, group) = 128 tokens
    Qt, Kt, Vt = tokens(gen, 6, 2, 64, 600)
    cache = make_cache(6, 2, 64, bits)
    run_steps(cache, Kt, Vt, Qt, [530, 1, 1, 60, 1], bits)
