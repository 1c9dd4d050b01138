"""Run by tests/training/test_fsdp_uneven.py in each of 2 gloo ranks (RANK, WORLD_SIZE, MASTER_* set): one
step's micro-batches (the trainer's own ``micro_batches_of`` and ``micro_step``) under FSDP with a token
budget that gives the ranks different numbers of forwards, against one process training on both ranks'
rollouts, in float64.

Under ``--micro-batch-tokens 64`` rank 0's 11 short rows pack into one micro-batch, which the student's
forward runs in two chunks of rows (``response_hidden``'s 8), and a padding micro-batch; rank 1's 3 long
rows pack into two micro-batches of one chunk each. Each objective is run twice: ``lsm`` (the teacher's
scores computed beforehand) and ``full_kl`` (the teacher, sharded too, called inside the student's forward).
Then, inside ``Dist.full_call`` (the student gathered whole), the ranks make different numbers of forwards
without gradients. Each rank writes the relative gradient and loss differences per objective, and the
log-probs' largest difference, to ``OUT/rank<r>.json``.

Usage: python fsdp_uneven.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from opd.config import TrainConfig
from opd.models.loading import tiny_qwen2
from opd.rollout.engine import Sample
from opd.rollout.served import single_turn_batch
from opd.teachers.scoring import HFTeacher
from opd.teachers.sharded import ShardedTeacher
from opd.training.distributed import Dist, init_distributed, shutdown
from opd.training.loop import global_totals, micro_batches_of, micro_step
from opd.training.loss import loss_mask, policy_logprobs

V, K, BUDGET, HORIZON = 61, 4, 64, 16


def model(seed: int, layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same weights on every rank
    return tiny_qwen2(V, layers, width, eos_id=1, pad_id=0, max_len=64).double()


def rank_batch(rank: int):
    """Rank 0: 11 rows of 3 to 5 tokens; rank 1: 3 rows of 27 to 30 (see the module docstring)."""
    g = torch.Generator().manual_seed(rank)
    ids = lambda n: torch.randint(2, V, (n,), generator=g).tolist()
    shapes = [(2 + i % 2, 1 + i % 3) for i in range(11)] if rank == 0 else [(12, 15), (13, 17), (12, 16)]
    samples = [Sample(ids(t), [-1.5] * t, False) for _, t in shapes]
    return single_turn_batch([ids(p) for p, _ in shapes], samples, 0, torch.device("cpu"))


def parts_of(batches, teacher_for_loss, scorer: HFTeacher) -> list:
    return [
        SimpleNamespace(
            batch=b,
            scores=scorer.score(b, K),
            mask_NT=loss_mask(b, [], None),
            student_ids=None,
            task=SimpleNamespace(teacher=teacher_for_loss),
        )
        for b in batches
    ]


def one_step(run, parts: list, totals) -> tuple[float, int]:
    """The update stage's micro-batch loop (no optimizer step): the summed loss and the micro-batch count."""
    micro = micro_batches_of(run, parts)
    loss = sum(micro_step(run, parts, m, totals, None, None, j == len(micro) - 1)[2] for j, m in enumerate(micro))
    return loss, len(micro)


def main(out: Path) -> None:
    dist = init_distributed(fsdp=True, timeout=30.0)  # a hang fails within seconds, not the default 30 min
    batches = [rank_batch(r) for r in range(dist.world)]
    scorer = HFTeacher(model(5, 2, 32))
    found: dict = {"rows": batches[dist.rank].response_ids_NT.shape[0]}
    for objective in ("lsm", "full_kl"):
        cfg = TrainConfig.from_flat(objective=objective, micro_batch_tokens=BUDGET, k=K, max_new_tokens=HORIZON)
        # one process, both ranks' rollouts as two parts of its batch
        alone = Dist()
        student = model(3, 2, 32)
        alone.wrap(student)
        run = SimpleNamespace(cfg=cfg, dist=alone, said=set())
        parts = parts_of(batches, scorer, scorer)
        want_loss, _ = one_step(run, parts, global_totals(run, [p.mask_NT for p in parts], [HORIZON] * len(parts)))
        want = {n: p.grad for n, p in student.named_parameters()}
        plain = student
        # two ranks, each its own rollouts, the student and (full_kl) the teacher sharded
        student = model(3, 2, 32)
        dist.wrap(student)
        sharded = ShardedTeacher(model(5, 2, 32)) if objective == "full_kl" else scorer
        run = SimpleNamespace(cfg=cfg, dist=dist, said=set())
        parts = parts_of([batches[dist.rank]], sharded, scorer)
        loss, count = one_step(run, parts, global_totals(run, [parts[0].mask_NT], [HORIZON]))
        got_loss = dist.all_sum([loss])[0] / dist.world  # as update_stage reduces it
        grads = {n: p.grad.full_tensor() for n, p in student.named_parameters()}
        found[objective] = {
            "micro_batches": count,
            "loss": abs(got_loss - want_loss) / abs(want_loss),
            "grad": max(float((grads[n] - w).abs().max() / w.abs().max()) for n, w in want.items()),
            "grad_norm": float(torch.stack([g.norm() for g in want.values()]).norm()),
        }
    # work without gradients (metrics, policy checks, evaluation) on the whole student: each rank as many
    # forwards as it likes (rank 0 two: its batch's chunks; rank 1 three: both batches'), none a collective
    mine = batches[:1] if dist.rank == 0 else batches
    got_lp = dist.full_call(lambda s: [policy_logprobs(s, b) for b in mine])
    want_lp = [policy_logprobs(plain, b) for b in mine]  # the unsharded student of the last objective
    found["full_call"] = max(float((g - w).abs().max()) for g, w in zip(got_lp, want_lp, strict=True))
    (out / f"rank{dist.rank}.json").write_text(json.dumps(found))
    shutdown(dist)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
