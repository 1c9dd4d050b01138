"""FSDP (torch's ``fully_shard``) over a transformers model, shared by the student's wrapper
(:mod:`opd.training.distributed`) and the in-process teacher under ``--fsdp`` (:mod:`opd.teachers.sharded`).

Both wrap the model in a module whose ``forward(fn, *args)`` runs ``fn(model, *args)`` (:class:`CallModule`),
sharded as the root: FSDP gathers the root's own parameters (embeddings, final norm, head) for the whole of
that forward, and each transformer block's for the block's own forward. Any computation that reads a
parameter outside a block's forward, such as the LSM path's rows of the head weight, must therefore run
inside the root's forward: :func:`root_call`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule


class CallModule(torch.nn.Module):
    """``forward(fn, *args)`` runs ``fn(model, *args)``: one forward that FSDP's (and DDP's) hooks see,
    whatever parts of the model ``fn`` touches. ``name``: the attribute that holds the model, the first
    part of its parameters' names in state dicts (the student's is ``student``, which checkpoints keep)."""

    def __init__(self, model: torch.nn.Module, name: str = "model"):
        super().__init__()
        self.held = name
        setattr(self, name, model)

    def forward(self, fn: Callable, *args: Any) -> Any:
        return fn(getattr(self, self.held), *args)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or ``model`` itself)."""
    return cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model


def shard_blocks(model: torch.nn.Module, mesh: DeviceMesh, **options: Any) -> None:
    """One FSDP unit per transformer block: the classes transformers lists as never to be split
    (``_no_split_modules``); the caller shards the root, which then holds the rest."""
    from torch.distributed.fsdp import fully_shard

    block_names = set(getattr(base_model(model), "_no_split_modules", None) or ())
    for sub in model.modules():
        if type(sub).__name__ in block_names:
            fully_shard(sub, mesh=mesh, **options)


def root_call(root: torch.nn.Module, fn: Callable, *args: Any) -> Any:
    """``fn(model, *args)`` inside the sharded root's forward (its own parameters whole), the root sharded
    again after it, and ``fn``'s error raised once that is done.

    FSDP leaves the root gathered after a forward (it expects a backward): resharded here, its registered
    parameters are the shards the optimizer and state dicts know, and a forward-only model frees the
    gathered memory. An error raised through the root's forward would leave it in its forward state, which
    no reshard leaves, so ``fn``'s error is carried out of the forward and raised after.
    """
    try:
        value, error = root(_caught, fn, *args)
    finally:
        cast("FSDPModule", root).reshard()
    if error is not None:
        raise error
    return value


def _caught(model: torch.nn.Module, fn: Callable, *args: Any) -> tuple[Any, Exception | None]:
    try:
        return fn(model, *args), None
    except Exception as error:
        return None, error
