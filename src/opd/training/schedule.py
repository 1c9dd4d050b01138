"""Multi-task OPD: several tasks in one run, each with its own teacher, prompts or games and settings.

A run lists its tasks in the config file (``tasks:``, or ``--tasks FILE`` holding the list); the
command line's single-task options stay the short form of a run with one task. Each entry is a
mapping::

    tasks:
      - name: math                     # metric prefix: math/train/loss, eval/math/accuracy
        share: 2                       # relative weight (default 1); shares are normalised
        teacher: models/math-teacher   # or teacher_url: http://127.0.0.1:8001
        task: data/math/train.parquet
        max_new_tokens: 512
      - name: alfworld
        share: 1
        teacher_url: http://127.0.0.1:8002
        env: alfworld
        max_new_tokens: 320
        max_turns: 12

An entry may set the options declared ``per_task`` (:func:`opd.config.tasks.per_task_keys`: the task's
data or environment, its teacher, its sampling, lengths and evaluation); every other setting (objective, K, support, optimizer, steps,
seed, student, ...) is global and stays at the top level. A key a task leaves out takes the
global value, with two exceptions: a task that names ``teacher`` or ``teacher_url`` replaces the
global teacher (both keys, and the global ``teacher_tokenizer``), and one that names ``task`` but no ``env`` trains on prompts even where
the global config names an environment. Each task resolves into its own validated
:class:`~opd.config.TrainConfig` (``from_flat`` of the run's options, ``cfg.flat()``, with its overrides),
so data loading, teachers and every check are those of a single-task run (the list is read and
resolved with the configs, by :mod:`opd.config.tasks`; this module holds how steps use the tasks).

How steps use the tasks (``task_mode``):

* ``alternate`` (default): each step trains on one task; which one is :func:`task_for_step`, a pure
  function of (step, shares, seed): smooth weighted round-robin, so equal shares give A, B, A, B
  and shares 2:1 give A, B, A, A, B, A (each window of 3 steps holds two A and one B); the seed
  rotates which task goes first on ties. A task's k-th step takes the k-th batch of its own prompt
  order (:func:`opd.rollout.prompt_set.batch_indices` over its own data), so resume and N ranks stay exact.
* ``mix``: every step holds every task's sub-batch (``batch_size`` of the entry, else
  ``round(share * batch_size)`` prompts per process), each rollout scored by its own task's
  teacher, and one optimizer step over all of them. The loss normalisers add up over the tasks:
  ``token_mean`` averages over all tasks' loss tokens together, ``sequence_mean`` over all their
  sequences, and ``constant_sum`` divides by the sum over tasks of rollouts x that task's
  ``max_new_tokens``.

``opd sft`` reads the same list (its ``per_task`` options: a task's data or environment, its
``train_size``, ``batch_size`` and lengths) to train one model on several tasks: see :mod:`opd.training.sft`.

Metric names (``metrics.jsonl``): the usual keys are the whole step batch (all its tasks); each
task trained at a step also logs its own, prefixed by its name: ``<name>/train/loss`` (the token
mean of its per-token loss), ``<name>/train/loss_tokens``, ``<name>/rollout/...``,
``<name>/diag/...``, ``<name>/depth/...``. The gradient norm, clipping and learning rate belong
to the step and are not prefixed. Evaluation logs ``eval/<name>/...`` per task (accuracy, or for
a game ``success_rate``; avg@k, ...) and, as overall keys, ``eval/accuracy`` and ``eval/avg_at_k``:
the unweighted mean over tasks. Each task's evaluation set is listed in ``RUN/tasks/<name>/eval.jsonl``
(a game task's held-out games in ``RUN/tasks/<name>/eval_games/``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from opd.errors import UserError


def for_task(name: str, fn, *args, **kw):
    """``fn(*args, **kw)``; a user error of a multi-task run's task names the task."""
    try:
        return fn(*args, **kw)
    except UserError as exc:
        if not name:
            raise
        raise UserError(f"task {name!r}: {exc}") from exc


# ----------------------------------------------------------------------------- schedule


def task_schedule(steps: int, shares: Sequence[float], seed: int = 0) -> list[tuple[int, int]]:
    """For each of the first ``steps`` steps: (the task it trains on, how many earlier steps that task had).

    Smooth weighted round-robin over the shares, in exact integer arithmetic (no float drift over
    long runs): every step each task's credit grows by its weight, the task with the most credit
    trains and pays the total back. A prefix does not depend on ``steps``, so the schedule is a
    function of (step, shares, seed) alone; ties go to the task that comes first in the order
    rotated by ``seed``.
    """
    fracs = [Fraction(str(float(s))) for s in shares]
    scale = math.lcm(*(f.denominator for f in fracs))
    weights = [int(f * scale) for f in fracs]
    n, total = len(weights), sum(weights)
    rank = [(i - seed) % n for i in range(n)]  # tie-break priority: lower rank wins
    credit, visits, out = [0] * n, [0] * n, []
    for _ in range(steps):
        credit = [c + w for c, w in zip(credit, weights)]
        pick = max(range(n), key=lambda i: (credit[i], -rank[i]))
        credit[pick] -= total
        out.append((pick, visits[pick]))
        visits[pick] += 1
    return out


def task_for_step(step: int, shares: Sequence[float], seed: int = 0) -> tuple[int, int]:
    """(task index, its earlier steps) of ``step`` under :func:`task_schedule`."""
    return task_schedule(step + 1, shares, seed)[step]


# ----------------------------------------------------------------------------- records


def prefixed(record: dict, name: str) -> dict:
    """A task's metrics under its name (``rollout/accuracy`` -> ``math/rollout/accuracy``)."""
    return {f"{name}/{k}": v for k, v in record.items()}


def split_by_task(record: dict, names: Sequence[str]) -> dict[str, dict]:
    """A metrics record's per-task values, unprefixed, by task: the inverse of the prefixes the
    trainer writes (``math/rollout/accuracy`` and ``eval/math/accuracy`` -> ``{"math": {...}}``)."""
    out: dict[str, dict] = {n: {} for n in names}
    for key, value in record.items():
        for n in names:
            if key.startswith(f"{n}/"):
                out[n][key[len(n) + 1 :]] = value
            elif key.startswith(f"eval/{n}/"):
                out[n]["eval/" + key[len(n) + 6 :]] = value
    return out
