"""The games a run plays: an environment's games as the rollout source, and what a step logs of them.

``opd train --env NAME`` replaces the prompt set with an environment's games (:mod:`opd.envs`):
each rollout is a multi-turn episode played by :class:`opd.rollout.episodes.EpisodeRollout`, the teacher
scores every token of it, and only the student's own action tokens are trained (the environment's
replies are context). The rest of the loop is the single-turn one. This module holds:

* :func:`make_env` and :class:`GameSet`, the games of a split, visited in the same seeded order as
  prompts (:func:`opd.rollout.prompt_set.batch_indices`), with the labels the logs need;
* :func:`episode_outcomes` and :func:`episode_metrics`: an episode's "correct" is "won", and the
  step logs turns, invalid actions, truncations and games that failed;
* :func:`check_episode_context`: an episode's prompt and budget must fit the model.

Evaluation on held-out games is :mod:`opd.evaluation.game_eval`; the expert's episodes for behaviour
cloning are :mod:`opd.training.cloning`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import yaml

from opd.config.sources import EnvOptions
from opd.envs import Environment, Game, get_env
from opd.envs.workers import AUTO_WORKERS, EnvWorkers
from opd.errors import UserError
from opd.models.loading import resolve_device
from opd.rollout.episodes import EpisodeRecord
from opd.rollout.prompt_set import batch_indices
from opd.tasks import Example


def parse_env_args(items: list[str]) -> dict[str, Any]:
    """``--env-args`` as keyword arguments: ``["n_train=256,max_turns=10"]`` -> {n_train: 256, ...}
    (items comma-separated or repeated; values read as YAML scalars, so numbers and booleans keep
    their types)."""
    out: dict[str, Any] = {}
    for item in (part for given in items for part in str(given).split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(
                f"--env-args item {item!r} is not KEY=VALUE; write e.g. --env-args n_train=256,max_turns=10"
            )
        out[key.strip()] = yaml.safe_load(value)
    return out


def make_env(name: str, level: int, env_args: list[str]) -> Environment:
    """The environment ``name`` at ``level``, with ``--env-args`` passed through to its constructor."""
    kwargs = {"level": level, **parse_env_args(env_args)}
    try:
        return get_env(name, **kwargs)
    except TypeError as err:  # an argument the environment's constructor does not take
        raise UserError(f"environment {name!r} does not accept these arguments ({err}); fix --env-args") from None


def play_env(options: EnvOptions, device: str) -> Environment:
    """The environment of a config's env section, its games where ``--env-workers`` says (unset: by the cores
    the trainer on ``device``, the ``--device`` option, leaves free)."""
    workers = auto_workers(resolve_device(device)) if options.env_workers is None else options.env_workers
    env = make_env(options.env, options.env_level, options.env_args)
    return in_workers(env, workers, options.env_step_timeout, required=options.env_workers is not None)


def in_workers(env: Environment, workers: int, step_timeout: float = 60.0, required: bool = True) -> Environment:
    """``env`` with its games in ``workers`` processes (0: ``env`` itself). Not ``required`` (an
    unset ``--env-workers``), an environment that cannot go to a worker stays in this process."""
    if workers == 0:
        return env
    try:
        return EnvWorkers(env, workers, step_timeout)
    except UserError as err:
        if required:
            raise
        print(f"opd: playing {env.name}'s games in this process: {err}", file=sys.stderr)
        return env


# Set by opd's side-by-side runs (the demos' objectives, `opd experiment --workers`) in each run's
# process: the cores that run may count as its own, so that two runs do not each start workers on
# the cores the other one fills.
CPU_SHARE_ENV = "OPD_CPU_SHARE"


def auto_workers(device: torch.device) -> int:
    """What an unset ``--env-workers`` starts: a worker per CPU core that the trainer leaves free
    (its torch threads when the model computes on the CPU, one core otherwise), over the ranks
    that share the machine (LOCAL_WORLD_SIZE), at most ``AUTO_WORKERS``. Games in workers on cores
    the model's threads use would only slow both: OpenMP threads that wait for a core spin."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if os.environ.get(CPU_SHARE_ENV):  # one of several runs side by side: its share of the cores
        cores = min(cores, int(os.environ[CPU_SHARE_ENV]))
    trainer = torch.get_num_threads() if device.type == "cpu" else 1
    return max(0, min(AUTO_WORKERS, cores - trainer))


@dataclass
class GameSet:
    """The games of one split of an environment, in the environment's fixed order."""

    env: Environment
    games: list[Game]
    examples: list[Example]  # one per game, for logs: the goal as "prompt", no reference answer

    @classmethod
    def build(cls, env: Environment, split: str, limit: int | None = None) -> GameSet:
        games = list(env.games(split))[:limit]
        if not games:
            raise UserError(
                f"environment {env.name!r} has no {split} games; check its level and --env-args "
                "(or its data directory, e.g. ALFWORLD_DATA)"
            )
        return cls(env, games, [Example(prompt=g.goal or g.id, answer="", task=env.name) for g in games])

    def __len__(self) -> int:
        return len(self.games)

    def batch_indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        return batch_indices(len(self), step, batch_size, seed)


def episode_outcomes(records: list[EpisodeRecord]) -> tuple[list[str], list[float]]:
    """Each episode's transcript of actions (for the logs) and its reward: 1 if won."""
    return [" | ".join(r.actions) for r in records], [float(r.won) for r in records]


def episode_metrics(records: list[EpisodeRecord]) -> dict[str, float]:
    """Per-rollout averages of a step's episodes (``rollout/`` keys, merged over ranks by rollouts)."""
    n = len(records)
    invalid = invalid_action_rate(records)
    return {
        "rollout/turns": sum(r.turns for r in records) / n,
        "rollout/truncated_rate": sum(r.truncated for r in records) / n,
        "rollout/env_error_rate": sum(r.error is not None for r in records) / n,
        "rollout/invalid_action_rate": 0.0 if invalid is None else invalid,
    }


def invalid_action_rate(records: list[EpisodeRecord]) -> float | None:
    """Share of actions outside the game's admissible commands, over the episodes of games that
    list them; None when none does."""
    listed = [(r.turns, r.invalid_actions) for r in records if r.invalid_actions is not None]
    actions = sum(turns for turns, _ in listed)
    return sum(invalid for _, invalid in listed) / actions if actions else None


def check_episode_context(model, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Before any work: the longest prompt an episode may have plus its token budget must fit the
    model's positions (a longer first observation ends its episode, counted, instead)."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and max_prompt_tokens + max_new_tokens > context:
        raise UserError(
            f"--max-prompt-tokens {max_prompt_tokens} plus --max-new-tokens {max_new_tokens} (an episode's prompt "
            f"and its budget) exceed the model's context of {context} positions; lower one of them"
        )
