"""`streamingllm`: attention sinks plus a sliding window (StreamingLLM, Xiao et al. 2024). The device keeps
the first `settings.sink` tokens and the most recent `settings.budget - settings.sink` tokens; every token in
between is evicted for good. Prefill (and any multi-token step) attends exactly over what is held plus the new
tokens (causal among the new ones); then the new tokens are stored and the window slides.

Layout: one buffer of `budget` slots (the context's length when that is shorter), preallocated. Slots [0, sink)
hold the sinks; slots [sink, budget) are a ring of the recent tokens (`head` is the next slot to write, `n_rec` how
many are held). Invariant: while the ring is not full its tokens sit in slots [sink, sink + n_rec) and head ==
n_rec, so the held tokens are always slots [0, n_sink + n_rec). Decode keys are order-free (RoPE is already applied), so the ring needs no mask.

Positions: we cache post-RoPE keys, so every key keeps its ORIGINAL position. The original StreamingLLM
re-assigns positions within the cache (a query sees keys at 0..budget-1); with sink + recent within the model's
context the difference is small. Equals `full` while length <= budget.

With `settings.free_generated` the window holds prompt tokens only (those of multi-token steps): every token
decoded since is kept beside it and attended on top; the next multi-token step moves them into the window.

A decode step is graph-safe (without free_generated): plan picks the token's slot and the held count after it on
the host and hands them to the device (and saves the ring slot the token evicts, for abort); run stores the token
and attends over a bucket of slots with a device-side length; commit advances the counters. With free_generated
the decoded tokens grow a list, so its steps run eagerly.
"""
from __future__ import annotations

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings
from tailorkv.engine.step import bucket_for
from tailorkv.ops.attention import attend_decode, attention_with_mask, causal_attention
from tailorkv.ops.kv_store import store_kv


class StreamingCache(LayerCache):
    name = "streamingllm"
    selects_tokens = True

    def __init__(self, spec: LayerSpec, settings: MethodSettings):
        super().__init__(spec)
        # a context shorter than the budget never evicts: its slots are enough (the ring keeps at least one)
        self.budget = min(settings.budget, spec.max_len)
        self.sink = min(settings.sink, self.budget - 1)
        self.cap = self.budget - self.sink  # recent tokens kept
        shape = (spec.batch, spec.n_kv_heads, self.budget, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros_like(self.k)
        self.free_generated = settings.free_generated
        self.graph_safe = not self.free_generated
        self.slot = torch.zeros(1, dtype=torch.long, device=spec.device)   # a decode step's slot and held count
        self.count = torch.zeros((), dtype=torch.long, device=spec.device)
        # the token a decode step evicts, kept for abort: taken by the step's first run only (`fresh`, set by plan)
        self.saved = torch.zeros(2, *shape[:2], 1, shape[3], dtype=spec.dtype, device=spec.device)
        self.fresh = torch.zeros((), dtype=torch.bool, device=spec.device)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.seen = 0     # tokens stored so far (the ring's positions follow it)
        self.n_sink = 0   # sink tokens held (< sink only while length < sink)
        self.n_rec = 0    # recent tokens held in the ring
        self.head = 0     # next ring slot to write
        self.gen_k = self.gen_v = None  # free_generated: tokens decoded since the last multi-token step

    @property
    def held(self) -> int:
        return self.n_sink + self.n_rec

    def positions(self) -> torch.Tensor:
        """Original position of the token in each held slot [0, held) (tests, debugging)."""
        ring = torch.arange(self.n_rec)
        oldest = (self.head - self.n_rec) % self.cap
        ring_pos = self.seen - self.n_gen - self.n_rec + (ring - oldest) % self.cap
        return torch.cat([torch.arange(self.n_sink), ring_pos])

    @property
    def n_gen(self) -> int:
        return 0 if self.gen_k is None else self.gen_k.shape[2]

    def plan(self, step):
        if step.decode and self.free_generated:  # what abort restores: run appends to the decoded tokens
            self._undo = (self.seen, self.gen_k, self.gen_v)
            self.last = {"tokens_attended": self.held + self.n_gen + 1}
            return None
        if not step.decode:
            self.last = {"tokens_attended": self.held + self.n_gen + step.n}
            return None
        if self.n_sink < self.sink:
            slot, after = self.n_sink, (self.n_sink + 1, self.n_rec, self.head)
        else:
            slot, after = self.sink + self.head, (self.n_sink, min(self.cap, self.n_rec + 1), (self.head + 1) % self.cap)
        self._evicts = self.n_sink == self.sink and self.n_rec == self.cap  # the ring is full: its oldest goes
        if self._evicts:
            self.fresh.fill_(True)
        self._slot, self._after = slot, after
        held = after[0] + after[1]
        self.slot.fill_(slot)
        self.count.fill_(held)
        self._bucket = bucket_for(held, self.budget)
        self.last = {"tokens_attended": held}
        return self._bucket, self._evicts  # an evicting step's graph must save the slot (run's _keep_evicted)

    def run(self, q, k, v, step):
        if step.decode and not self.free_generated:  # device work only: the counters move in commit
            if self._evicts:
                self._keep_evicted()
            store_kv(self.k, self.v, self.slot, k, v)
            n = self._bucket
            return attend_decode(q, self.k[:, :, :n], self.v[:, :, :n], self.count)
        if step.decode:
            self.gen_k = k if self.gen_k is None else torch.cat([self.gen_k, k], 2)
            self.gen_v = v if self.gen_v is None else torch.cat([self.gen_v, v], 2)
            n = self.held
            out = attention_with_mask(q, torch.cat([self.k[:, :, :n], self.gen_k], 2),
                                      torch.cat([self.v[:, :, :n], self.gen_v], 2))
        else:
            self._fold_generated()
            n = self.held
            kk = torch.cat([self.k[:, :, :n], k], 2) if n else k
            vv = torch.cat([self.v[:, :, :n], v], 2) if n else v
            out = causal_attention(q, kk, vv, n)
            self._store(k, v)
        self.seen = step.end
        return out

    def _keep_evicted(self) -> None:
        """Copy the slot's token to `saved` on the step's first run only (device work, no host reads)."""
        for i, buf in enumerate((self.k, self.v)):
            self.saved[i].copy_(torch.where(self.fresh, buf.index_select(2, self.slot), self.saved[i]))
        self.fresh.fill_(False)

    def commit(self, step) -> None:
        if step.decode and not self.free_generated:
            self.n_sink, self.n_rec, self.head = self._after
            self.seen = step.end

    def _fold_generated(self) -> None:
        """The decoded tokens join the window (in order), before a multi-token step's tokens."""
        if self.gen_k is not None:
            gk, gv = self.gen_k, self.gen_v
            self.gen_k = self.gen_v = None
            self._store(gk, gv)

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append new tokens: sinks first, then the ring (only the last `cap` of a long block survive)."""
        s = min(k.shape[2], self.sink - self.n_sink)
        if s > 0:
            self.k[:, :, self.n_sink:self.n_sink + s] = k[:, :, :s]
            self.v[:, :, self.n_sink:self.n_sink + s] = v[:, :, :s]
            self.n_sink += s
        m = k.shape[2] - max(s, 0)
        if m <= 0:
            return
        keep = min(m, self.cap)
        rk, rv = k[:, :, -keep:], v[:, :, -keep:]
        first = (self.head + m - keep) % self.cap
        a = min(keep, self.cap - first)  # slots up to the end of the ring, then wrap to its start
        lo = self.sink + first
        self.k[:, :, lo:lo + a], self.v[:, :, lo:lo + a] = rk[:, :, :a], rv[:, :, :a]
        self.k[:, :, self.sink:self.sink + keep - a] = rk[:, :, a:]
        self.v[:, :, self.sink:self.sink + keep - a] = rv[:, :, a:]
        self.head = (self.head + m) % self.cap
        self.n_rec = min(self.cap, self.n_rec + m)

    def abort(self, step) -> None:
        """A decode step wrote its token's slot (evicting the ring's oldest when full): put that back."""
        if not step.decode:
            return super().abort(step)
        if self.free_generated:
            self.seen, self.gen_k, self.gen_v = self._undo
        elif self._evicts:  # only where this step's run took the copy: `fresh` still set = the run never came
            for i, buf in enumerate((self.k, self.v)):
                buf.index_copy_(2, self.slot, torch.where(self.fresh, buf.index_select(2, self.slot), self.saved[i]))
            self.fresh.fill_(False)

    def truncate(self, length: int) -> None:
        """Forget the newest tokens. Only possible while all of them are still held; afterwards the recent
        window is shorter than `cap` until new tokens refill it."""
        if length >= self.seen:
            return
        if length == 0:
            self.reset()
            return
        if self.n_gen:  # decoded tokens are the newest: drop from them first
            gen_start = self.seen - self.n_gen
            keep = max(0, length - gen_start)
            self.gen_k, self.gen_v = (self.gen_k[:, :, :keep], self.gen_v[:, :, :keep]) if keep else (None, None)
            self.seen = max(length, gen_start)
            if length >= self.seen:
                return
        oldest = self.seen - self.n_rec  # position of the oldest recent token held
        if length < oldest and oldest != self.n_sink:
            raise RuntimeError(f"streamingllm cache already evicted tokens before position {oldest}: cannot "
                               f"go back to {length}; start a new chat (/reset)")
        keep = max(0, length - oldest)
        if keep:  # compact the surviving recents to the start of the ring, oldest first
            slots = self.sink + (self.head - self.n_rec + torch.arange(keep, device=self.k.device)) % self.cap
            self.k[:, :, self.sink:self.sink + keep] = self.k[:, :, slots].clone()
            self.v[:, :, self.sink:self.sink + keep] = self.v[:, :, slots].clone()
        self.n_rec, self.head = keep, keep % self.cap
        self.n_sink = min(self.n_sink, length)
        self.seen = length

    def device_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
