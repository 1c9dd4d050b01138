"""The in-process teacher sharded across the ranks under ``--fsdp`` (torch's FSDP, forward only).

Each rank keeps 1/N of the teacher's weights, in the teacher's own dtype (``--teacher-dtype``, no mixed
precision: the weights are gathered as they are stored). A score gathers each transformer block for its
forward and shards it again after it, so at most one block is whole at a time besides the root's own
parameters (embeddings, final norm, head), which stay whole for the length of the call
(:func:`opd.models.sharding.root_call`): the top-K over the head and the rows of it that the from-hidden
kernels gather see the full weight. The scores are the unsharded teacher's (the same computation on the
same gathered weights): tests/training/test_sharded_teacher.py.

**Every rank makes the same collectives.** Gathering a block is a collective, and a rank's forwards follow
its rows (``response_hidden``'s chunks, micro-batches of different sizes): the teacher's
:class:`~opd.models.sharding.Lockstep`, armed for good, announces each forward and has a rank that is done
join the others' remaining forwards once the call's computation is done (or failed).

**The head outside a call.** :meth:`ShardedTeacher.hidden_and_head` returns the head for the loss, which
runs after the call, when the weight is sharded again: the head is returned as a copy of the full weight
(V x E in the teacher's dtype, freed with the micro-batch's loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as tdist
from transformers import PreTrainedModel

from opd.losses import Head
from opd.models.loading import model_device
from opd.models.sharding import CallModule, Lockstep, root_call, shard_blocks
from opd.rollout.sampling import RolloutBatch
from opd.teachers.scoring import HFTeacher, TeacherScores


class ShardedTeacher(HFTeacher):
    """:class:`~opd.teachers.scoring.HFTeacher` over a model sharded by FSDP across the process group
    (which must be initialised); its methods are collectives: every rank calls each one at the same point."""

    def __init__(self, model: PreTrainedModel, chunk_size: int = 256):
        super().__init__(model, chunk_size)  # eval mode, no gradients: before sharding, which keeps them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.device = model_device(model)
        mesh = init_device_mesh(self.device.type, (tdist.get_world_size(),))
        shard_blocks(model, mesh)
        self.root = CallModule(model)
        fully_shard(self.root, mesh=mesh)
        self.lockstep = Lockstep(model, self.device, armed=True)

    @torch.no_grad()
    def score(self, batch, k, query_ids_NTQ=None, diag_index_M=None) -> TeacherScores:
        return self._call(lambda _: HFTeacher.score(self, batch, k, query_ids_NTQ, diag_index_M))

    @torch.no_grad()
    def hidden_and_head(self, batch: RolloutBatch) -> tuple[torch.Tensor, Head]:
        def whole(_: Any) -> tuple[torch.Tensor, Head]:
            h, head = HFTeacher.hidden_and_head(self, batch)
            bias = None if head.bias_V is None else head.bias_V.clone()
            return h, replace(head, weight_VD=head.weight_VD.clone(), bias_V=bias)  # outlives the call

        return self._call(whole)

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn`` inside the root's forward, then the ranks' forwards evened out (see the module docstring).
        ``fn`` reads ``self.model``, which inside the root's forward holds the gathered root parameters."""
        return root_call(self.root, self._joined, fn)

    def _joined(self, model: torch.nn.Module, fn: Callable[[Any], Any]) -> Any:
        return self.lockstep.run(fn, model)[0]  # no gradients: the joining forwards' outputs are not needed
