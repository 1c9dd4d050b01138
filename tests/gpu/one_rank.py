"""Under torchrun with one rank: ``opd train`` (argv after MODE) with a one-rank process group (nccl on CUDA)
and the student wrapped in DDP (MODE ddp) or FSDP (MODE fsdp). opd runs a one-process launch without a group
(and refuses --fsdp there), so ``init_distributed`` is replaced by one that always joins the group, and a
``Dist`` whose collectives run (``active``) with one rank. Used by tests/gpu/test_train.py.

  python -m torch.distributed.run --standalone --nproc_per_node 1 tests/gpu/one_rank.py ddp train --student ...
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as tdist

import opd.training.setup as setup_mod  # where the run calls init_distributed (by its own name)
from opd.cli import app
from opd.training.distributed import Dist


class OneRankDist(Dist):
    @property
    def active(self) -> bool:
        return True


def init_one_rank(
    fsdp: bool = False, device: torch.device = torch.device("cpu"), dtype: str = "float32", timeout: float = 1800.0
) -> Dist:
    """init_distributed's signature, joining a group whatever the world size."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout))
    d = OneRankDist(rank=tdist.get_rank(), world=tdist.get_world_size(), fsdp=fsdp, device=device, dtype=dtype)
    print(f"one_rank: backend {tdist.get_backend()}, world {d.world}", file=sys.stderr, flush=True)
    return d


def main(mode: str, argv: list[str]) -> None:
    setup_mod.init_distributed = init_one_rank
    wrapped: list[str] = []
    real_wrap = Dist.wrap

    def wrap(self, student):
        module = real_wrap(self, student)
        wrapped.append(type(module).__name__)
        return module

    Dist.wrap = wrap  # type: ignore[method-assign]
    code = app(argv + (["--fsdp"] if mode == "fsdp" else []), prog_name="opd", standalone_mode=False)
    if code:  # click returns an Exit's code rather than raising it here
        raise SystemExit(code)
    expect = "DistributedDataParallel" if mode == "ddp" else "FSDP"
    print(f"one_rank: the student wrapped as {wrapped}", file=sys.stderr, flush=True)
    if not wrapped or expect not in wrapped[0]:
        raise SystemExit(f"{mode}: the student was wrapped as {wrapped}, expected {expect}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
