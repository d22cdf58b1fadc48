"""What is live on the GPU at a command's peak: runs a `tailorkv` CLI command with the CUDA caching allocator's
history recorded (python stacks), replays the history to the moment the bytes peak, and prints the blocks live
then, summed by the innermost tailorkv frame that allocated them. Two replays: "allocated" frees a block when
the program drops it (torch.cuda.max_memory_allocated counts this way), "held" only when the allocator may hand
it out again (a block used on another stream waits for that stream's work, as the host learns of it).

    python3 bench/memory_peak.py OUT_DIR bench --model llama-3.1-8b --random-weights --ctx 128k ...

Writes OUT_DIR/memory_peak.txt and OUT_DIR/memory_peak.json (the summary only: the snapshot itself is large).
"""
from __future__ import annotations

import collections
import json
import os
import sys

import torch


def where(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "tailorkv" in name or "/models/" in name or "/engine/" in name or "/ops/" in name:
            tail = "/".join(name.split("/")[-2:])
            return f"{tail}:{f.get('line')} {f.get('name')}"
    return "(outside tailorkv)"


def peak_of(trace: list[dict], free_action: str) -> tuple[int, int, dict]:
    """-> (peak bytes, event index of the peak, {addr: (size, site)} live at it)."""
    live: dict = {}
    now = peak = at = 0
    best: dict = {}
    for i, ev in enumerate(trace):
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            now += ev["size"]
            if now > peak:
                peak, at, best = now, i, dict(live)
        elif act == free_action and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    return peak, at, best


def main() -> None:
    out_dir, args = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    from tailorkv.cli import main as cli
    try:
        cli(args, standalone_mode=False)
    except SystemExit:
        pass
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    gib = 1024 ** 3
    lines, summary = [f"events {len(trace)} (blocks allocated before the recording are not counted)"], {}
    for label, action in (("allocated", "free_requested"), ("held", "free_completed")):
        peak, at, live = peak_of(trace, action)
        by_site = collections.Counter()
        for size, site in live.values():
            by_site[site] += size
        lines += ["", f"{label}: peak {peak / gib:.3f} GiB at event {at}", "GiB live at the peak  site"]
        lines += [f"{b / gib:10.3f}  {s}" for s, b in by_site.most_common(25)]
        summary[label] = {"peak_bytes": peak, "event": at,
                          "by_site": [{"site": s, "bytes": b} for s, b in by_site.most_common()]}
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out_dir, "memory_peak.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "memory_peak.json"), "w") as f:
        json.dump({"events": len(trace), **summary}, f, indent=1)


if __name__ == "__main__":
    main()
