"""Installing the project adds one import name, `tailorkv`: the wheel holds `tailorkv/` and its dist-info and
nothing else at the top (built offline from a copy of the project, with the venv's setuptools)."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = ["pyproject.toml", "__init__.py", "cli.py", "configs", "engine", "models", "ops"]


def test_the_wheel_installs_only_tailorkv(tmp_path):
    pytest.importorskip("setuptools", minversion="68")
    src = tmp_path / "project"
    src.mkdir()
    for name in PACKAGE:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(path, src / name)
    (src / "src").mkdir()
    os.symlink("..", src / "src" / "tailorkv")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = os.listdir(tmp_path / "dist")
    names = zipfile.ZipFile(tmp_path / "dist" / wheel).namelist()
    top = {n.split("/")[0] for n in names}
    version = wheel.split("-")[1]
    assert top == {"tailorkv", f"tailorkv-{version}.dist-info"}, top
    assert "tailorkv/cli.py" in names and "tailorkv/configs/smollm2-135m.json" in names
    entry = zipfile.ZipFile(tmp_path / "dist" / wheel).read(f"tailorkv-{version}.dist-info/entry_points.txt").decode()
    assert "tailorkv = tailorkv.cli:main" in entry
    # installed, the same: one package and its metadata (and the console script in bin/)
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                          str(tmp_path / "dist" / wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(os.listdir(site)) - {"bin"} == {"tailorkv", f"tailorkv-{version}.dist-info"}
