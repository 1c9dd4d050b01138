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

An entry may set the keys of :data:`PER_TASK` (the task's data or environment, its teacher, its
sampling, lengths and evaluation); every other setting (objective, K, support, optimizer, steps,
seed, student, ...) is global and stays at the top level. A key a task leaves out takes the
global value, with two exceptions: a task that names ``teacher`` or ``teacher_url`` replaces the
global teacher (both keys, and the global ``teacher_tokenizer``), and one that names ``task`` but no ``env`` trains on prompts even where
the global config names an environment. Each task resolves into its own validated
:class:`~opd.config.TrainConfig` (``dataclasses.replace`` of the run's config with its overrides),
so data loading, teachers and every check are those of a single-task run.

How steps use the tasks (``task_mode``):

* ``alternate`` (default): each step trains on one task; which one is :func:`task_for_step`, a pure
  function of (step, shares, seed): smooth weighted round-robin, so equal shares give A, B, A, B
  and shares 2:1 give A, B, A, A, B, A (each window of 3 steps holds two A and one B); the seed
  rotates which task goes first on ties. A task's k-th step takes the k-th batch of its own prompt
  order (:func:`opd.data.batch_indices` over its own data), so resume and N ranks stay exact.
* ``mix``: every step holds every task's sub-batch (``batch_size`` of the entry, else
  ``round(share * batch_size)`` prompts per process), each rollout scored by its own task's
  teacher, and one optimizer step over all of them. The loss normalisers add up over the tasks:
  ``token_mean`` averages over all tasks' loss tokens together, ``sequence_mean`` over all their
  sequences, and ``constant_sum`` divides by the sum over tasks of rollouts x that task's
  ``max_new_tokens``.

``opd sft`` reads the same list (:data:`SFT_PER_TASK`: a task's data or environment, its
``train_size``, ``batch_size`` and lengths) to train one model on several tasks: see :mod:`opd.sft`.

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

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from opd.config import ConfigError, SFTConfig, TrainConfig, coerce_numbers
from opd.errors import UserError

TASK_MODES = ("alternate", "mix")

# What a task may set for itself: its data or environment, its lengths and evaluation size, and
# (OPD) its teacher and sampling, or (SFT) its targets and how many of its examples it learns from.
_SOURCE = (
    "task",
    "split",
    "prompt_field",
    "answer_field",
    "solution_field",
    "system_prompt",
    "answer_format",
    "task_level",
    "eval_task",
    "eval_split",
    "eval_prompt_field",
    "eval_answer_field",
    "eval_solution_field",
    "eval_answer_format",
    "env",
    "env_level",
    "env_args",
    "max_turns",
    "max_action_tokens",
    "max_new_tokens",
    "max_prompt_tokens",
    "eval_size",
    "batch_size",
)
PER_TASK = (
    "teacher",
    "teacher_url",
    "teacher_dtype",
    "teacher_tokenizer",
    "cross_tokenizer",
    "cross_pairing",
    "teacher_special_map",
    *_SOURCE,
    "temperature",
    "top_p",
    "eval_samples",
)
# teacher: where its targets are sampled from
SFT_PER_TASK = (*_SOURCE, "data", "teacher", "train_size", "expert_mistakes", "dagger_from", "dagger_branches")
# Metric namespaces a task name would collide with.
RESERVED = ("train", "rollout", "diag", "depth", "time", "eval", "step", "tasks")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass
class TaskSpec:
    """One task of a run: its name ("" in a single-task run: no prefix anywhere), its share of the
    steps (normalised) and its config (the run's, with its overrides)."""

    name: str
    share: float
    cfg: TrainConfig | SFTConfig


def read_task_list(value: Any) -> list:
    """The ``tasks`` value as a list of entries: given inline, or a YAML/JSON file holding the list
    (``--tasks FILE``: the command line passes it as a one-item list), or one YAML/JSON mapping per
    ``--tasks`` option (``--tasks '{"name": "math", ...}' --tasks '{...}'``: how the experiments
    write a multi-task run's command line)."""
    if isinstance(value, list) and value and all(isinstance(v, str) and v.lstrip().startswith("{") for v in value):
        try:
            return [yaml.safe_load(v) for v in value]
        except yaml.YAMLError as exc:
            raise ConfigError(f"a --tasks mapping is not valid YAML/JSON: {exc}") from exc
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        return value
    p = Path(value)
    if not p.is_file():
        raise ConfigError(f"tasks={value!r}: no such file; give a YAML or JSON file holding the list of tasks")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"tasks file {p} is not valid YAML/JSON: {exc}") from exc
    if isinstance(data, dict) and "tasks" in data:  # a config-style file with a tasks: key
        data = data["tasks"]
    return data


def check_task_list(tasks: Any, mode: str) -> list[dict]:
    """The entries' shape: a non-empty list of mappings with distinct, usable names and positive shares."""
    if mode not in TASK_MODES:
        raise ConfigError(f"task_mode={mode!r}: choose alternate (one task per step) or mix (every task each step)")
    if not isinstance(tasks, list):
        raise ConfigError(f"tasks must be a list of task mappings (or a file holding one), not {type(tasks).__name__}")
    if not tasks:
        raise ConfigError("tasks is empty; list at least one task (name, teacher, task or env), or drop tasks")
    seen: set[str] = set()
    for i, entry in enumerate(tasks):
        if not isinstance(entry, dict):
            raise ConfigError(f"tasks[{i}] is a {type(entry).__name__}; each task is a mapping with a name")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in RESERVED:
            raise ConfigError(
                f"tasks[{i}] has name={name!r}; give each task a name of letters, digits, '_', '-' or '.' "
                f"(not {', '.join(RESERVED)}): it prefixes the task's metrics"
            )
        if name in seen:
            raise ConfigError(f"task {name!r} is listed twice; give each task its own name")
        seen.add(name)
        share = entry.get("share", 1)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0:
            raise ConfigError(
                f"task {name!r}: share={share!r} must be a positive number (shares are relative weights, normalised)"
            )
    return tasks


def per_task_keys(cfg: TrainConfig | SFTConfig) -> tuple[str, ...]:
    """The settings a task of this kind of run may set for itself."""
    return SFT_PER_TASK if isinstance(cfg, SFTConfig) else PER_TASK


def _overrides(entry: dict, cfg: TrainConfig | SFTConfig, mode: str, share: float) -> dict:
    """The entry's settings as config fields, with the implied ones (see the module docstring)."""
    name, allowed = entry["name"], per_task_keys(cfg)
    given = {k: v for k, v in entry.items() if k not in ("name", "share")}
    for key in given:
        if key not in allowed:
            where = "is a global setting: set it at the top level" if hasattr(cfg, key) else "is not a setting"
            raise ConfigError(f"task {name!r}: {key!r} {where}; a task may set {', '.join(allowed)}")
    out = coerce_numbers(type(cfg), dict(given))
    if isinstance(cfg, TrainConfig) and ("teacher" in given or "teacher_url" in given):
        out.setdefault("teacher", "")
        out.setdefault("teacher_url", "")
        out.setdefault("teacher_tokenizer", "")  # the global teacher's tokenizer is not this teacher's
        if out["teacher_url"]:
            out.setdefault("teacher_dtype", "")
    if "task" in given:
        out.setdefault("env", "")
    if mode == "mix" and "batch_size" not in given:
        out["batch_size"] = round(share * cfg.batch_size)
        if out["batch_size"] < 1:
            raise ConfigError(
                f"task {name!r} gets no prompts in mix mode (share {share:.3g} of batch_size {cfg.batch_size} "
                "rounds to 0); raise its share or batch_size, or give the task its own batch_size"
            )
    return out


def resolve_tasks(cfg: TrainConfig | SFTConfig) -> list[TaskSpec]:
    """Every task of ``cfg`` as a validated config; a single-task run is one task named "".

    An OPD run's task needs a teacher; an SFT run's may name one (its targets are then sampled)."""
    if cfg.tasks is None:
        return [TaskSpec("", 1.0, cfg)]
    entries = check_task_list(cfg.tasks, cfg.task_mode)
    total = sum(float(e.get("share", 1)) for e in entries)
    specs = []
    for entry in entries:
        name, share = entry["name"], float(entry.get("share", 1)) / total
        try:
            view = dataclasses.replace(cfg, tasks=None, **_overrides(entry, cfg, cfg.task_mode, share))
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"task {name!r}: {exc}") from None
        if isinstance(view, TrainConfig) and not (view.teacher or view.teacher_url):
            raise ConfigError(
                f"task {name!r} has no teacher; give it teacher: DIR or teacher_url: URL, or set a global --teacher"
            )
        specs.append(TaskSpec(name, share, view))
    return specs


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
