"""Dense causal attention with GQA (no repeat of KV heads), for any query offset; decode attention over a
preallocated buffer with a device-side length (attend_decode, its CUDA kernel in ops/attention_cuda.py), and a
sparse layer's decode attention over its device slots and rows of its pinned host store (sparse_decode_attention,
its CUDA kernel in ops/sparse_attention_cuda.py reads the rows zero-copy inside the attention)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tailorkv.ops import attention_cuda, sparse_attention_cuda
from tailorkv.ops.dispatch import op, register_kernel
from tailorkv.ops.host_gather import gather_rows


# On the H200, cuDNN's fused attention prefills causally at ~600-670 TFLOP/s, twice the flash backend
# (bench/results/2026-11-30-h200-two-streams/sdpa_backends.json); SDPA takes the first backend that fits.
PREFILL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
                     into_q: bool = False) -> torch.Tensor:
    """q [B, Hq, Tq, D] at positions q_offset.., k/v [B, Hkv, Tk, D] at positions 0..Tk-1; Tk = q_offset + Tq.
    A prompt from position 0 is one SDPA call with is_causal (no mask tensor; on the CPU too, where torch's flash
    kernel holds memory to O(T) and runs 1.3-2x faster than query chunks with masks did). into_q: the caller
    reads q no more, so a prompt longer than INTO_Q_BLOCK attends from 0 with its output written over q
    (returned): no output tensor beside it."""
    tq, tk = q.shape[2], k.shape[2]
    if tk != q_offset + tq:
        raise ValueError(f"causal_attention: {tk} keys for {tq} queries from position {q_offset}")
    gqa = q.shape[1] != k.shape[1]
    if into_q and q_offset == 0 and tq > INTO_Q_BLOCK and _blocks_run_here(q, k, v):
        return _causal_over_q(q, k, v)
    if tq == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if q_offset > 0:
        return _attend_after(q, k, v, q_offset)
    with sdpa_kernel(PREFILL_BACKENDS, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def warm_up_prefill(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Runs the prefill's attention paths once on small tensors of these head shapes (one KV head): cuDNN builds
    some of its attention kernels at their first use on a machine (on the H200 1.1 s for the causal one, 3.0 s for
    the blocks over q, then kept in the driver's cache, ~/.nv/ComputeCache), which would otherwise land in a
    first prompt's prefill."""
    g = max(1, heads // max(1, kv_heads))
    for t in (256, INTO_Q_BLOCK + 64):
        q = torch.randn(1, g, t, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(1, 1, t, head_dim, dtype=dtype, device=device) for _ in range(2))
        causal_attention(q, k, v, 0, into_q=True)


INTO_Q_BLOCK = 16384  # query rows per block of a prompt's attention written over q
MERGE_HEADS = 4       # query heads per fp32 merge of a block's two parts (bounds its temporaries)


def _blocks_run_here(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The blocked attention over q runs on the CPU (its fp32 path) and where cuDNN's fused attention with its
    logsumexp takes these tensors (fp16/bf16; tried on their first 8 tokens, causal and not, before q is written:
    a GPU or cuDNN without it keeps the one SDPA call, which picks another backend)."""
    if not q.is_cuda:
        return True
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        for causal in (True, False):
            attention_lse(q[:, :, :8], k[:, :, :8], v[:, :, :8], causal)
    except RuntimeError:
        return False
    return True


def _causal_over_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention from position 0, block by block of INTO_Q_BLOCK queries, each block's output written
    over its rows of q (read by its own attention only). Block [s, e) attends to keys [0, s) without a mask and
    to [s, e) causally; the two parts merge by their logsumexps in fp32. At 128k tokens of an 8B model this
    spares the 1 GiB output tensor that one SDPA call allocates next to q."""
    B, Hq, T, D = q.shape
    for s in range(0, T, INTO_Q_BLOCK):
        e = min(T, s + INTO_Q_BLOCK)
        qb = q[:, :, s:e]
        o_diag, l_diag = attention_lse(qb, k[:, :, s:e], v[:, :, s:e], causal=True)
        if s == 0:
            qb.copy_(o_diag)
            continue
        o_past, l_past = attention_lse(qb, k[:, :, :s], v[:, :, :s], causal=False)
        m = torch.maximum(l_past, l_diag)
        w_past, w_diag = (l_past - m).exp_(), (l_diag - m).exp_()
        total = w_past + w_diag
        w_past, w_diag = (w_past / total).unsqueeze(-1), (w_diag / total).unsqueeze(-1)
        for h in range(0, Hq, MERGE_HEADS):
            hs = slice(h, h + MERGE_HEADS)
            qb[:, hs].copy_(o_past[:, hs].float().mul_(w_past[:, hs]).add_(o_diag[:, hs].float().mul_(w_diag[:, hs])))
    return q


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, Hq, Tq, D] over k, v [B, Hkv, Tk, D] (causal: Tq == Tk, aligned) -> (o in q's dtype,
    logsumexp of the scaled scores [B, Hq, Tq] fp32). cuDNN's fused attention on a GPU in fp16/bf16 (GQA
    native); elsewhere fp32 scores in query chunks of SCORE_BYTES."""
    B, Hq, Tq, D = q.shape
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
        return out[0], out[1].reshape(B, Hq, Tq).float()
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    kf, vf = k.float().transpose(-1, -2), v.float()
    rows = max(1, SCORE_BYTES // (4 * B * Hq * k.shape[2]))
    for s in range(0, Tq, rows):
        e = min(Tq, s + rows)
        scores = _grouped_scores(q, kf, s, e, 0 if causal else None)
        l_part = torch.logsumexp(scores, -1, keepdim=True)
        o[:, :, s:e] = ((scores - l_part).exp_() @ vf).reshape(B, Hq, e - s, D).to(q.dtype)
        lse[:, :, s:e] = l_part.reshape(B, Hq, e - s)
    return o, lse


SCORE_BYTES = 256 << 20  # fp32 scores of one chunk of a later turn's queries


def _attend_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """A later turn: queries at q_offset.. see every earlier key and the new ones causally. GQA by grouping the
    query heads over their KV head (K and V are never repeated per head), fp32 scores and softmax, query chunks
    whose scores stay within SCORE_BYTES. (SDPA with a mask and GQA took its math path on the H200: K and V
    repeated to every head in fp32, 0.69 s for a 23-token turn over 118k tokens.)"""
    b, hq, tq, d = q.shape
    kf = k.float().transpose(-1, -2)
    out = torch.empty_like(q)
    rows = max(1, SCORE_BYTES // (4 * b * hq * k.shape[2]))
    for s in range(0, tq, rows):
        e = min(tq, s + rows)
        n, end_k = e - s, q_offset + e
        probs = _grouped_scores(q, kf[..., :end_k], s, e, q_offset).softmax(-1).to(v.dtype)
        out[:, :, s:e] = _probs_times_values(probs, v[:, :, :end_k]).reshape(b, hq, n, d)
    return out


def _grouped_scores(q: torch.Tensor, kf: torch.Tensor, s: int, e: int, first: int | None) -> torch.Tensor:
    """fp32 scaled scores of queries s..e of q [B, Hq, Tq, D] over kf [B, Hkv, D, Tk] (the keys at positions
    0..Tk-1, transposed), GQA by grouping the query heads over their KV head: [B, Hkv, group * (e - s), Tk], rows
    (head in group, token). first: the position of query 0, each query's later keys masked; None: no mask."""
    b, hq, _, d = q.shape
    hkv, tk = kf.shape[1], kf.shape[-1]
    g = hq // hkv
    scores = torch.matmul(q[:, :, s:e].reshape(b, hkv, g * (e - s), d).float(), kf).mul_(softmax_scale(d))
    if first is not None:
        pos = torch.arange(first + s, first + e, device=q.device)
        seen = torch.arange(tk, device=q.device)[None, :] <= pos[:, None]
        scores.masked_fill_(~seen.repeat(g, 1), float("-inf"))
    return scores


PV_SPLIT = 4096  # keys per partial product of a later turn's probabilities and values


def _probs_times_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs [B, H, R, T] @ v [B, H, T, D] with the T-long reduction split into PV_SPLIT-key parts that run as
    one batched GEMM and are summed in fp32 (few rows and a long T leave one GEMM with a handful of tiles)."""
    B, H, R, T = probs.shape
    m = T // PV_SPLIT
    if m < 2:
        return torch.matmul(probs, v)
    cut = m * PV_SPLIT
    parts = torch.matmul(probs[..., :cut].reshape(B, H, R, m, PV_SPLIT).transpose(2, 3),
                         v[:, :, :cut].reshape(B, H, m, PV_SPLIT, v.shape[-1]))       # [B, H, m, R, D]
    out = parts.float().sum(2)
    if cut < T:
        out += torch.matmul(probs[..., cut:], v[:, :, cut:]).float()
    return out.to(v.dtype)


def attention_with_mask(q, k, v, mask=None):
    """Plain attention over the given keys; mask [.., Tq, Tk] boolean (True = attend) or None."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def group_probs(q: torch.Tensor, k: torch.Tensor, h: int, q_pos0: int) -> torch.Tensor:
    """The attention of the query heads that read KV head h: q [B, Hq, w, D] at positions q_pos0 .. q_pos0 + w - 1
    over k [B, Hkv, L, D] at positions 0 .. L - 1 -> fp32 [B, G, w, L] softmax probabilities, causally masked
    (a later key gets 0). One KV head at a time bounds the temporary (SnapKV's vote, calibration's P)."""
    G, L = q.shape[1] // k.shape[1], k.shape[2]
    logits = (q[:, h * G:(h + 1) * G].float() @ k[:, h:h + 1].float().transpose(-1, -2)) * softmax_scale(q.shape[-1])
    qpos = torch.arange(q_pos0, q_pos0 + q.shape[2], device=k.device)
    future = qpos[:, None] < torch.arange(L, device=k.device)[None, :]
    return torch.softmax(logits.masked_fill(future, float("-inf")), -1)


@op("attend_decode")
def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
                  sm_scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, 1, D]; k, v [B, Hkv, N, D]: a buffer whose first `length` slots hold the keys (the rest is never
    read); length: int64 tensor, 0-dim or [B], on q's device (clamped to [0, N]) -> [B, Hq, 1, D] in q's dtype.
    Scores and softmax in fp32, GQA without repeat_kv; a row of length 0 gives zeros."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    scale = softmax_scale(D) if sm_scale is None else sm_scale
    if not q.is_cuda:  # the length is free to read off the CPU: attend over the slots it covers only
        most = int(length.max().clamp(0, k.shape[2]))
        k, v = k[:, :, :most], v[:, :, :most]
        if most and bool((length >= most).all()):  # every row holds all of them: no masks, no masked copies
            scores = q.float().reshape(B, Hkv, Hq // Hkv, D) @ k.float().transpose(-1, -2) * scale
            return (torch.softmax(scores, -1) @ v.float()).reshape(B, Hq, 1, D).to(q.dtype)
    N = k.shape[2]
    n = length.to(q.device).reshape(-1, 1, 1, 1).expand(B, 1, 1, 1)
    valid = torch.arange(N, device=q.device) < n                                       # [B, 1, 1, N]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    kz = k.float().masked_fill(~valid.transpose(-1, -2), 0.0)
    vz = v.float().masked_fill(~valid.transpose(-1, -2), 0.0)
    scores = (qg @ kz.transpose(-1, -2) * scale).masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, -1).masked_fill(n <= 0, 0.0)                       # length 0: no keys
    return (probs @ vz).reshape(B, Hq, 1, D).to(q.dtype)


register_kernel("attend_decode", lambda: attention_cuda.load(attend_decode.fallback))


@op("sparse_decode_attention")
def sparse_decode_attention(q: torch.Tensor, dev_k: torch.Tensor, dev_v: torch.Tensor,
                            host_k: torch.Tensor | None, host_v: torch.Tensor | None, pos: torch.Tensor | None,
                            position: torch.Tensor, tail_start: torch.Tensor, sink: int, pos_offset: int = 0,
                            sm_scale: float | None = None, rows_gathered: bool = False) -> torch.Tensor:
    """A sparse layer's decode attention (engine/policies/sparse.py) in one op: one fp32 softmax per query head
    over every held key of two sources, GQA without repeat_kv.
    q [B, Hq, 1, D]; dev_k, dev_v [B, Hkv, S + C, D]: device slots, slot s < S (= sink) held iff s <= p, slot
    s >= S held iff s - S <= p - tail_start; position: the new token's position p ([1] or 0-dim int64 tensor),
    tail_start: 0-dim int64 tensor, both on q's device (read there: no sync). pos [B, Hkv, K] int64 (or None:
    no host rows): selected positions, absolute after adding pos_offset; a row is held iff
    S <= pos + pos_offset < tail_start, and then its K and V are row pos + pos_offset of host_k / host_v
    [B, Hkv, N, D] (pinned host memory). Rows that are not held are never read (this reference reads row 0, a
    sink, in their place and zeroes it). Products in the inputs' dtype, softmax in fp32.
    rows_gathered: host_k / host_v [B, Hkv, K, D] hold the selected rows already (row j for pos[..., j], e.g.
    gathered on the copy stream one layer early; on the device or pinned), held as above.
    -> [B, Hq, 1, D] in q's dtype; zeros where no key is held. This reference gathers the rows with gather_rows
    (no sync on a GPU); the kernel reads them inside the attention."""
    B, Hq, _, D = q.shape
    Hkv, SC = dev_k.shape[1], dev_k.shape[2]
    dev = q.device
    p = position.to(dev).reshape(-1)[0]
    ts = tail_start.to(dev).reshape(())
    slots = torch.arange(SC, device=dev)
    valid = torch.where(slots < sink, slots <= p, slots - sink <= p - ts).expand(B, Hkv, SC)
    keys, vals = dev_k, dev_v
    if pos is not None and pos.shape[-1] > 0:
        absolute = pos.to(dev) + pos_offset
        picked = (absolute >= sink) & (absolute < ts)
        if rows_gathered:
            rows_k, rows_v = host_k.to(dev), host_v.to(dev)
        else:
            safe = torch.where(picked, absolute, 0).clamp_(0, host_k.shape[2] - 1)  # row 0 (a sink) stands in
            rows_k, rows_v = gather_rows(host_k, safe, dev), gather_rows(host_v, safe, dev)
        keys = torch.cat([keys, rows_k], 2)
        vals = torch.cat([vals, rows_v], 2)
        valid = torch.cat([valid, picked], 2)
        vals.masked_fill_(~valid[..., None], 0)
    else:
        vals = vals.masked_fill(~valid[..., None], 0)
    # a row that is not held never gets in: its score becomes -inf below, its value row 0 (as 0 * NaN is NaN)
    scale = softmax_scale(D) if sm_scale is None else sm_scale
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    scores = (qg @ keys.transpose(-1, -2)).float().mul_(scale).masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, -1).masked_fill(~valid.any(-1)[:, :, None, None], 0.0)  # nothing held: zeros
    return (probs.to(vals.dtype) @ vals).reshape(B, Hq, 1, D).to(q.dtype)


register_kernel("sparse_decode_attention",
                lambda: sparse_attention_cuda.load(sparse_decode_attention.fallback))
