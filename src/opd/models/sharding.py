"""FSDP (torch's ``fully_shard``) over a transformers model, shared by the student's wrapper
(:mod:`opd.training.distributed`) and the in-process teacher under ``--fsdp`` (:mod:`opd.teachers.sharded`).

Both wrap the model in a module whose ``forward(fn, *args)`` runs ``fn(model, *args)`` (:class:`CallModule`),
sharded as the root: FSDP gathers the root's own parameters (embeddings, final norm, head) for the whole of
that forward, and each transformer block's for the block's own forward. Any computation that reads a
parameter outside a block's forward, such as the LSM path's rows of the head weight, must therefore run
inside the root's forward: :func:`root_call`.

**Every rank makes the same collectives** (:class:`Lockstep`). Gathering a block is a collective, so every
rank must run a sharded model's blocks as many times as the others, but a rank's forwards follow its rows:
``response_hidden`` goes by chunks of rows, and micro-batches under ``--micro-batch-tokens`` (or a padding
one) hold different numbers of rows on different ranks. Where the forward count depends on local data, each
forward is announced first (a one-number all-reduce, made at the embedding, before any block gathers), and a
rank that is done joins the others' remaining forwards with one-token forwards of its own until every rank
is done, as torch's ``Join`` does for DDP's uneven inputs. A forward with gradients gathers each block again
in its backward: the joining forwards' outputs are tied (times zero) to the result, so their backward runs
too, in the same order as the other ranks' (the autograd engine runs the later forward's backward first).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as tdist

from opd.models.loading import final_hidden

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


class Lockstep:
    """Announce-and-join for the forwards of one sharded ``model``, computing on ``device`` (see the module
    docstring). Forwards are announced, and joined, only while the lockstep is armed: the
    trainer arms the student's for its training forward (:meth:`armed`), the sharded teacher's is armed for
    good (its every method is a collective); work where each rank makes forwards of its own without
    collectives (the student's, with its blocks gathered once) leaves it unarmed."""

    def __init__(self, model: torch.nn.Module, device: torch.device, armed: bool = False):
        self.model, self.device, self.is_armed = model, device, armed
        self._announce = False  # on inside a region, off again for the joining forwards
        cast(Any, model).get_input_embeddings().register_forward_pre_hook(self._announced)
        _LOCKSTEPS[model] = self

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Forwards of the model inside (:func:`in_lockstep`) are announced and joined; every rank enters at
        the same point."""
        was, self.is_armed = self.is_armed, True
        try:
            yield
        finally:
            self.is_armed = was

    def run(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, list[torch.Tensor]]:
        """``fn(*args)`` with each forward of the model announced, then this rank's joining forwards until every
        rank is done (an error too: the other ranks' forwards still need this rank's part of each gather).
        Returns ``fn``'s value and the joining forwards' outputs. A collective: every rank calls it at the same
        point. Inside another region it only runs ``fn``: the outermost joins, as one rank may fail inside an
        inner region that another never enters."""
        if self._announce:
            return fn(*args), []
        self._announce = True
        joined: list[torch.Tensor] = []
        try:
            value = fn(*args)
        finally:
            self._announce = False
            while self._busy(False):
                one = torch.ones(1, 1, dtype=torch.long, device=self.device)
                joined.append(final_hidden(cast(Any, self.model), one, one))
        return value, joined

    def _announced(self, *_: Any) -> None:  # a pre-hook: returns None, which keeps the embedding's input
        if self._announce:
            self._busy(True)

    def _busy(self, busy: bool) -> bool:
        """Whether any rank is about to run a forward (this one: ``busy``); a collective."""
        flag = torch.tensor([int(busy)], device=self.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return bool(flag.item())


_LOCKSTEPS: weakref.WeakKeyDictionary[torch.nn.Module, Lockstep] = weakref.WeakKeyDictionary()


def in_lockstep(model: torch.nn.Module, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fn()``, a tensor computed by forwards of ``model``: when the model's :class:`Lockstep` is armed, in
    its region, the joining forwards' outputs tied to the result times zero (its values unchanged), so that a
    backward through it runs theirs too; otherwise ``fn()`` alone."""
    step = _LOCKSTEPS.get(model)
    if step is None or not step.is_armed:
        return fn()
    value, joined = step.run(fn)
    return value + sum(j.sum() for j in joined) * 0.0 if joined else value
