import os

import pytest
import torch

from helpers import SEED

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_report_header(config):
    return f"random inputs: TAILORKV_SEED={SEED} (set it to replay this run's inputs)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        report.sections.append(("random inputs", f"replay with TAILORKV_SEED={SEED}"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fp32_matmul_precision_kept():
    """Kernel tests compare with fp32 torch references: a test (or a library it imports) that switches fp32
    matmuls to TF32 would loosen every reference after it. Such a test fails here, and the setting is restored."""
    before = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    yield
    after = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    if after != before:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cuda.matmul.allow_tf32 = before[1]
        pytest.fail(f"the test changed torch's fp32 matmul precision (precision, allow_tf32): {before} -> {after}")
