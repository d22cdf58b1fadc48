"""Probe: does the 24 GiB-capped tailorkv decode at 128k retry allocations (free cache + cudaMalloc) each step?"""
import sys, torch
mode = sys.argv[1]
orig = torch.cuda.reset_peak_memory_stats
def patched(device=None):
    orig(device)
    print("after prefill: alloc retries", torch.cuda.memory_stats(device)["num_alloc_retries"],
          "reserved GiB", torch.cuda.memory_reserved(device) / 2**30, flush=True)
    if mode == "empty":
        torch.cuda.empty_cache()
        print("emptied: reserved GiB", torch.cuda.memory_reserved(device) / 2**30, flush=True)
torch.cuda.reset_peak_memory_stats = patched
import atexit
atexit.register(lambda: print("at exit: alloc retries", torch.cuda.memory_stats(0)["num_alloc_retries"], flush=True))
sys.argv = ["tailorkv"] + sys.argv[2:]
import cli
cli.main()
