"""Mixed precision: float32 master weights, the transformer body computed in bfloat16.

``--dtype`` names the dtype the student *computes* in. With ``--dtype bfloat16`` a trained student
keeps float32 weights, gradients and AdamW state (the masters) and runs its decoder (every
transformer block) under ``torch.autocast`` to bfloat16, as Hugging Face's Trainer (``bf16=True``)
and verl's FSDP policy do. Pure bfloat16 weights are not offered: an AdamW update smaller than half
a weight's bfloat16 spacing (about 1e-4 at magnitude 0.02, so every update at lr 1e-6) rounds
away and the weight never moves (AReaL measured this, areal-project/AReaL#1292). The memory route
for a big student is LoRA (``--lora-r``), whose frozen base stays in the compute dtype while the
adapter, the only thing trained, gets float32 (peft's default).

Why only the decoder: the head and everything opd computes from the final hidden states (the
losses, the rollout's and the trainer's log-probs, top-K, diagnostics) then run in float32, so the
sampler's log-probs and the loss's are the same computation, and the losses keep their documented
float32 policy. The decoder's final norm returns float32 hidden states (the residual stream stays
float32 under autocast), which the head multiplies by the float32 head weight.

On CUDA two process-wide settings come with it (:func:`configure_device_math`): TF32 matmuls for the
float32 ones left (the head, the losses; ``--no-tf32`` keeps them exact), and the cuDNN attention
backend of ``scaled_dot_product_attention`` switched off. The latter is the cause of the bfloat16
step-0 NaN seen on an H200 (torch 2.11): cuDNN's SDPA backward returns NaN gradients for
bfloat16/float16 inputs with an explicit attention mask when a query row's logsumexp is very low
(pytorch/pytorch#196678, huggingface/trl#7181), and every left-padded row of a rollout batch is a
fully masked query row. Float32 never takes the cuDNN path, which is why float32 trained. The
flash and memory-efficient kernels serve bfloat16 instead.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, TypeVar

import torch

from opd.errors import UserError

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASTER_DTYPE = "float32"
Module = TypeVar("Module", bound=torch.nn.Module)


def trained_weights_dtype(dtype: str, lora: bool = False) -> str:
    """The dtype a student that trains is loaded in: float32 masters; with LoRA its frozen base stays in
    the compute dtype ``dtype`` (only the adapter trains, and peft gives it float32)."""
    return dtype if lora else MASTER_DTYPE


def compute_in(model: Module, dtype: str) -> Module:
    """Run ``model``'s decoder under autocast to ``dtype`` from now on (nothing to do for float32).

    The decoder's own ``forward`` is wrapped on the instance, so every caller (opd's sampler, the
    loss's ``final_hidden``, a causal LM's own forward, peft's wrapper around it, evaluation) gets
    it; the device type is read at call time, so the model may move after this. Returns ``model``."""
    if dtype == "float32":
        return model
    decoder = model.get_decoder()  # type: ignore[operator]
    if getattr(decoder, "_opd_compute_dtype", None) == dtype:
        return model
    forward = decoder.forward
    autocast_dtype = COMPUTE_DTYPES[dtype]

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        device_type = next(decoder.parameters()).device.type
        with torch.autocast(device_type, dtype=autocast_dtype):
            return forward(*args, **kwargs)

    decoder.forward = autocast_forward
    decoder._opd_compute_dtype = dtype
    return model


def configure_device_math(device: torch.device, dtype: str, tf32: bool | None, command: str) -> None:
    """Process-wide math settings for a run on ``device`` (see the module docstring).

    ``tf32``: None is on for CUDA; True on a CPU is ignored with a note (a config file may be shared
    between a GPU machine and a laptop). bfloat16 on a CPU without bfloat16 matrix instructions gets a
    note naming the cost."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32 is not False
        torch.backends.cudnn.allow_tf32 = tf32 is not False
        torch.backends.cuda.enable_cudnn_sdp(False)
        return
    if tf32:
        print(
            f"{command}: --tf32 ignored: TF32 is a mode of NVIDIA GPUs' matmuls, and this run is on the CPU",
            file=sys.stderr,
        )
    if dtype == "bfloat16" and not cpu_has_bfloat16():
        print(
            f"{command}: this CPU has no bfloat16 matrix instructions (AVX512-BF16 or AMX); torch emulates "
            "them, and a bfloat16 step can take several times a float32 one: --dtype float32 is faster here",
            file=sys.stderr,
        )


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX tiles)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def saved_dtype(dtype: str, lora: bool = False) -> torch.dtype | None:
    """The dtype a trained model's ``final/`` is written in: the --dtype asked for, which for a mixed-precision
    run is not its float32 masters' (None: the weights are already in it, or a LoRA adapter, which stays
    float32 as peft keeps it)."""
    return None if lora or dtype == MASTER_DTYPE else COMPUTE_DTYPES[dtype]


def engine_dtype(dtype: str) -> torch.dtype | None:
    """The dtype a rollout engine with weights of its own (vLLM) is given the student's weights in: the compute
    dtype, not the float32 masters (None: float32, as they are)."""
    return None if dtype == MASTER_DTYPE else COMPUTE_DTYPES[dtype]


def precision_record(dtype: str, lora: bool = False) -> dict[str, str]:
    """What a checkpoint records of its run's precision: the compute dtype and that of its trained weights."""
    return {"compute": dtype, "weights": trained_weights_dtype(dtype, lora)}


def check_resumable(written: dict[str, str], now: dict[str, str], ckpt: object) -> None:
    """A run resumes only with the precision its checkpoint was written with (:func:`precision_record`)."""
    if written == now:
        return
    said = lambda r: f"{r['compute']} compute with {r['weights']} weights"
    pure = written["compute"] == written["weights"] != MASTER_DTYPE
    was = written["compute"]
    fix = (
        f"it was trained in pure {was} by an opd before mixed precision: resume it with that opd, or start a new "
        f"run from its weights (--student {ckpt}/model)"
        if pure
        else f"resume with --dtype {was}"
    )
    raise UserError(f"checkpoint {ckpt} was written with {said(written)}, this run has {said(now)}; {fix}")


def auto_dtype(model_dir: str | Path, dtype: str, device: torch.device) -> str:
    """``--dtype auto`` (opd serve-teacher): on a GPU the checkpoint's own dtype (config.json's ``dtype``,
    ``torch_dtype`` before transformers 5), on a CPU float32 (half precision there is slow or unsupported,
    and inexact). Any other ``dtype`` is returned as given."""
    if dtype != "auto":
        return dtype
    if device.type == "cpu":
        return MASTER_DTYPE
    try:
        saved = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return MASTER_DTYPE  # loading the model names what is wrong with the directory
    name = str(saved.get("dtype") or saved.get("torch_dtype") or MASTER_DTYPE)
    return name if name in COMPUTE_DTYPES else MASTER_DTYPE
