"""What one step's top-K of a set of score rows leaves for the next step's, so that the kernels need not search
the whole row again: the scoring kernel lists the tokens whose score is at least a row's `threshold` (their
indices and scores, up to `cap`, and how many there were), and the top-K kernel, when the list holds at least
K and at most cap of them, selects among those only. The K largest are then all in the list, so the result is
the same exact top-K as the full search's; otherwise it searches the whole row as before. After each step the
top-K kernel sets the threshold a `margin` below the row's K-th largest score, the margin widened when too few
were listed and narrowed when too many, and clears the count. Threshold and margin are in units of the norm of
the query that scored the row (its heads of the GQA group): the rank-K score scales with it, and so moves far
less from step to step (bench/topk_carry_probe.py: random Llama-3.1-8B at 128k, 5,700 row selections: the
previous step's rank-2K score, so scaled, lists 1.0-4.0 K tokens every time; unscaled, 4% of rows list fewer than
K and 2% more than 4 K).

Only the CUDA kernels read it (the torch references ignore it: the result does not depend on it). A row set
keeps one carry for its lifetime, so that a CUDA graph captures its tensors."""
from __future__ import annotations

import torch

CAP_PER_K = 4   # tokens listed per K at most: the margin aims for 1.25 K to 3 K of them


class TopKCarry:
    def __init__(self, rows: int, k: int, device: torch.device, cap_per_k: int = CAP_PER_K):
        self.rows, self.k = rows, k
        self.cap = -(-cap_per_k * k // 32) * 32
        self.threshold = torch.empty(rows, dtype=torch.float32, device=device)
        self.margin = torch.empty(rows, dtype=torch.float32, device=device)
        self.qnorm = torch.empty(rows, dtype=torch.float32, device=device)   # the scoring query's, per row
        self.count = torch.empty(rows, dtype=torch.int32, device=device)
        self.index = torch.empty(rows, self.cap, dtype=torch.int32, device=device)
        self.score = torch.empty(rows, self.cap, dtype=torch.float32, device=device)
        self.searches = torch.empty(2, dtype=torch.int64, device=device)  # rows searched whole, rows selected
        self.reset()

    def reset(self) -> None:
        """Forget the rows' scores: the next step lists every token (and so searches whole)."""
        self.threshold.fill_(float("-inf"))
        self.margin.zero_()
        self.qnorm.fill_(1.0)
        self.count.zero_()
        self.searches.zero_()

    def device_bytes(self) -> int:
        held = (self.threshold, self.margin, self.qnorm, self.count, self.index, self.score, self.searches)
        return sum(t.numel() * t.element_size() for t in held)

    def fits(self, rows: int, device: torch.device) -> bool:
        return rows == self.rows and self.threshold.device == device
