"""The machine the other gpu tests ran on, recorded for the card: torch, CUDA, cuDNN, NCCL, the GPU and its
fp32 matmul speed, the libraries opd uses, the float32 matmul (TF32) settings; and the check that the opd
under test is this checkout's (an installed copy elsewhere would test other code)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from .conftest import ROOT, sync

pytestmark = pytest.mark.gpu


def version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_versions(record_property):
    import opd

    record_property("python", platform.python_version())
    record_property("torch", torch.__version__)
    record_property("torch_cuda", torch.version.cuda)
    record_property("cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    record_property("matmul_allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    record_property("float32_matmul_precision", torch.get_float32_matmul_precision())
    for pkg in ("transformers", "peft", "accelerate", "tokenizers", "huggingface_hub", "safetensors"):
        record_property(pkg, version(pkg))
    for pkg in ("math_verify", "datasets", "starlette", "uvicorn"):
        record_property(pkg, version(pkg))
    record_property("opd_path", str(Path(opd.__file__).parent))
    assert Path(opd.__file__).resolve().is_relative_to(ROOT / "src"), f"opd imported from {opd.__file__}"


def test_device(device, record_property):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        record_property("name", p.name)
        record_property("capability", f"{p.major}.{p.minor}")
        record_property("memory_total_GB", round(total / 1e9, 2))
        record_property("memory_free_GB", round(free / 1e9, 2))
        record_property("multiprocessors", p.multi_processor_count)
        record_property("device_count", torch.cuda.device_count())
        record_property("bf16_supported", torch.cuda.is_bf16_supported())
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            record_property("nccl", ".".join(map(str, v)) if isinstance(v, tuple) else str(v))
        if shutil.which("nvidia-smi"):
            q = "name,driver_version,memory.total,clocks.max.sm,power.limit"
            cmd = ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"]
            record_property(
                "nvidia_smi", subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
            )
    n = 512 if device.type == "cpu" else 4096
    x = torch.randn(n, n, device=device)
    x @ x
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        y = x @ x
    sync(device)
    record_property("fp32_matmul_TFLOPs", round(10 * 2 * n**3 / (time.perf_counter() - t) / 1e12, 2))
    assert torch.isfinite(y).all()
