"""The pipelined, graphed decode against the synchronous eager reference: the same greedy tokens?
For each (model, method): one cache decodes through the engine's path (CUDA graphs, the copy stream's
prefetch), another eagerly on one stream; both prefill the same prompt and decode N greedy steps. Then the path
runs again fed the reference's tokens, so its logits compare step by step (bit-equal, or how far off), and a
token difference reports the reference's top-2 margin there. --paths adds the mixed paths (eager with the
copy stream, graphs on one stream) to tell a stream race from a graph's numerics. --reference-kernels-off runs the
reference with those kernels off (their torch references or cuBLAS serve), to compare a new kernel's path with
the one it replaced.
    PYTHONPATH=src python3 bench/decode_equivalence.py --model smollm2-135m --ctx 4096 --steps 256 --out DIR
    PYTHONPATH=src python3 bench/decode_equivalence.py --model llama-3.1-8b --random-weights --ctx 32768 ..."""
from __future__ import annotations

import argparse
import contextlib
import os

import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.results import environment, write_json
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model


PATHS = {"eager+sync": (False, False), "graph+overlap": (True, True), "eager+overlap": (False, True), "graph+sync": (True, False)}


def greedy(loaded, settings, prompt, steps, max_len, graph: bool, overlap: bool, force=None):
    """Greedy tokens and each step's fp32 logits; `force` (tokens) feeds those instead of the argmax, so two
    paths can be compared step by step on the same inputs."""
    cache = build_cache(loaded, settings, max_len, overlap=overlap)
    runner = Runner(loaded.model, cache, use_cuda_graph=graph)
    logits = [runner.prefill(prompt)[0].float().clone()]
    toks = [int(logits[-1].argmax())]
    for i in range(steps):
        feed = toks[-1] if force is None else force[i]
        logits.append(runner.decode(torch.tensor([[feed]], device=prompt.device))[0].float().clone())
        toks.append(int(logits[-1].argmax()))
    return toks, torch.stack(logits)


@contextlib.contextmanager
def kernels_off(names: str):
    """TAILORKV_KERNELS_OFF=names while inside (the dispatch rule reads it at every call)."""
    old = os.environ.get("TAILORKV_KERNELS_OFF")
    if names:
        os.environ["TAILORKV_KERNELS_OFF"] = names
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TAILORKV_KERNELS_OFF", None)
        else:
            os.environ["TAILORKV_KERNELS_OFF"] = old


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--methods", default="full,tailorkv")
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--select", default="channels", help="tailorkv's token selection: channels or sketch")
    ap.add_argument("--sketch-bits", type=int, default=2)
    ap.add_argument("--predict-ahead", type=int, default=1)
    ap.add_argument("--paths", default="graph+overlap", help="compared with --reference: " + ",".join(PATHS))
    ap.add_argument("--reference", default="eager+sync", choices=list(PATHS))
    ap.add_argument("--reference-kernels-off", default="", help="comma-separated op names (e.g. linear,store_kv)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    loaded = load_model(args.model, random_weights=args.random_weights, device=args.device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    n_prompt = args.ctx - args.steps - 16
    prompt = torch.randint(0, min(loaded.cfg.vocab_size, 32000), (1, n_prompt), generator=g).to(args.device)
    rows = []
    for method in args.methods.split(","):
        s = MethodSettings(method=method, bits=args.bits,
                           **({"select": args.select, "sketch_bits": args.sketch_bits,
                               "predict_ahead": args.predict_ahead} if method == "tailorkv" else {}))
        with kernels_off(args.reference_kernels_off):
            ref, ref_logits = greedy(loaded, s, prompt, args.steps, args.ctx, *PATHS[args.reference])
        reference = args.reference + (f" (kernels off: {args.reference_kernels_off})"
                                      if args.reference_kernels_off else "")
        for path in args.paths.split(","):
            graph, overlap = PATHS[path]
            got, _ = greedy(loaded, s, prompt, args.steps, args.ctx, graph, overlap)
            # the same path fed the reference's tokens: are its logits bit-equal step by step, or how far off?
            _, forced = greedy(loaded, s, prompt, args.steps, args.ctx, graph, overlap, force=ref[:-1])
            diff = (forced - ref_logits).abs().amax(-1)
            rel = diff / ref_logits.abs().amax(-1)
            top2 = ref_logits.topk(2, -1).values
            first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            first_logit = next((i for i, d in enumerate(diff.tolist()) if d > 0), None)
            rows.append({"model": loaded.name, "method": method, "select": s.select, "sketch_bits": s.sketch_bits,
                         "predict_ahead": s.predict_ahead, "path": path, "ctx": args.ctx,
                         "steps": args.steps, "equal": ref == got, "first_difference": first,
                         "tokens": len(ref), "first_logit_difference": first_logit,
                         "max_logit_difference": diff.max().item(), "reference": reference,
                         "max_relative_logit_difference": rel.max().item(),
                         "relative_logit_difference_first_steps": rel[:8].tolist(),
                         "margin_at_first_difference": None if first is None else
                         (top2[first, 0] - top2[first, 1]).item()})
            print(f"{loaded.name} {method} ({s.select}) ctx {args.ctx} {path} vs {reference}: {args.steps} greedy steps "
                  + ("identical" if ref == got else f"DIFFER from step {first} (reference's top-2 margin "
                     f"there {rows[-1]['margin_at_first_difference']:.3g})")
                  + f"; logits on the reference's tokens: first differ at step {first_logit}, "
                  f"max |diff| {diff.max().item():.3g} (relative to max |logit| {rel.max().item():.2e}; first "
                  f"steps {' '.join(f'{x:.1e}' for x in rel[:6].tolist())})")
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"equivalence-{loaded.name}-{args.ctx}.json"),
               {"env": environment(torch.device(args.device)), "rows": rows})


if __name__ == "__main__":
    main()
