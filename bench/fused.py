"""Device bench: the fused elementwise kernels of ops/fused.py against the torch code they replace (models/llama.py,
models/rope.py), at the shapes of Llama-3.1-8B and SmolLM2 in bf16. Each op is first checked against its reference
(NaN-free, max error in units of the dtype's rounding, share of bit-exact elements), then captured 32 times in one
CUDA graph and replayed: the per-op time includes the per-node cost a decode step pays.
PYTHONPATH=src python3 bench/fused.py --out DIR   (writes DIR/fused.json; the table comes last)"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tailorkv.models.llama import RMSNorm  # noqa: E402
from tailorkv.models.rope import Rope  # noqa: E402
from tailorkv.ops import dispatch, fused_cuda  # noqa: E402
from tailorkv.ops.fused import add_rms_norm, rms_norm, rope_, silu_mul, silu_mul_halves  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
MODELS = {"llama-3.1-8b": dict(dim=4096, hq=32, hkv=8, hd=128, hidden=14336, theta=5e5, scaling=LLAMA3),
          "smollm2-135m": dict(dim=576, hq=9, hkv=3, hd=64, hidden=1536, theta=1e5, scaling=None)}
DT = torch.bfloat16
ULP = 2.0**-7  # bf16 eps: the gap between 1 and the next value


def graph_us(fn, reps: int, replays: int) -> float:
    """Median time of one fn() over `replays` replays of a graph holding `reps` calls, in microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(10):
        graph.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in ev:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1000 / reps


def compare(got, want, scale=None) -> dict:
    got, want = got.float(), want.float()
    size = (want.abs() if scale is None else scale.float()).clamp_min(1e-3)
    err = ((got - want).abs() / size / ULP).max().item()
    return {"nan": bool(got.isnan().any()), "max_err_ulps": err, "exact": (got == want).float().mean().item()}


def cases(m: dict, T: int):
    """(op name, kernel call, torch-model call, check(), bytes moved per call) for one model shape."""
    g = torch.Generator(device="cuda").manual_seed(T)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(DT)  # noqa: E731
    dim, hq, hkv, hd, hid = m["dim"], m["hq"], m["hkv"], m["hd"], m["hidden"]
    norm = RMSNorm(dim, 1e-5).to("cuda", DT)
    norm.weight.data = r(dim)
    h, a = r(1, T, dim, scale=3), r(1, T, dim)
    h2 = h.clone()
    rope = Rope(hd, m["theta"], m["scaling"]).cuda()
    pos = torch.arange(131072 - T, 131072, device="cuda")
    qkv = r(1, T, hq + 2 * hkv, hd)
    q, k = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:hq + hkv].transpose(1, 2)
    gu = r(1, T, 2 * hid, scale=4)
    gate, up = gu[..., :hid].contiguous(), gu[..., hid:].contiguous()

    def torch_norm(x):  # the torch code the kernel replaces (its reference)
        return rms_norm.reference(x, norm.weight, 1e-5)

    def check_norm():
        return compare(rms_norm(h, norm.weight, 1e-5), torch_norm(h))

    def check_add_norm():
        res = h.clone()
        y, _ = add_rms_norm(res, a, norm.weight, 1e-5)
        want_h = h + a
        return {**compare(y, torch_norm(want_h)), "residual_exact": bool(torch.equal(res, want_h))}

    def torch_rope():
        return rope_.reference(q.clone(), k.clone(), pos, rope.inv_freq)

    def check_rope():
        q1, k1 = q.clone(), k.clone()
        size = torch.cat([(x.float().abs() + x.float().abs().roll(hd // 2, -1)).flatten() for x in (q1, k1)])
        rope_(q1, k1, pos, rope.inv_freq)
        wq, wk = torch_rope()
        return compare(torch.cat([q1.flatten(), k1.flatten()]), torch.cat([wq.flatten(), wk.flatten()]), size)

    def check_silu():
        want = F.silu(gate) * up
        out = compare(silu_mul(gate, up), want)
        return {**out, "halves_max_err_ulps": compare(silu_mul_halves(gu), want)["max_err_ulps"]}

    e = 2
    return [
        ("rms_norm", lambda: rms_norm(h, norm.weight, 1e-5), lambda: torch_norm(h), check_norm, (2 * T + 1) * dim * e),
        ("add_rms_norm", lambda: add_rms_norm(h2, a, norm.weight, 1e-5), lambda: torch_norm(h + a), check_add_norm,
         (4 * T + 1) * dim * e),
        ("rope q+k", lambda: rope_(q, k, pos, rope.inv_freq), torch_rope, check_rope,
         2 * T * (hq + hkv) * hd * e),
        ("silu_mul", lambda: silu_mul(gate, up), lambda: F.silu(gate) * up, check_silu, 3 * T * hid * e),
        ("silu_mul_halves", lambda: silu_mul_halves(gu), lambda: F.silu(gu[..., :hid]) * gu[..., hid:],
         lambda: {}, 3 * T * hid * e),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,2048", help="comma-separated T (1 = decode)")
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    report = {"command": " ".join(sys.argv), "commit": os.environ.get("TAILORKV_COMMIT", commit),
              "gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "results": []}
    try:
        import cupy
        report["cupy"] = cupy.__version__
        report["kernels"] = fused_cuda.attributes(torch.cuda.current_device())
    except Exception as e:  # noqa: BLE001
        report["kernels_error"] = f"{type(e).__name__}: {e}"
    rows = []
    for model, m in MODELS.items():
        for T in (int(t) for t in args.tokens.split(",")):
            for name, kern, ref, check, nbytes in cases(m, T):
                row = {"model": model, "op": name, "T": T}
                try:
                    row["kernel_chosen"] = dispatch.kernel_for(name.split()[0].replace("_halves", ""),
                                                               torch.zeros(1, device="cuda")) is not None
                    row.update(check())
                    row["kernel_us"] = graph_us(kern, args.reps, args.replays)
                    row["torch_us"] = graph_us(ref, args.reps, args.replays)
                    row["kernel_GBps"] = nbytes / row["kernel_us"] / 1e3
                    row["ok"] = row["kernel_chosen"] and not row.get("nan") and row.get("max_err_ulps", 0) <= 2
                except Exception as e:  # noqa: BLE001 -- one failing op must not stop the rest
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=3))
                rows.append(row)
                report["results"] = rows
                with open(os.path.join(args.out, "fused.json"), "w") as f:
                    json.dump(report, f, indent=1)
    per_layer = {"add_rms_norm": 2, "rope q+k": 1, "silu_mul": 1}  # per decoder layer with the ops wired in
    saved = sum(n * (r["torch_us"] - r["kernel_us"]) for r in rows for op, n in per_layer.items()
                if r["model"] == "llama-3.1-8b" and r["T"] == 1 and r["op"] == op and "kernel_us" in r)
    report["llama_8b_decode_saved_us_per_token"] = 32 * saved
    with open(os.path.join(args.out, "fused.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{report['gpu']}  torch {report['torch']}  cupy {report.get('cupy', '-')}  commit {report['commit']}")
    for name, a in report.get("kernels", {}).items():
        print(f"  {name}: {a['num_regs']} registers, {a['local_bytes']} B local")
    print(f"\n{'model':14} {'op':16} {'T':>5} {'kernel us':>10} {'torch us':>9} {'x':>6} {'GB/s':>7} "
          f"{'err ulp':>8} {'exact':>6}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14} {r['op']:16} {r['T']:>5}  FAILED {r['error'][:80]}")
            continue
        print(f"{r['model']:14} {r['op']:16} {r['T']:>5} {r['kernel_us']:>10.2f} {r['torch_us']:>9.2f} "
              f"{r['torch_us'] / r['kernel_us']:>6.1f} {r['kernel_GBps']:>7.0f} {r.get('max_err_ulps', 0):>8.2f} "
              f"{r.get('exact', 1):>6.3f}  {'yes' if r['ok'] else 'NO'}")
    print(f"Llama-3.1-8B decode, 32 layers x (2 add_rms_norm + rope + silu_mul): "
          f"{report['llama_8b_decode_saved_us_per_token']:.0f} us/token saved vs the torch code")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
