"""The ``gpu`` tests' device and size, and who runs them.

A ``gpu`` test runs only when the run asks for it (``-m gpu``): the README's command, and any run on a GPU
machine that does not ask, leave it out. Asked for, it runs on CUDA, or on the CPU at small shapes under
``OPD_GPU_DRY_RUN=1``; otherwise it is skipped, saying so. The tests record what they measure with
``record_property`` (name, value): benchmarks/gpu_check.py puts those into the card.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

DRY_RUN = os.environ.get("OPD_GPU_DRY_RUN") == "1"
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "src" / "opd" / "assets" / "demo"


# a parametrization the CPU dry run leaves out: the dry run is there to run each test's code once, and these
# differ from the one it runs in their options or inputs only (which the CPU suite tests), not in that code
NOT_IN_DRY_RUN = pytest.mark.skipif(DRY_RUN, reason="the CPU dry run runs one of these: same test code, other options")


def pytest_collection_modifyitems(config, items):
    asked = "gpu" in (config.getoption("markexpr") or "")
    here = Path(__file__).parent
    if not asked:
        # not asked for: out of the run, as "-m 'not slow'" leaves the slow tests out
        gone = [it for it in items if here in Path(it.path).parents]
        if gone:
            config.hook.pytest_deselected(items=gone)
            items[:] = [it for it in items if here not in Path(it.path).parents]
        return
    if not DRY_RUN and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA GPU (OPD_GPU_DRY_RUN=1 runs the gpu tests on the CPU, small)")
        for it in items:
            if "gpu" in it.keywords:
                it.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda, or the CPU in the dry run."""
    return torch.device("cpu" if DRY_RUN else "cuda")


@pytest.fixture(scope="session")
def small() -> bool:
    """Small shapes and batches (the CPU dry run)."""
    return DRY_RUN


def benchmark(name: str):
    """A module of benchmarks/ whose builders a test reuses (bench_losses, bench_decode)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@pytest.fixture(autouse=True)
def device_math():
    """torch's process-wide math switches as they were before each test: ``opd train`` turns TF32 on and
    cuDNN attention off for its process, and the loss tests hold float32 to TF32-off tolerances."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.get_float32_matmul_precision(),
    )
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.backends.cuda.enable_cudnn_sdp(saved[2])
    torch.set_float32_matmul_precision(saved[3])
