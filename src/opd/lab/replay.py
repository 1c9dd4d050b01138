"""Two training runs fed the same batches: how a setting (a dtype, a kernel) changes the updates alone.

On-policy runs part at their first differing sample, after which their losses compare different batches.
:func:`replay` takes the rollouts and teacher scores of a reference run (made with its own, current
weights) and updates both the reference and the other run on them, step after step, so every step's
difference is the setting's. Used by the mixed-precision tests (tests/training/test_precision.py) and
the real-shape GPU check (tests/gpu/test_real_shape.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from opd.config import TrainConfig
from opd.training import loop, producer
from opd.training.setup import Run, setup

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: its numbers' spacing relative to their size


@dataclass
class Replayed:
    """Per step, both runs' loss and gradient norm; the flat weights before and after (reference, other)."""

    losses: list[tuple[float, float]]
    grad_norms: list[tuple[float, float]]
    start: torch.Tensor
    ends: tuple[torch.Tensor, torch.Tensor]

    def weight_gap(self) -> tuple[float, float]:
        """(how far the reference's weights moved, how far apart the two runs' weights ended)."""
        return float((self.ends[0] - self.start).norm()), float((self.ends[1] - self.ends[0]).norm())

    def within_bf16_bound(self) -> bool:
        """The tolerance of bfloat16 mixed precision against float32 on the losses, derived: bfloat16's relative
        spacing u = 2^-8 bounds what one step's rounding changes in a loss relative to its size (the roundings
        of separate products partly cancel); after t steps the weights have also parted, each step's update
        differing by about that much, so the difference grows at most linearly: each step's loss within
        u (t + 1) of the reference's. (Not for an objective whose loss value reads the batch alone, as
        sampled-token OPD's does. The weights' gap is reported, not bounded: Adam's update is about lr times
        the gradient's sign, so an element whose gradient is near zero may step the other way in one run.)"""
        return all(abs(b - a) <= BF16_EPS * (t + 1) * abs(a) for t, (a, b) in enumerate(self.losses))


def _flat(run: Run) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in run.student.parameters()])


def replay(reference: TrainConfig, other: TrainConfig, steps: int) -> Replayed:
    """``steps`` steps of both configurations on the reference's rollouts and teacher scores; the two
    must describe the same task and teacher (the other run's own teacher is never asked), each its own --out."""
    a, b = setup(reference), setup(other)
    start, losses, norms = _flat(a), [], []
    for step in range(steps):
        (at,) = producer.step_tasks(a, step)
        batch, rows, records = producer.rollout_stage(a, step, at)
        part = producer.scored_part(a, step, at.task, batch, rows, records)
        ua = loop.update_stage(a, step, [part])[0]
        ub = loop.update_stage(b, step, [dataclasses.replace(part, task=b.tasks[0])])[0]
        losses.append((ua.loss, ub.loss))
        norms.append((ua.grad_norm, ub.grad_norm))
    return Replayed(losses, norms, start, (_flat(a), _flat(b)))
