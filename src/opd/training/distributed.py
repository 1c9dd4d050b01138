"""Data-parallel training across processes: DDP, or FSDP (``--fsdp``) for a student too big for one device.

Processes are started by ``torchrun`` or ``accelerate launch``, which set ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous variables; :func:`init_distributed` joins that group (nccl when
the ranks compute on GPUs, gloo on CPUs) and does nothing in a single process. opd never starts
processes itself.

How the loop uses it:

* each rank generates, scores and trains on its own contiguous shard of the step's global batch
  (``--batch-size`` prompts per rank); sampling seeds are numbered over the global batch, so N
  ranks of batch b see exactly the rollouts of one process of batch N*b;
* everything that needs gradients runs inside the forward of one wrapped module
  (:class:`StudentModule`), because DDP and FSDP only synchronise what goes through their
  wrapper's ``forward``: the LSM fast path calls the decoder and reads the head weight directly,
  which would bypass both;
* under FSDP, work without gradients (rollouts, student top-K, metrics, evaluation) runs with the
  full parameters gathered once (:meth:`Dist.full_call`), so a rank may make any number of
  forward passes (or none) without the ranks' collectives falling out of step. The gathered
  parameters must fit one device during generation; FSDP still shards gradients and AdamW state;
* step metrics are merged across ranks (:func:`merge_metrics`) before rank 0 logs them.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as tdist

from opd.errors import UserError
from opd.models.sharding import CallModule, Lockstep, root_call, shard_blocks

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class StudentModule(CallModule):
    """The module DDP/FSDP wrap: ``forward(fn, *args)`` runs ``fn(student, *args)``.

    Routing every student computation through this one ``forward`` lets the wrappers' hooks see
    it (gradient all-reduce for DDP, parameter gathering and gradient reduce-scatter for FSDP),
    whatever parts of the student ``fn`` touches.
    """

    def __init__(self, student: torch.nn.Module):
        super().__init__(student, "student")


@dataclass
class Dist:
    """This process's place in the launch and the wrapped student; in a single process every
    collective is the identity and the wrapper a plain :class:`StudentModule`."""

    rank: int = 0
    world: int = 1
    fsdp: bool = False
    device: torch.device = torch.device("cpu")  # where this rank computes (and its collectives' tensors live)
    dtype: str = "float32"  # the student's compute dtype (--dtype): FSDP's blocks gather their weights in it
    model: torch.nn.Module | None = None  # the wrapped StudentModule, set by :meth:`wrap`
    lockstep: Lockstep | None = None  # FSDP: the ranks' training forwards kept in step, set by :meth:`wrap`

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------ wrapping
    def wrap(self, student: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``student`` for training; the optimizer must be built on the result afterwards."""
        module: torch.nn.Module = StudentModule(student)
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # on this rank's device: left to itself, FSDP would pick any GPU it sees, even for --device cpu
            mesh = init_device_mesh(self.device.type, (self.world,))
            # One FSDP unit per transformer block, then the root holds what is left: embeddings, final
            # norm, the (tied) head.
            shard_blocks(student, mesh, **_mixed_precision(self.dtype))
            fully_shard(module, mesh=mesh)
            self.lockstep = Lockstep(student, self.device)
        elif self.active:
            # All parameters take part in every loss, so no unused-parameter search; buffers are
            # equal on all ranks (rotary tables), so they are synced once, not on every forward. The
            # gradients are views of DDP's reduction buckets (gradient_as_bucket_view), not a second
            # copy of them: one copy of the student's size less on every rank.
            ids = [self.device.index] if self.device.type == "cuda" else None
            module = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=ids, gradient_as_bucket_view=True, **_no_forward_buffer_sync()
            )
        self.model = module
        return module

    @property
    def module(self) -> torch.nn.Module:
        """:attr:`model`, set by :meth:`wrap` before anything calls through it."""
        return cast(torch.nn.Module, self.model)

    def train_call(self, fn: Callable, *args: Any) -> Any:
        """``fn(student, *args)`` through the wrapper, so its backward is synchronised. Under FSDP every rank
        calls it at the same point, and the student's forwards in it are kept in step across the ranks however
        many rows each has (:class:`~opd.models.sharding.Lockstep`)."""
        if self.lockstep is None:
            return self.module(fn, *args)
        with self.lockstep.armed():
            return self.module(fn, *args)

    def sync_gradients(self, sync: bool):
        """Context for one micro-batch: gradients are reduced across ranks only when ``sync``."""
        if not self.active or sync:
            return contextlib.nullcontext()
        if self.fsdp:
            return _fsdp_no_sync(cast("FSDPModule", self.module))
        return cast(torch.nn.parallel.DistributedDataParallel, self.module).no_sync()

    @torch.no_grad()
    def full_call(self, fn: Callable) -> Any:
        """``fn(student)`` without gradients and with every parameter whole.

        Under FSDP every rank must call this at the same point (gathering is collective); inside,
        each rank may do as much or as little work as it likes.
        """
        if not self.fsdp:
            return fn(_unwrap(self.module).student)
        return root_call(self.module, _with_gathered_blocks, self.module, fn)

    # ------------------------------------------------------------------ collectives
    def all_sum(self, values: list[float]) -> list[float]:
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return t.tolist()

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def gather_to_main(self, obj: Any) -> list | None:
        """Every rank's ``obj`` (picklable), in rank order, on rank 0 only (None on the others): what only
        rank 0 keeps, without a copy of every rank's on each."""
        if not self.active:
            return [obj]
        out: list | None = [None] * self.world if self.is_main else None
        tdist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, student: torch.nn.Module) -> dict | None:
        """The student's unsharded state dict under FSDP (collective); None otherwise (use the module)."""
        if not self.fsdp:
            return None
        # A tied weight (the head) is one parameter under two names: keep the first, as save_pretrained does.
        aliases = {n for n, _ in student.named_parameters(remove_duplicate=False)} - {
            n for n, _ in student.named_parameters()
        }
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
            for k, v in student.state_dict().items()
            if k not in aliases
        }

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """AdamW's full state keyed by parameter name, on rank 0's CPU (collective under FSDP): the same
        whatever the layout, so a checkpoint resumes under any (:mod:`opd.training.resuming`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """:meth:`optimizer_state`'s dict into ``optimizer`` (FSDP takes its shards of it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def shard(self, items: list) -> list:
        """This rank's contiguous block of a global list (its length must divide evenly)."""
        n = len(items) // self.world
        return items[self.rank * n : (self.rank + 1) * n]


def _mixed_precision(dtype: str) -> dict:
    """FSDP's policy for a block under --dtype ``dtype``: weights gathered in the compute dtype, gradients
    reduced in float32 onto the float32 shards (the masters), as the autocast of the non-FSDP path
    computes them; the root (embeddings, final norm, head) stays float32 as it does there
    (:mod:`opd.models.precision`)."""
    if dtype == "float32":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from opd.models.precision import COMPUTE_DTYPES

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[dtype], reduce_dtype=torch.float32)}


def init_distributed(
    fsdp: bool = False, device: torch.device = torch.device("cpu"), dtype: str = "float32", timeout: float = 1800.0
) -> Dist:
    """Join the process group a launcher set up (``WORLD_SIZE`` > 1), or stay single-process. ``timeout``
    (``--dist-timeout``): seconds a collective waits for the other ranks before it fails, whatever the
    backend (torch's defaults differ: nccl 10 minutes, gloo 30)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        if fsdp:
            raise UserError(
                "--fsdp needs several processes; launch with torchrun --nproc_per_node N "
                "(or accelerate launch) or drop --fsdp"
            )
        return Dist(device=device, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl and the object collectives use the current device
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout))
    return Dist(rank=tdist.get_rank(), world=tdist.get_world_size(), fsdp=fsdp, device=device, dtype=dtype)


OUTLIVED = "opd: the wrapped student outlives shutdown; the exit may deadlock (opd.training.distributed.shutdown)"


def shutdown(d: Dist) -> None:
    """End this rank's part: free the wrapper while the process group is still registered, then destroy the group.

    The order closes a deadlock seen at exit (1 in 5 CI runs before a sleep narrowed it; py-spy): gloo's
    destructor (``~ProcessGroupGloo``) waits for its worker threads, and a worker freeing its last work's
    tensor needs the GIL. Python drops a process group without the GIL (torch binds it so, PR 154976),
    but DDP's reducer is C++ and held it too: when the reducer, freed with the wrapper after
    ``destroy_process_group``, dropped the last reference, the destructor ran with the GIL held, and a
    worker waiting for the GIL never finished. Freed first, the reducer drops a reference the group
    registry still shares; the last one goes with ``destroy_process_group``, GIL released, so the
    workers can finish. ``benchmarks/stress_shutdown.py`` counts hangs over launches.
    """
    if not (d.active and tdist.is_initialized()):
        return
    tdist.barrier()
    wrapper, d.model = d.model, None
    # FSDP holds the group through Python objects only (its meshes), which drop it without the GIL; the
    # student's sharded blocks keep its root alive, so only DDP's wrapper is checked for being freed.
    freed = weakref.ref(wrapper) if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) else None
    del wrapper
    gc.collect()  # DDP's module sits in reference cycles (hooks): free it now, not at some later collection
    # a regression the ranks' stderr shows (tests/training/test_distributed.py)
    if freed is not None and freed() is not None:
        print(OUTLIVED, file=sys.stderr, flush=True)
    tdist.destroy_process_group()


def _no_forward_buffer_sync() -> dict:
    """DDP's option for "buffers are synced at init only": torch 2.13 renamed it (``broadcast_buffers``, now
    deprecated with a warning, became ``forward_sync_buffers``); older torch knows only the old name. A GPU
    check on torch 2.11 (benchmarks/gpu_check.py) found DDP refusing the new one."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def _unwrap(module: torch.nn.Module) -> StudentModule:
    inner = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    return cast(StudentModule, inner)  # wrap() wraps a StudentModule


def _fsdp_units(root: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule) and m is not root]


@contextlib.contextmanager
def _fsdp_no_sync(root: FSDPModule) -> Iterator[None]:
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def _with_gathered_blocks(student: torch.nn.Module, root: torch.nn.Module, fn: Callable) -> Any:
    """Inside the root's forward (its own parameters are gathered, :func:`~opd.models.sharding.root_call`):
    gather every block once, keep them whole for ``fn``, then shard again. No collective happens while
    ``fn`` runs."""
    units = _fsdp_units(root)
    for u in units:
        u.set_reshard_after_forward(False)
        u.unshard()
    try:
        return fn(student)
    finally:
        for u in units:
            u.reshard()
            u.set_reshard_after_forward(True)


# ----------------------------------------------------------------------------- metrics

SUM, MAX, GLOBAL = "sum", "max", "global"


def _weight_of(key: str, weights: dict) -> Any:
    if key in weights:
        return weights[key]
    return weights.get(key.split("/")[0] + "/", GLOBAL)


def merge_metrics(records: list[dict], weights: list[dict]) -> dict:
    """Merge the ranks' step records into the record of the whole batch.

    ``weights[r]`` maps a key (or a ``prefix/``) to how rank r's value counts: a number (or, for a
    list-valued metric, one number per element) makes a weighted mean -- the counts a rank averaged
    over, so a mean of means equals the mean over the whole batch; ``"sum"`` and ``"max"`` combine
    totals and timings; ``"global"`` (the default) marks a value already equal on every rank
    (reduced loss, gradient norm, learning rate) and takes rank 0's.
    """
    out: dict = {}
    for key in dict.fromkeys(k for r in records for k in r):  # rank 0's key order first
        have = [(r[key], _weight_of(key, w)) for r, w in zip(records, weights) if key in r]
        rule = have[0][1]
        if rule == GLOBAL or len(have) == 1:
            out[key] = records[0].get(key, have[0][0])
        elif rule == SUM:
            out[key] = sum(v for v, _ in have)
        elif rule == MAX:
            out[key] = max(v for v, _ in have)
        elif isinstance(have[0][0], list):
            vals = torch.tensor([v for v, _ in have], dtype=torch.float64, device="cpu")
            wts = torch.tensor([w for _, w in have], dtype=torch.float64, device="cpu")
            out[key] = ((vals * wts).sum(0) / wts.sum(0).clamp(min=1e-300)).tolist()
        else:
            total = sum(w for _, w in have)
            out[key] = sum(float(v) * w for v, w in have) / total if total else float(have[0][0])
    return out
