"""The student's weights as a rollout engine with weights of its own loads them: the weight-sync seam.

* :func:`merged_weights` -- every weight under its Hugging Face name, as a plain model would save it:
  a LoRA adapter's update added to the weights it adapts, the tied head written as a tensor of its
  own, read from the parameters as they are at the call -- under FSDP inside
  :meth:`~opd.training.distributed.Dist.full_call`, where they are gathered whole (a ``state_dict()``
  there would shard them again: FSDP's state-dict hook), so one gather per sync serves the rollout,
  its policy check and the engine's copy.
* :func:`adapter_weights` -- a LoRA run's adapter alone, as peft saves it, for an engine that loads
  adapters on its own (vLLM's ``--enable-lora``): a few megabytes instead of the whole model.

How the weights then reach the engine (a folder it reloads, in memory or on disk, or the adapter) is
the engine's choice (:mod:`opd.rollout.vllm_sync`).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from opd.models.lora import is_lora


def merged_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None, copy: bool = True
) -> dict[str, torch.Tensor]:
    """The student's weights under their Hugging Face names, with a LoRA adapter's update added to the
    weights it adapts: what a rollout engine with weights of its own and the ``--max-staleness`` worker are
    given. Computed beside the model (peft's ``get_delta_weight``), not by merging and unmerging it in place,
    whose float rounding would creep into the trained base weights at every sync. ``dtype``: the
    floating-point weights cast to it (an engine computing in bfloat16 gets bfloat16, not a mixed-precision
    run's float32 masters). Tied copies (the head of a tied model) are written too, each its own tensor:
    vLLM's in-place reload refills its head from ``lm_head.weight`` and leaves it stale without it
    ("ParallelLMHead: Failed to load"). ``copy=False``: a weight that needs neither a merge, a cast nor a move
    to the CPU is the parameter itself, not a copy (for a caller that writes it out before the next update)."""
    lora = is_lora(model)
    # LoRA: merged in the weights' own precision first, on copies (the trained base weights stay as they are)
    state = _current_state(model, None if lora else dtype, copy=copy or lora)
    if not lora:
        return state
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
                base = state[f"{name}.base_layer.weight"]
                for adapter in module.active_adapters:
                    base += module.get_delta_weight(adapter).to("cpu", base.dtype)
    return {
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): _cast(v, dtype)
        for k, v in state.items()
        if ".lora_" not in k
    }


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA run's adapter tensors under the names peft saves them with (``adapter_model.safetensors``)."""
    from peft import get_peft_model_state_dict

    if not is_lora(model):
        raise ValueError("the model has no LoRA adapter to export")
    prefix = "base_model.model."
    live = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    # peft's names for them, from its own state-dict function, taken on the live (gathered) tensors
    names = get_peft_model_state_dict(model, state_dict={n: torch.empty(0) for n in live})
    return {name: live[_live_name(name, live, prefix)].detach().to("cpu", copy=True).contiguous() for name in names}


def _live_name(saved: str, live: dict, prefix: str) -> str:
    """The parameter behind a saved adapter tensor's name (peft drops the adapter's name: ``.default``)."""
    stem, _, leaf = saved.rpartition(".")
    for candidate in (f"{stem}.default.{leaf}", saved):
        if candidate in live:
            return candidate
    raise KeyError(f"no LoRA parameter behind {saved!r} (prefix {prefix})")


def _current_state(model: torch.nn.Module, dtype: torch.dtype | None, copy: bool) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones under each name) and persistent buffer, as a state dict names them, on the
    CPU (cast to ``dtype`` on the way where given; ``copy``: each a copy of its own)."""
    state = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                state[f"{prefix}.{name}" if prefix else name] = buf
    sharded = [n for n, v in state.items() if hasattr(v, "full_tensor")]
    if sharded:
        raise RuntimeError(
            f"merged_weights was given FSDP shards ({sharded[0]}, ...): call it where the weights are gathered "
            "(inside Dist.full_call)"
        )
    return {k: _cast(v.detach(), dtype, copy=copy) for k, v in state.items()}


def _cast(t: torch.Tensor, dtype: torch.dtype | None, copy: bool = False) -> torch.Tensor:
    to = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.to("cpu", to, copy=copy).contiguous()


# safetensors' names of torch's dtypes
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_weights(tensors: dict[str, torch.Tensor], path: Path, in_place: bool = False) -> int:
    """``tensors`` as one safetensors file at ``path`` (its bytes returned), written straight from the tensors'
    memory: ``safetensors.torch.save_file`` first copies every tensor into a bytes object, which at the
    0.36B shape took as long as the write itself (benchmarks/bench_weight_sync.py). ``in_place``: an
    existing file is overwritten where it lies (on a memory-backed filesystem its pages are reused, not
    allocated and zeroed again); else the file is written beside and renamed over ``path``, so a reader
    never sees half of it. Read back with ``safetensors``' own loaders."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start, views = 0, []
    for name, t in tensors.items():
        t = t.detach().contiguous()
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [start, start + size],
        }
        start += size
        views.append((t, size))
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    target = path if in_place and path.is_file() else path.with_name(path.name + ".tmp")
    with open(target, "r+b" if target == path else "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t, size in views:
            # the tensor's bytes where they lie: not .numpy(), which would pin its storage's size, and FSDP
            # frees a gathered parameter by resizing its storage to nothing after the rollout
            f.write((ctypes.c_ubyte * size).from_address(t.data_ptr()) if size else b"")
        f.truncate()
    if target != path:
        os.replace(target, path)
    return 8 + len(head) + start
