"""``opd plan``: a run's memory plan, whether it fits the GPU, and the change that makes it fit.

When the plan does not fit, each change in :data:`CHANGES` is tried through the same planner, alone and
then after gradient checkpointing, and the first that fits is named (with its plan's peak); the command
then exits 1. A change the run's options refuse together (``--fsdp`` with ``--max-staleness``) is skipped.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable
from functools import cache
from typing import Any

from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.planning.memory import (
    HEADROOM_FIXED,
    HEADROOM_SHARE,
    PHASES,
    GiB,
    Layout,
    Plan,
    gib,
    micro_batch,
    plan_memory,
)
from opd.planning.shapes import ModelShape, model_shape
from opd.rollout.vllm_server import without_option

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9}


def parse_memory(text: str) -> int:
    """``80GiB``, ``141 GB``, ``81920MiB`` or a byte count, as bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in UNITS or float(m.group(1)) <= 0:
        raise UserError(f"--gpu-memory {text!r}: give a size such as 80GiB, 141GB or 81920MiB")
    return int(float(m.group(1)) * UNITS[unit])


@cache
def _shape(name: str, revision: str, what: str) -> ModelShape:
    return model_shape(name, revision, what)


def shapes(cfg: TrainConfig) -> tuple[ModelShape, ModelShape | None]:
    """The student's and the in-process teacher's shapes (None: served)."""
    if not cfg.model.student:
        raise UserError("--student is empty: give the student model (a folder or a Hub name) to plan for")
    student = _shape(cfg.model.student, cfg.model.student_revision, "student model (--student)")
    if cfg.teacher.teacher_url:
        return student, None
    if not cfg.teacher.teacher:
        raise UserError("give --teacher (a folder or a Hub name) or --teacher-url (served: no teacher memory here)")
    return student, _shape(cfg.teacher.teacher, cfg.teacher.teacher_revision, "teacher model (--teacher)")


def plan_run(cfg: TrainConfig, layout: Layout) -> Plan:
    return plan_memory(cfg, *shapes(cfg), layout)


Change = Callable[[TrainConfig, Plan], dict | None]


def _checkpointing(cfg: TrainConfig, plan: Plan) -> dict | None:
    return None if cfg.optimizer.gradient_checkpointing else {"gradient_checkpointing": True}


def _fsdp(cfg: TrainConfig, plan: Plan) -> dict | None:
    return None if cfg.run.fsdp or plan.layout.world < 2 else {"fsdp": True}


def _serve_teacher(cfg: TrainConfig, plan: Plan) -> dict | None:
    return None if cfg.teacher.teacher_url else {"teacher_url": "http://TEACHER:8000", "teacher": ""}


def _on_policy(cfg: TrainConfig, plan: Plan) -> dict | None:
    return {"max_staleness": 0} if cfg.rollout.max_staleness else None


def _token_budget(cfg: TrainConfig, plan: Plan) -> dict | None:
    """The largest token budget under the micro-batch's rows that fits (one row when none does)."""
    rows, seq = micro_batch(cfg)
    for r in range(rows - 1, 0, -1):
        change: dict[str, Any] = {"micro_batch_tokens": r * seq, "grad_accum": 1}
        if plan_run(cfg.replace(**change), plan.layout).fits:
            return change
    return None if rows <= 1 else {"micro_batch_tokens": seq, "grad_accum": 1}


def _engine_share(cfg: TrainConfig, plan: Plan) -> dict | None:
    """The engine's share lowered by what the plan is over, kept at 0.1 or more (room for its KV cache)."""
    share = next((p for p in plan.parts if p.name == "vLLM engine's share" and p.bytes), None)
    if share is None or not plan.layout.gpu_bytes or plan.usable is None:
        return None
    util = (share.bytes - (plan.peak - plan.usable)) / plan.layout.gpu_bytes
    if util < 0.1:
        return None
    flag = "--gpu-memory-utilization"
    return {"vllm_args": shlex.join([*without_option(cfg.rollout.vllm_argv, flag), flag, f"{util:.2f}"])}


def _lora(cfg: TrainConfig, plan: Plan) -> dict | None:
    return None if cfg.lora.lora_r else {"lora_r": 16}


# In the order they are tried: each keeps what the run computes (the loss and the update) where it can.
CHANGES: tuple[Change, ...] = (_checkpointing, _fsdp, _token_budget, _serve_teacher, _engine_share, _on_policy, _lora)
OPTION = {"teacher_url": "--teacher-url URL (opd serve-teacher or vLLM on GPUs of its own)"}


def flags(change: dict) -> str:
    """A change as the command-line options that make it."""
    out = []
    for key, value in change.items():
        if key == "teacher" or (key == "grad_accum" and value == 1):
            continue
        flag = "--" + key.replace("_", "-")
        out.append(
            OPTION.get(key)
            or (flag if value is True else f"{flag} '{value}'" if " " in str(value) else f"{flag} {value}")
        )
    return " ".join(out)


def _tried(cfg: TrainConfig, change: dict, layout: Layout) -> tuple[TrainConfig, Plan] | None:
    try:
        new = cfg.replace(**change)
    except ConfigError:  # options opd refuses together
        return None
    return new, plan_run(new, layout)


def fitting_change(cfg: TrainConfig, plan: Plan) -> tuple[dict, Plan] | None:
    """The first change (alone, then after each earlier one, up to three together) whose plan fits."""
    tried: list[dict] = [{}]
    for _ in range(3):
        grown = []
        for base in tried:
            base_cfg = cfg.replace(**base) if base else cfg
            base_plan = plan if not base else plan_run(base_cfg, plan.layout)
            for make in CHANGES:
                step = make(base_cfg, base_plan)
                if not step:
                    continue
                got = _tried(cfg, {**base, **step}, plan.layout)
                if got is None:
                    continue
                if got[1].fits:
                    return {**base, **step}, got[1]
                grown.append({**base, **step})
        tried = grown[:12]
    return None


def headroom_rule() -> str:
    return (
        f"fits when the peak is at most the GPU's memory less {HEADROOM_SHARE:.0%} and {HEADROOM_FIXED / GiB:.0f} GiB "
        "(CUDA context and NCCL buffers, allocator fragmentation, one operation's temporaries)"
    )


def as_json(cfg: TrainConfig, plan: Plan, change: tuple[dict, Plan] | None) -> dict:
    out = {
        "layout": dataclasses.asdict(plan.layout),
        "parts": [dataclasses.asdict(p) for p in plan.parts],
        "phases": {ph: plan.held(ph) for ph in PHASES},
        "peak": plan.peak,
        "peak_phase": plan.peak_phase,
        "usable": plan.usable,
        "fits": plan.fits,
        "headroom": headroom_rule(),
        "notes": plan.notes,
    }
    if change is not None:
        out["change"] = {"options": change[0], "flags": flags(change[0]), "peak": change[1].peak}
    elif plan.fits is False:
        out["change"] = None
    return out


def render(plan: Plan, change: tuple[dict, Plan] | None, title: str) -> None:
    """The plan as a table, its verdict and the change that fits, on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col, just in (("part", "left"), ("when", "left"), ("GiB", "right"), ("how", "left")):
        table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    for p in plan.parts:
        table.add_row(p.name, ", ".join(p.phases), f"{p.bytes / GiB:.2f}", p.how)
    console = Console()
    console.print(table)
    phases = "  ".join(f"{ph} {gib(plan.held(ph))}" for ph in PHASES)
    console.print(f"held in each phase: {phases}")
    console.print(f"peak: {gib(plan.peak)} ({plan.peak_phase})")
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.fits is None:
        console.print("no GPU memory given: --gpu-memory 80GiB (or run it where torch sees the GPU) for a verdict")
        return
    usable = f"{gib(plan.usable or 0)} usable of {gib(plan.layout.gpu_bytes or 0)}"
    if plan.fits:
        console.print(f"[green]fits[/green]: {gib(plan.peak)} of {usable} ({headroom_rule()})")
        return
    console.print(f"[red]does not fit[/red]: {gib(plan.peak)} over {usable} ({headroom_rule()})")
    if change is None:
        console.print("no change opd knows of fits: a GPU with more memory, or a smaller student or batch")
    else:
        console.print(f"fits with: {flags(change[0])} (peak {gib(change[1].peak)})")


def gpu_memory(given: str | None) -> int | None:
    """``--gpu-memory``, else the memory of the GPU torch sees (None: neither)."""
    if given:
        return parse_memory(given)
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def run_plan(cfg: TrainConfig, layout: Layout, as_json_out: bool) -> int:
    """``opd plan``: print the plan (a table, or JSON); 1 when it does not fit, else 0."""
    plan = plan_run(cfg, layout)
    change = fitting_change(cfg, plan) if plan.fits is False else None
    if as_json_out:
        import json

        print(json.dumps(as_json(cfg, plan, change), indent=1))
    else:
        where = f"{layout.world} rank(s)" + (f", {gib(layout.gpu_bytes)} each" if layout.gpu_bytes else "")
        render(plan, change, f"opd plan: {cfg.model.student} on {where}, memory per GPU")
    return 1 if plan.fits is False else 0
