"""``--resume``: what a checkpoint must agree on with the launch that resumes it, and how it is loaded,
on the number of processes the checkpoint was written with or on another.

A checkpoint holds full (unsharded) state: the student's weights as a Hugging Face model and AdamW's
state keyed by parameter name (``torch.distributed.checkpoint.state_dict``'s full optimizer state
dict, gathered on rank 0 and offloaded to the CPU). So it is the same file whoever wrote it -- one
process, DDP or FSDP over any number of ranks -- and any of them reads it: FSDP takes its shards of
the full state, DDP and one process take it whole. The cost: rank 0 holds the whole optimizer state
in CPU memory while it writes (``torch.distributed.checkpoint``'s sharded files would spare that, at
the price of one file per rank, written by every rank into the folder that
:meth:`opd.runs.rundir.RunDir.save_checkpoint` renames into place, and read back only by a resharding
load). The checkpoints stay atomic: rank 0 writes one folder and renames it, as before.

On any number of processes the run goes on as it was: ``--batch-size`` is per process, so the
checkpoint's global batch (processes x per-process batch, each task's) is kept and the per-process
batch rescaled, whatever the launch's ``--batch-size`` says (refused when it does not divide) -- on as many
processes as wrote it too, so that resuming again with the first command keeps it. A step's prompts and
sampling seeds are drawn over
the global batch (:func:`opd.rollout.prompt_set.batch_indices`, :func:`opd.rollout.prompt_set.sample_seed`,
each rank taking its contiguous block), so each step sees the prompts and seeds it would have.

What a checkpoint cannot be resumed with is refused, naming what differs: another student, LoRA
turned on or off or another rank or targets, another objective, other precision, another
``--max-staleness``; and, under ``--max-staleness`` > 0, another number of processes (the rollouts in
flight are each process's own), or a multi-process checkpoint of an opd that kept only rank 0's.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from opd.config import ConfigError, TaskSpec, TrainConfig, resolve_tasks
from opd.errors import UserError
from opd.models.precision import check_resumable, precision_record
from opd.training.schedule import for_task

# What makes a checkpoint's state this run's: its weights and optimizer state are those of this student,
# with (or without) this adapter, trained on this objective.
SAME_RUN = ("student", "student_revision", "lora_r", "lora_targets", "objective")


def saved_world(state: dict) -> int:
    """How many processes wrote the checkpoint (one RNG state each)."""
    return len(state["rng"]) if isinstance(state["rng"], list) else 1


def check_same_run(state: dict, cfg: TrainConfig, ckpt: Path, world: int) -> None:
    """Refuse, naming what differs, a launch that cannot continue the checkpoint's run."""
    written, flat = state.get("config", {}), cfg.flat()
    for name in SAME_RUN:
        if name not in written:  # a checkpoint of an opd before the option
            continue
        was, now = written[name], flat[name]
        if name == "student" and _same_place(was, now):
            continue
        if was != now:
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"checkpoint {ckpt} was written with {flag} {_said(was)}, this run has {flag} {_said(now)}; "
                f"resume with {flag} {_said(was)} (its weights and optimizer state are that run's), or start a "
                "new run in another --out"
            )
    pure = {"compute": written.get("dtype", "float32"), "weights": written.get("dtype", "float32")}
    check_resumable(state.get("precision", pure), precision_record(cfg.model.dtype, bool(cfg.lora.lora_r)), ckpt)
    staleness = state.get("max_staleness", 0)
    if staleness != cfg.rollout.max_staleness:  # the rollouts in flight, and each step's policy, would change
        raise UserError(
            f"checkpoint {ckpt} was written with --max-staleness {staleness}, this run has {cfg.rollout.max_staleness}; "
            f"resume with --max-staleness {staleness} (a run's rollouts depend on it)"
        )
    n = saved_world(state)
    if staleness and n != world:
        raise UserError(
            f"checkpoint {ckpt} was written by {n} process(es) with --max-staleness {staleness}: the rollouts it "
            f"holds in flight are each process's share, which {world} process(es) cannot take over; resume with "
            f"{n} process(es)"
        )
    if staleness and n > 1 and state.get("ahead") and not isinstance(state["ahead"], list):
        # an opd before each rank's were kept wrote rank 0's share alone: the others' are lost
        raise UserError(
            f"checkpoint {ckpt} holds only rank 0's rollouts in flight (written by {n} processes with --max-staleness "
            f"{staleness} by an opd that lost the other ranks'), so it cannot go on as its run would have; start a new "
            f"run from its weights: --student {ckpt / 'model'} with another --out"
        )


def _said(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _same_place(a: str, b: str) -> bool:
    """Whether two --student values may name one model: the same name, two paths to one folder, or a path
    that does not exist from here (a relative one given in another directory: the optimizer state's
    names and shapes are checked against this student all the same, :func:`check_optimizer_state`)."""
    here = Path(a).exists(), Path(b).exists()
    if a == b or here[0] != here[1]:
        return True
    return all(here) and Path(a).resolve() == Path(b).resolve()


def global_batches(tasks: Sequence[Any], world: int) -> dict[str, int]:
    """Each task's prompts per step over all processes (what a checkpoint records as ``"batch"``);
    ``tasks``: the run's TaskSpecs or TaskRuns (a name and a config each)."""
    return {t.name: t.cfg.optimizer.batch_size * world for t in tasks}


def rebatch(
    cfg: TrainConfig, specs: list[TaskSpec[TrainConfig]], state: dict, world: int, ckpt: Path
) -> tuple[TrainConfig, list[TaskSpec[TrainConfig]]]:
    """The config and its tasks with each per-process batch set so that ``world`` processes keep the
    checkpoint's global batches, whatever the launch's ``--batch-size`` (unchanged where it already does)."""
    n = saved_world(state)
    totals = recorded_batches(cfg, specs, state)
    top = state.get("config", {}).get("batch_size", cfg.optimizer.batch_size) * n  # a multi-task run's shares are of it
    new = _per_process(cfg, top if cfg.multitask.tasks is not None else totals.get("", top), n, world, ckpt)
    if cfg.multitask.tasks is None:
        new_specs = [dataclasses.replace(specs[0], cfg=new)]
    else:
        new_specs = [
            dataclasses.replace(
                s,
                cfg=for_task(
                    s.name, _per_process, s.cfg, totals.get(s.name, s.cfg.optimizer.batch_size * n), n, world, ckpt
                ),
            )
            for s in specs
        ]
    if new == cfg and [s.cfg for s in new_specs] == [s.cfg for s in specs]:
        return cfg, specs
    if os.environ.get("RANK", "0") == "0":
        named = lambda name: f" ({name})" if name else ""
        each = ", ".join(f"{s.cfg.optimizer.batch_size}{named(s.name)}" for s in new_specs)
        kept = ", ".join(f"{total}{named(name)}" for name, total in totals.items())
        print(
            f"opd train: note: {ckpt} was written by {n} process(es) with a global batch of {kept} prompts a "
            f"step, this launch has {world}: each step keeps its global batch, so --batch-size is now {each} per "
            "process (config.json records it)",
            file=sys.stderr,
            flush=True,
        )
    return new, new_specs


def recorded_batches(cfg: TrainConfig, specs: list[TaskSpec[TrainConfig]], state: dict) -> dict[str, int]:
    """Each task's global batch in the checkpoint: its record (``"batch"``), or for a checkpoint of an opd
    before it, its own config's ``--batch-size`` (each task's, from its task list) on its processes; the
    launch's only where the checkpoint holds no config at all."""
    if state.get("batch"):
        return dict(state["batch"])
    n, written = saved_world(state), state.get("config", {})
    if "batch_size" not in written:
        return global_batches(specs, n)
    if cfg.multitask.tasks is None:
        return {"": written["batch_size"] * n}
    then = {k: written[k] for k in ("batch_size", "task_mode", "tasks") if k in written}
    try:  # the task list as it was then: a task's batch is its own, or its share of the run's
        return global_batches(resolve_tasks(cfg.replace(**then)), n)
    except (ConfigError, TypeError):  # a task list this opd no longer reads: the launch's, as before the record
        return global_batches(specs, n)


def _per_process(c: TrainConfig, total: int, n: int, world: int, ckpt: Path) -> TrainConfig:
    """``c`` with the per-process batch of ``total`` prompts over ``world`` processes."""
    if total % world:
        fits = [d for d in range(1, total + 1) if total % d == 0]
        raise UserError(
            f"checkpoint {ckpt} was written by {n} process(es) of --batch-size {total // n}, a global batch of "
            f"{total} prompts a step, which {world} processes cannot share evenly; resume on a number of "
            f"processes that divides {total} ({', '.join(map(str, fits))})"
        )
    try:
        return c.replace(batch_size=total // world)
    except ConfigError as exc:  # --grad-accum must divide the per-process rollouts
        raise UserError(
            f"checkpoint {ckpt} on {world} processes: --batch-size becomes {total // world} per process (the "
            f"global batch of {total} prompts kept), and then {exc}"
        ) from None


# ----------------------------------------------------------------------------- the optimizer's state


def named_optimizer_state(state: dict, names: list[str]) -> dict:
    """A checkpoint's AdamW state keyed by parameter name, as ``torch.distributed.checkpoint`` writes it;
    one written by an opd that keyed a one-process or DDP run's by position (``optimizer.state_dict()``)
    is renamed, ``names``: the trained parameters in the optimizer's order."""
    groups = state["param_groups"]
    if not any(isinstance(p, int) for g in groups for p in g["params"]):
        return state
    flat = [p for g in groups for p in g["params"]]
    if len(flat) != len(names):
        raise UserError(
            f"the checkpoint's optimizer state has {len(flat)} parameters, this student trains {len(names)}; "
            "resume with the run's own --student and --lora-* settings"
        )
    name_of = dict(zip(flat, names, strict=True))
    return {
        "state": {name_of[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in groups],
    }


def check_optimizer_state(state: dict, trained: dict[str, torch.Size], ckpt: Path) -> None:
    """The checkpoint's optimizer state belongs to these parameters (names and shapes); else what differs."""
    saved = [p for g in state["param_groups"] for p in g["params"]]
    extra, missing = sorted(set(saved) - set(trained)), sorted(set(trained) - set(saved))
    if extra or missing:
        which = f"it has {extra[0]!r} which this student has not" if extra else f"it lacks {missing[0]!r}"
        raise UserError(
            f"checkpoint {ckpt} is another model's: its optimizer state covers {len(saved)} parameters, this "
            f"student trains {len(trained)} ({which}); resume with the run's own --student and --lora-* settings"
        )
    for name, moments in state["state"].items():
        shape = moments["exp_avg"].shape if isinstance(moments, dict) and "exp_avg" in moments else None
        if shape is not None and shape != trained[name]:
            raise UserError(
                f"checkpoint {ckpt} is another model's: its {name} is {tuple(shape)}, this student's "
                f"{tuple(trained[name])}; resume with the run's own --student"
            )


def trained_parameters(wrapped: torch.nn.Module) -> dict[str, torch.Size]:
    """The wrapped student's trained parameters in the optimizer's order, named as
    ``torch.distributed.checkpoint`` names them (DDP's ``module.`` left out), with their whole shapes."""
    inner = wrapped.module if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else wrapped
    return {n: p.shape for n, p in inner.named_parameters() if p.requires_grad}
