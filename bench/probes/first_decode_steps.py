"""Where a chat turn's first decode steps spend their time: `tailorkv run`'s path (cap, kernels loaded, one
Engine) with a long first turn, then a short one; each decode step timed alone (synchronized), and each CUDA
graph capture split into its phases (its two eager warm-ups, then the capture).
    PYTHONPATH=src python3 bench/probes/first_decode_steps.py --prompt 118028 --steps 40 --out DIR"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

from tailorkv.engine import cuda_graph
from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import build_cache
from tailorkv.engine.sampling import Sampler, SamplingParams, resolve
from tailorkv.engine.settings import MethodSettings
from tailorkv.engine.ui import load_with_progress, set_memory_limit


class TimedModel:
    """The model, each eager call synchronized and its end time appended to `marks` (a call inside a graph
    capture cannot synchronize: the caller times the capture as a whole); optionally the first call cProfiled."""

    def __init__(self, model, marks: list, profile: bool):
        self.model, self.marks = model, marks
        self.profile = cProfile.Profile() if profile else None

    def __call__(self, *args, **kwargs):
        prof = self.profile if len(self.marks) == 1 else None
        if prof:
            prof.enable()
        out = self.model(*args, **kwargs)
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
        if prof:
            prof.disable()
        return out

    def print_profile(self) -> None:
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(self.profile, stream=buf).sort_stats(key).print_stats(22)
            print(buf.getvalue()[-6000:])


def timed_capture(log, profile_first: bool):
    """DecodeGraphs._capture itself, its eager warm-ups and the capture timed apart."""
    capture = cuda_graph.DecodeGraphs._capture

    def _capture(self, step):
        marks = [time.perf_counter()]
        model, self.model = self.model, TimedModel(self.model, marks, profile_first and not log)
        try:
            graph_and_logits = capture(self, step)
        finally:
            timed, self.model = self.model, model
        torch.cuda.synchronize()
        t = marks + [time.perf_counter()]
        if timed.profile:
            timed.print_profile()
        log.append({"key": repr(step.key)[:160], "warmup1_ms": 1e3 * (t[1] - t[0]),
                    "warmup2_ms": 1e3 * (t[2] - t[1]), "capture_ms": 1e3 * (t[3] - t[2])})
        return graph_and_logits
    return _capture


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--prompt", type=int, default=118028)
    ap.add_argument("--turn", type=int, default=23)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cap", type=float, default=24.0, help="GiB")
    ap.add_argument("--profile-first", action="store_true", help="cProfile the first eager warm-up")
    ap.add_argument("--sampled", type=int, default=0, help="then this many short turns through Engine.generate, "
                    "greedy and with llama.cpp's sampling, with and without writing each token to a file")
    ap.add_argument("--prepare", action="store_true", help="capture the first step's graph after each prefill")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    set_memory_limit(int(a.cap * 2**30), dev)
    captures = []
    cuda_graph.DecodeGraphs._capture = timed_capture(captures, a.profile_first)
    loaded = load_with_progress(a.model, None, True, dev, torch.bfloat16)
    eng = Engine(loaded, build_cache(loaded, MethodSettings("tailorkv"), a.ctx))
    g = torch.Generator().manual_seed(0)
    rows = []

    def turn(name, n):
        ids = torch.randint(0, loaded.cfg.vocab_size, (n,), generator=g).tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = eng.forward(ids)
        torch.cuda.synchronize()
        rows.append({"turn": name, "step": "prefill", "tokens": n, "ms": 1e3 * (time.perf_counter() - t0)})
        if a.prepare:  # what Engine.generate does after its prefill
            t0 = time.perf_counter()
            eng.runner.prepare_decode()
            torch.cuda.synchronize()
            rows.append({"turn": name, "step": "prepare", "ms": 1e3 * (time.perf_counter() - t0),
                         "captured": bool(captures) and captures[-1].get("at") is None})
            if captures:
                captures[-1].setdefault("at", f"turn {name} prepare")
        for i in range(a.steps):
            tok = int(logits[0].argmax())
            before = len(captures)
            t0 = time.perf_counter()
            logits = eng.forward([tok])
            torch.cuda.synchronize()
            rows.append({"turn": name, "step": i, "ms": 1e3 * (time.perf_counter() - t0),
                         "captured": len(captures) > before, "length": eng.cache.length})
    turn("1", a.prompt)
    turn("2", a.turn)
    generated = []
    sink = open(os.devnull, "w")
    for r in range(a.sampled):
        for name, params in (("greedy", SamplingParams()), ("sampled", resolve({"seed": r})[0])):
            for write in (False, True):
                eng.sampler = Sampler(params, dev)
                ids = torch.randint(0, loaded.cfg.vocab_size, (a.turn,), generator=g).tolist()
                on_token = (lambda t: bool(sink.write(f"{t} ") and sink.flush())) if write else None
                _, st = eng.generate(ids, 32, on_token)
                generated.append({"round": r, "sampling": name, "write": write, "prefill_s": st.prefill_s,
                                  "decode_ms_per_token": 1e3 * st.decode_s / max(1, st.new_tokens)})
    res = {"commit": os.environ.get("TAILORKV_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(dev),
           "args": vars(a), "steps": rows, "captures": captures,
           "generate": generated}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "first_decode_steps.json"), "w") as f:
        json.dump(res, f, indent=1)
    for t in ("1", "2"):
        dec = [r for r in rows if r["turn"] == t and r["step"] not in ("prefill", "prepare")]
        prep = [r for r in rows if r["turn"] == t and r["step"] == "prepare"]
        if prep:
            print(f"turn {t}: prepare_decode after the prefill {prep[0]['ms']:.0f} ms")
        cap = [r for r in dec if r["captured"]]
        steady = sorted(r["ms"] for r in dec if not r["captured"])
        print(f"turn {t}: {len(dec)} steps, {sum(r['ms'] for r in dec):.0f} ms in all; {len(cap)} captures "
              f"({sum(r['ms'] for r in cap):.0f} ms); the others median {steady[len(steady) // 2]:.2f} ms, "
              f"max {steady[-1]:.2f}")
        print("   first steps (ms):", " ".join(f"{r['ms']:.1f}{'*' if r['captured'] else ''}" for r in dec[:12]))
    for x in generated:
        print(f"generate round {x['round']} {x['sampling']:7s} write={x['write']!s:5s}: "
              f"{x['decode_ms_per_token']:.2f} ms/token")
    for c in captures:
        print(f"capture: warm-up {c['warmup1_ms']:.0f} + {c['warmup2_ms']:.0f} ms, capture {c['capture_ms']:.0f} ms; "
              f"{c['key']}")


if __name__ == "__main__":
    main()
