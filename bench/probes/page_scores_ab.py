"""A/B of quest_page_scores at 128k (8 x 8192 pages, D 128): an older kernel file against the tree's.

    git show 46f3723:ops/page_select_cuda.py > /tmp/psc_old.py
    PYTHONPATH=src python3 bench/probes/page_scores_ab.py /tmp/psc_old.py
"""
import sys, importlib.util, torch
sys.path.insert(0, "bench")
import kernels as K
from tailorkv.ops.page_select import page_scores
from tailorkv.ops import page_select_cuda as new
spec = importlib.util.spec_from_file_location("psc_old", sys.argv[1]); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
torch.manual_seed(0)
Hq, H, P, D = 32, 8, 8192, 128
sets = []
for _ in range(K.n_sets(2 * H * P * D * 2)):
    a, b = K.randn(1, H, P, D, dtype=torch.bfloat16), K.randn(1, H, P, D, dtype=torch.bfloat16)
    sets.append((K.randn(1, Hq, D, dtype=torch.bfloat16), torch.minimum(a, b), torch.maximum(a, b)))
length = torch.tensor([P * 16 - 5], device="cuda")
ref = page_scores.fallback
for name, mod in (("old 46f3723", old), ("new head", new), ("old 46f3723", old), ("new head", new)):
    k = mod.load(ref)
    got, want = k(*sets[0], length, 16), ref(*sets[0], length, 16)
    fin = torch.isfinite(want)
    err = ((got[fin] - want[fin]).abs().max() / want[fin].abs().max()).item()
    ms, mode = K.gpu_time([lambda s=s: k(*s, length, 16) for s in sets])
    print(f"{name:12} {ms*1e3:7.1f} us ({mode}), max rel err {err:.1e}, -inf same {torch.equal(torch.isneginf(got), torch.isneginf(want))}")
