"""`snapkv`: keep the prompt tokens that the prompt's last queries attend to (SnapKV, Li et al. 2024).

Prefill attends exactly. Then, if the prompt is longer than `settings.budget`, the last w = `snap_window`
queries (the observation window) vote: softmax(q K^T / sqrt(d)) over the prompt with the causal mask, summed
over the window's queries and over the query heads of each KV head's GQA group, max-pooled along the tokens
(kernel `snap_pool`, stride 1, same padding). Per KV head the top (budget - w) tokens before the window are
kept, plus the window itself. Decode attends over the kept tokens and appends every generated token.
Prompts within the budget are kept whole (equals `full`).

A later multi-token step (a second chat turn) attends over what is held plus its own tokens (causal among
them) and then compresses again: candidates are everything held plus the new tokens, the observation window is
the last min(w, T) new tokens, and the same budget applies. So after each turn at most `budget` tokens are
held, plus that turn's generated tokens.

Device buffer: allocated at the first prefill, never per token: min(P, budget) + (max_len - P) slots for a
prompt of P tokens (the kept prompt plus room to generate up to max_len). Later turns never need more: after a
turn ending at length L at most budget + (max_len - L) slots are used. `pos` keeps each slot's original
position. `truncate` can only forget tokens appended since the last compression.

A decode step is graph-safe: plan makes room and hands the token's slot and the held count to the device (a
reallocated buffer changes the step's key, so no graph of the old one replays), run stores the token and attends
over a bucket of slots with a device-side length, commit counts it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings
from tailorkv.engine.step import bucket_for
from tailorkv.ops.attention import attend_decode, causal_attention, group_probs
from tailorkv.ops.kv_store import store_kv


def snap_scores(q_win: torch.Tensor, k: torch.Tensor, pool: int) -> torch.Tensor:
    """q_win [B, Hq, w, D]: the last w queries, at key positions L-w .. L-1 of k [B, Hkv, L, D].
    Returns fp32 [B, Hkv, L-w]: the window's attention to each earlier token, summed over the window and the
    GQA group, max-pooled along tokens."""
    B, H, n = q_win.shape[0], k.shape[1], k.shape[2] - q_win.shape[2]
    out = torch.empty(B, H, n, dtype=torch.float32, device=k.device)
    for h in range(H):
        out[:, h] = group_probs(q_win, k, h, n)[..., :n].sum((1, 2))
    if pool > 1:
        out = F.max_pool1d(out, pool, stride=1, padding=pool // 2)[..., :n]
    return out


class SnapKVCache(LayerCache):
    name = "snapkv"
    selects_tokens = True
    graph_safe = True

    def __init__(self, spec: LayerSpec, settings: MethodSettings):
        super().__init__(spec)
        self.budget, self.window, self.pool = settings.budget, settings.snap_window, settings.snap_pool
        self.k = self.v = self.pos = None  # allocated at the first prefill
        self.slot = torch.zeros(1, dtype=torch.long, device=spec.device)   # a decode step's slot and held count
        self.count = torch.zeros((), dtype=torch.long, device=spec.device)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.seen = 0   # tokens stored so far
        self.n = 0      # slots held
        self.base = 0   # `seen` at the last compression: tokens from here on are held in order at the tail

    def _ensure(self, slots: int) -> None:
        """Make the buffers at least `slots` long, keeping what is held."""
        if self.k is not None and self.k.shape[2] >= slots:
            return
        s = self.spec
        k = torch.zeros(s.batch, s.n_kv_heads, slots, s.head_dim, dtype=s.dtype, device=s.device)
        v = torch.zeros_like(k)
        pos = torch.zeros(s.batch, s.n_kv_heads, slots, dtype=torch.long, device=s.device)
        if self.n:
            k[:, :, :self.n], v[:, :, :self.n], pos[:, :, :self.n] = self.held()
        self.k, self.v, self.pos = k, v, pos

    def held(self):
        """(K, V, positions) of the held slots: [B, H, n, D] x2 and [B, H, n]."""
        return self.k[:, :, :self.n], self.v[:, :, :self.n], self.pos[:, :, :self.n]

    def plan(self, step):
        self.last = {"tokens_attended": self.n + step.n}
        if not step.decode:
            return None
        self._ensure(self.n + 1 + self.spec.max_len - step.end)
        self.slot.fill_(self.n)
        self.count.fill_(self.n + 1)
        self._bucket = bucket_for(self.n + 1, self.k.shape[2])
        return self._bucket, self.k.data_ptr()

    def run(self, q, k, v, step):
        T, end = step.n, step.end
        new_pos = step.positions.expand(k.shape[0], k.shape[1], T)
        if step.decode:  # device work only: the count moves in commit
            store_kv(self.k, self.v, self.slot, k, v)
            self.pos.index_copy_(2, self.slot, new_pos)
            n = self._bucket
            return attend_decode(q, self.k[:, :, :n], self.v[:, :, :n], self.count)
        kh, vh, ph = self.held() if self.n else (k[:, :, :0], v[:, :, :0], new_pos[..., :0])
        kk, vv = (torch.cat([kh, k], 2), torch.cat([vh, v], 2)) if self.n else (k, v)
        out = causal_attention(q, kk, vv, self.n)
        total = self.n + T
        if total <= self.budget:
            self._ensure(total + self.spec.max_len - end)
            self._append(k, v, new_pos)
        else:
            self._compress(q[:, :, -min(self.window, T):], kk, vv, torch.cat([ph, new_pos], 2), end)
        self.seen = end
        return out

    def commit(self, step) -> None:
        if step.decode:
            self.n += 1
            self.seen = step.end

    def abort(self, step) -> None:
        if not step.decode:
            return super().abort(step)  # a decode step wrote only its slot beyond the held ones

    def _append(self, k, v, pos) -> None:
        T = k.shape[2]
        self.k[:, :, self.n:self.n + T], self.v[:, :, self.n:self.n + T] = k, v
        self.pos[:, :, self.n:self.n + T] = pos
        self.n += T

    def _compress(self, q_win, kk, vv, pp, end: int) -> None:
        """Keep the top (budget - w) of kk's tokens before the window (by snap_scores) plus the window."""
        w = q_win.shape[2]
        n = kk.shape[2] - w
        top = snap_scores(q_win, kk, self.pool).topk(self.budget - w, dim=-1).indices.sort(-1).values
        idx = torch.cat([top, torch.arange(n, n + w, device=kk.device).expand(*top.shape[:2], w)], -1)
        gather = idx.unsqueeze(-1).expand(-1, -1, -1, kk.shape[3])
        ks, vs, ps = kk.gather(2, gather), vv.gather(2, gather), pp.gather(2, idx)
        self.n = 0
        self._ensure(self.budget + self.spec.max_len - end)
        self._append(ks, vs, ps)
        self.base = end

    def truncate(self, length: int) -> None:
        if length >= self.seen:
            return
        if length == 0:
            self.reset()
        elif length >= self.base:
            self.n -= self.seen - length
            self.seen = length
        else:
            raise RuntimeError(f"snapkv cache compressed the context at position {self.base}: cannot go back "
                               f"to {length}; start a new chat (/reset)")

    def device_bytes(self) -> int:
        if self.k is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))
