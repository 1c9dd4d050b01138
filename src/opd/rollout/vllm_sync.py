"""How the student's weights reach a vLLM engine after each update (``--vllm-sync``).

The weights come from the export seam (:mod:`opd.models.export`: a LoRA adapter merged, FSDP's gathered
parameters, the tied head written); what this module chooses is how they travel:

* ``file``: one safetensors file in the run's ``vllm/weights/`` folder, reloaded in place by the server
  (``POST /collective_rpc`` with ``reload_weights``) and its prefix cache reset (``POST
  /reset_prefix_cache``). A ``--vllm-url`` server reads it at the same path.
* ``shm``: the same, in a folder in ``/dev/shm`` (memory-backed), for a server on this machine; the folder
  goes with the engine (and a killed run's is removed by the next run that starts one).
* ``adapter``: a LoRA run's adapter alone (a few megabytes), loaded by the server as a LoRA adapter
  (``POST /v1/load_lora_adapter``, in place under one name) and sampled from by that name; the server runs
  with ``--enable-lora`` (opd adds it, with ``--max-lora-rank`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
  to the servers it starts). vLLM then computes the adapter beside the base weights, as peft does.
* ``auto`` (the default): ``adapter`` for a LoRA run on a server opd starts on GPUs (not under
  ``--vllm-sleep 2``, whose sleep drops the base weights that the adapter way never sends), else ``shm`` where
  ``/dev/shm`` has room for the weights and opd starts the server, else ``file``. Not ``adapter`` on a
  machine without GPUs: there vLLM's CPU build took 1.55x as long for the adapter's rollouts as for the
  merged weights' (0.36B shape, docs/benchmarks.md), more than the sync it saves.

The weights files are written straight from the parameters' memory and overwritten in place
(:func:`opd.models.export.write_weights`): the sync before this module copied every weight twice and
wrote a new file each time, whose pages the kernel had to allocate again. What each way costs, and
why the reload itself stays (vLLM rebuilds each layer as it reloads): benchmarks/bench_weight_sync.py
and docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from opd.errors import UserError
from opd.models.export import adapter_weights, merged_weights, write_weights
from opd.models.lora import is_lora
from opd.service import Client

SHM = Path("/dev/shm")
_SHM_PREFIX = "opd-vllm-"
ADAPTER_NAME = "opd-student"  # the adapter's name at the server: every sync reloads it in place
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts


class WeightSync(Protocol):
    """One way the weights travel. ``push`` gives the engine at ``client`` the weights of ``model`` (in
    ``dtype``) and returns the model name to sample from (None: the served model)."""

    name: str

    def push(self, model: torch.nn.Module, client: Client, dtype: torch.dtype | None) -> str | None: ...

    def close(self) -> None: ...


class FolderSync:
    """``file`` and ``shm``: the whole weights in one safetensors file that the server reloads in place."""

    def __init__(self, name: str, folder: Path, owned: bool = False):
        self.name, self.folder, self.owned = name, Path(folder), owned

    def push(self, model: torch.nn.Module, client: Client, dtype: torch.dtype | None) -> str | None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_weights(merged_weights(model, dtype, copy=False), self.folder / "model.safetensors", in_place=True)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(self.folder.resolve())}}
        client.request("POST", "/collective_rpc", rpc, retry_5xx=False)  # a folder it cannot read stays so
        client.request("POST", "/reset_prefix_cache")  # its cached keys and values are the old weights'
        return None

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.folder, ignore_errors=True)


class AdapterSync:
    """``adapter``: a LoRA run's adapter alone, loaded by the server in place under one name."""

    name = "adapter"

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def push(self, model: torch.nn.Module, client: Client, dtype: torch.dtype | None) -> str | None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_weights(adapter_weights(model), self.folder / "adapter_model.safetensors", in_place=True)
        cast(Any, model).peft_config["default"].save_pretrained(self.folder)  # a PeftModel
        load = {"lora_name": ADAPTER_NAME, "lora_path": str(self.folder.resolve()), "load_inplace": True}
        client.fetch("POST", "/v1/load_lora_adapter", json.dumps(load).encode(), retry_5xx=False)
        client.request("POST", "/reset_prefix_cache")  # vLLM keeps the adapter's cached blocks when reloaded in place
        return ADAPTER_NAME

    def close(self) -> None:
        return None


def choose(
    way: str,
    model: torch.nn.Module,
    folder: Path,
    own_server: bool,
    dtype: torch.dtype | None,
    on_gpu: bool,
    sleep: int = 0,
) -> WeightSync:
    """The way ``--vllm-sync WAY`` names (``auto`` resolved, see the module docstring); ``folder``: the
    engine's folder in the run directory; ``own_server``: opd starts the server; ``on_gpu``: on GPUs;
    ``sleep``: the engine's sleep level between rollouts (``--vllm-sleep``)."""
    if way == "auto":
        if is_lora(model) and own_server and on_gpu and sleep != 2:  # level 2 drops the base weights too
            way = "adapter"
        else:
            way = "shm" if own_server and shm_room(model, dtype) else "file"
    if way == "adapter":
        if not is_lora(model):
            raise UserError("--vllm-sync adapter sends a LoRA adapter, and this run trains no adapter: add --lora-r")
        return AdapterSync(folder / "adapter")
    if way == "shm":
        if not shm_room(model, dtype):
            raise UserError(
                f"--vllm-sync shm: {SHM} is missing or has no room for the weights ({weights_bytes(model, dtype) / 1e9:.2f} "
                "GB); give it more (docker run --shm-size) or use --vllm-sync file"
            )
        remove_orphans()
        return FolderSync("shm", Path(tempfile.mkdtemp(prefix=f"{_SHM_PREFIX}{os.getpid()}-", dir=SHM)), owned=True)
    return FolderSync("file", folder / "weights")


def server_options(sync: WeightSync, lora_r: int, vllm_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """What a server opd starts needs for ``sync``: the adapter way's LoRA options (``--max-lora-rank`` the
    next rank vLLM accepts at or above ``lora_r``, unless ``vllm_args`` give theirs) and environment."""
    if sync.name != "adapter":
        return [], {}
    args = [] if "--enable-lora" in vllm_args else ["--enable-lora"]
    if not any(a.split("=")[0] == "--max-lora-rank" for a in vllm_args):
        args += ["--max-lora-rank", str(min((r for r in LORA_RANKS if r >= lora_r), default=lora_r))]
    return args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def weights_bytes(model: torch.nn.Module, dtype: torch.dtype | None) -> int:
    """The bytes of the whole weights in ``dtype`` (the tied head counted twice: it is written twice)."""
    return sum(
        p.numel() * (torch.finfo(dtype).bits // 8 if dtype and p.is_floating_point() else p.element_size())
        for _, p in model.named_parameters(remove_duplicate=False)
    )


def shm_room(model: torch.nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether ``/dev/shm`` exists and holds the weights with a quarter to spare."""
    if not SHM.is_dir():
        return False
    stat = os.statvfs(SHM)
    return stat.f_bavail * stat.f_frsize > 1.25 * weights_bytes(model, dtype)


def remove_orphans() -> None:
    """The ``shm`` folders of runs whose process is gone (killed before it could remove its own)."""
    for folder in SHM.glob(f"{_SHM_PREFIX}*"):
        pid = folder.name.removeprefix(_SHM_PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(sync: WeightSync) -> Any:
    """What a staleness worker needs to sync the same way (picklable)."""
    return (sync.name, str(getattr(sync, "folder", "")))


def attach(described: Any) -> WeightSync:
    """The way :func:`describe` described, for a staleness worker (the folder stays its owner's)."""
    name, folder = described
    return AdapterSync(Path(folder)) if name == "adapter" else FolderSync(name, Path(folder))
