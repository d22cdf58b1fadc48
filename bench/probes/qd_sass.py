"""The 1/2-bit decode attention's partial kernel compiled for sm_90 on any machine, GPU or not: registers, spills and
the instruction mix of its main loop (the loop with the most HMMAs in the SASS), for counting a variant's
instructions before a device call. Needs nvcc, ptxas, cicc, cuobjdump and nvdisasm; without a CUDA toolkit, NVIDIA's
pip wheels hold them:

    pip install --target ~/cuda13 nvidia-cuda-nvcc==13.0.* nvidia-nvvm==13.0.* nvidia-cuda-crt==13.0.* \\
        nvidia-cuda-runtime==13.0.* nvidia-cuda-cccl==13.0.* nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm

    CUDA_HOME=~/cuda13/nvidia/cu13 PYTHONPATH=src python bench/probes/qd_sass.py [--bits 1] [--minb 4] [VARIANT.cu]

VARIANT.cu replaces ops/quant_decode.cu (as in qd_ab.py). Static counts: a branch taken in some groups only (the
partial copy of the last groups, the ring's rows, the softmax's rescale) counts as if always taken."""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

from tailorkv.ops import quant_decode_cuda

ALU = {"LOP3", "ISETP", "PRMT", "IADD3", "LEA", "SHF", "FMNMX", "SEL", "FSEL", "VIMNMX", "MOV", "VIADD", "PLOP3",
       "FSETP"}


def tool(name: str) -> str:
    home = os.environ.get("CUDA_HOME")
    path = os.path.join(home, "bin", name) if home else shutil.which(name)
    if not path or not os.path.exists(path):
        sys.exit(f"error: {name} not found: set CUDA_HOME to a CUDA 12.8+/13 toolkit (see this file's docstring)")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", nargs="?", help="a quant_decode.cu to compile instead of the repo's")
    ap.add_argument("--bits", type=int, default=1, choices=(1, 2))
    ap.add_argument("--minb", type=int, default=None, help="resident blocks per SM (default: the launcher's)")
    a = ap.parse_args()
    minb = a.minb or quant_decode_cuda.BLOCKS_PER_SM[a.bits]
    src = quant_decode_cuda.source(a.bits, 128, 4, 1, torch.bfloat16, torch.bfloat16,
                                   quant_decode_cuda.TOKENS_PER_WARP, minb)
    if a.variant:
        with open(os.path.join(os.path.dirname(quant_decode_cuda.__file__), "quant_decode.cu")) as f:
            repo = f.read()
        with open(a.variant) as f:
            src = src.replace(repo, f.read())
    nvcc = tool("nvcc")
    home = os.path.dirname(os.path.dirname(nvcc))
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        with open(cu, "w") as f:
            f.write(src)
        env = dict(os.environ, PATH=os.path.dirname(nvcc) + os.pathsep + os.environ.get("PATH", ""))
        build = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", f"-I{home}/include", f"-I{home}/include/cccl",
                                "-Xptxas", "-v", "-o", cubin, cu], capture_output=True, text=True, env=env)
        if build.returncode:
            sys.exit(build.stderr)
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, env=env,
                              check=True).stdout
    info = build.stderr.split("quant_attn_partial", 2)[-1]
    regs = re.search(r"Used (\d+) registers", info).group(1)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups()
    body = sass.split("Function : quant_attn_partial", 1)[1].split("Function :", 1)[0]
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    best = []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:`\()?(?:0x)?([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= addr and int(m.group(1), 16) in index:
            loop = [t for _, t in ins[index[int(m.group(1), 16)]:i + 1]]
            if sum("HMMA" in t for t in loop) > sum("HMMA" in t for t in best):
                best = loop
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)
    alu = sum(n for op, n in ops.items() if op in ALU)
    print(f"{a.bits}-bit, {minb} blocks per SM: {regs} registers, spills {spill[0]} / {spill[1]} bytes "
          f"(stores / loads); main loop {len(best)} instructions, {alu} on the integer ALU, {ops['HMMA']} HMMA")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(24)))


if __name__ == "__main__":
    main()
