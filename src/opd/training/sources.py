"""Where a task's rollouts come from: one protocol for prompts and games, so the loop never asks which.

A :class:`Source` is one split of a task: single-turn prompts graded by the task's reward
(:class:`PromptSource`), or an environment's games played as multi-turn episodes whose reward is
the game's (:class:`GameSource`). It knows what differs between the two: how the run's rollout engine
(:class:`~opd.rollout.engine.RolloutEngine`, whichever it is) rolls a batch out -- single-turn batches,
or episodes played over its sessions --, how the rollouts are graded and what a step logs of them, how a model is evaluated on
it, and how it is listed in the run directory. As in tinker-cookbook, a single-turn problem is an
environment of one turn; :func:`make_sources` is the one place that looks at ``--env``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol, cast

from opd.config import TrainConfig
from opd.config.sources import episode_limits
from opd.evaluation.core import EvalPlan, Evaluation, evaluate, resolve_sampling
from opd.evaluation.game_eval import GameItems, write_eval_games
from opd.evaluation.model_eval import PromptItems, decode_responses
from opd.evaluation.sharing import ALONE, Share
from opd.hub import resolve_model
from opd.rollout.engine import RolloutBatch, RolloutEngine, check_context, check_count
from opd.rollout.episodes import ChatFormat, EpisodeRecord, EpisodeRollout
from opd.rollout.game_set import GameSet, check_episode_context, episode_metrics, episode_outcomes, play_env
from opd.rollout.prompt_set import PromptSet, eval_prompts, load_tasks
from opd.tasks import Example, Task, reward_of

FIX = "lower --max-new-tokens, or --max-prompt-tokens (longer training prompts are skipped)"
HELD_OUT_FIX = "lower --max-new-tokens, or shorten the held-out prompts (--eval-task; they are never skipped)"


class Source(Protocol):
    """One split of a task, as the loop uses it."""

    examples: list[Example]  # one per item, for the logs (a game's goal as its prompt)

    def __len__(self) -> int: ...

    def batch_indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        """The items of batch ``step``: a seeded order that depends only on the step."""

    def check_model(self, model, cfg: TrainConfig) -> None:
        """Before any work: a model that cannot hold this source's rollouts is refused."""

    def rollout(
        self, engine: RolloutEngine, rows: list[int], seeds: list[int], cfg: TrainConfig
    ) -> tuple[RolloutBatch, list | None]:
        """The rollouts of items ``rows`` by ``engine``, with per-rollout seeds, and each episode's record
        (None for prompts)."""

    def grade(self, tok, examples, batch: RolloutBatch, records) -> tuple[list[str], list[float | None], dict]:
        """Each rollout's text (for the logs) and reward (None: a prompt without a reference answer, not
        graded), and what a step logs beyond the common metrics."""

    def evaluate(self, engine: RolloutEngine, tok, cfg: TrainConfig, plan: EvalPlan) -> Evaluation:
        """The model ``engine`` samples, on this (held-out) split with a config's lengths and ``plan``
        (:func:`eval_plan`): the figures (``accuracy``, avg@k, ...) and the per-sample records; every rank
        gets all of them (``plan.share``: this rank's items when the ranks evaluate together)."""

    def listing(self, run_dir: Path, played: bool) -> list[dict] | None:
        """The lines of its ``eval.jsonl``; None until it can be listed (a game's files exist once played)."""

    def close(self) -> None:
        """Stop what it started (an environment's worker processes); it may be called more than once."""


@dataclass
class PromptSource:
    """Single-turn prompts, rewarded by ``task`` (the grader of a held-out split: --eval-task)."""

    prompts: PromptSet
    task: Task
    held_out: bool = False  # evaluated, never trained on: its long prompts are not skipped

    examples = property(lambda self: self.prompts.examples)

    def __len__(self) -> int:
        return len(self.prompts)

    def batch_indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        return self.prompts.batch_indices(step, batch_size, seed)

    def check_model(self, model, cfg: TrainConfig) -> None:
        longest = max(len(p) for p in self.prompts.prompt_ids)
        fix = HELD_OUT_FIX if self.held_out else FIX
        check_context(longest, cfg.rollout.max_new_tokens, getattr(model.config, "max_position_embeddings", None), fix)

    def rollout(self, engine: RolloutEngine, rows, seeds, cfg: TrainConfig) -> tuple[RolloutBatch, None]:
        ids = [self.prompts.prompt_ids[i] for i in rows]
        batch = engine.generate(
            ids,
            seeds,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
        )
        check_count(engine.name, batch.num_rollouts, len(ids))
        return batch, None

    def grade(self, tok, examples, batch, records) -> tuple[list[str], list[float | None], dict]:
        """Decoded responses and their task rewards (1 = correct; None: no reference answer), graded once per step."""
        texts = decode_responses(tok, batch.response_ids_NT, batch.response_mask_NT)
        skipped = {"data/prompts_skipped": float(self.prompts.skipped)} if self.prompts.skipped else {}
        return texts, [reward_of(self.task, t, e) for t, e in zip(texts, examples, strict=True)], skipped

    def evaluate(self, engine: RolloutEngine, tok, cfg: TrainConfig, plan: EvalPlan) -> Evaluation:
        return evaluate(engine, PromptItems(self.prompts, self.task, tok, cfg.rollout.max_new_tokens), plan)

    def listing(self, run_dir: Path, played: bool) -> list[dict]:
        return [{"prompt": e.prompt, "answer": e.answer} for e in self.prompts.examples]

    def close(self) -> None:
        return None


@dataclass
class GameSource:
    """An environment's games, played as multi-turn episodes; an episode's reward is 1 if won.
    ``tokenizer``: the student's, whose chat template renders the episodes."""

    games: GameSet
    tokenizer: Any

    examples = property(lambda self: self.games.examples)

    @cached_property
    def chat(self) -> ChatFormat:
        """The episodes' chat format (the template checked once, when the run is set up)."""
        return ChatFormat(self.tokenizer, self.tokenizer.eos_token_id)

    def __len__(self) -> int:
        return len(self.games)

    def batch_indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        return self.games.batch_indices(step, batch_size, seed)

    def check_model(self, model, cfg: TrainConfig) -> None:
        check_episode_context(model, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens)
        self.chat  # noqa: B018 -- a template episodes cannot use is refused now, not at the first step

    def rollout(self, engine: RolloutEngine, rows, seeds, cfg: TrainConfig) -> tuple[RolloutBatch, list[EpisodeRecord]]:
        games = [self.games.games[i] for i in rows]
        limits = episode_limits(cfg.env, cfg.data, cfg.rollout)
        player = EpisodeRollout(engine, self.tokenizer, chat=self.chat)
        played = player.play(
            self.games.env, games, seeds, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, **limits
        )
        return played.batch, played.records

    def grade(self, tok, examples, batch, records) -> tuple[list[str], list[float | None], dict]:
        texts, won = episode_outcomes(records)
        rewards: list[float | None] = list(won)  # every episode is graded: won or not
        return texts, rewards, episode_metrics(records)

    def evaluate(self, engine: RolloutEngine, tok, cfg: TrainConfig, plan: EvalPlan) -> Evaluation:
        return evaluate(
            engine,
            GameItems(self.games, self.tokenizer, episode_limits(cfg.env, cfg.data, cfg.rollout), self.chat),
            plan,
        )

    def listing(self, run_dir: Path, played: bool) -> list[dict] | None:
        # Generated games have their files once opened: copied into the run directory after they are played.
        return write_eval_games(run_dir, self.games) if played else None

    def close(self) -> None:
        close = getattr(self.games.env, "close", None)  # EnvWorkers (the training and held-out games share it)
        if close is not None:
            close()


def eval_plan(cfg: TrainConfig, seed: int, share: Share = ALONE, show_progress: bool = False) -> EvalPlan:
    """How a (task's) config evaluates: its samples, its sampling (--eval-sampling; greedy and explicit
    sample at --eval-temperature / --eval-top-p, else the rollouts'), maj@k, batch budget and records."""
    temperature, top_p = cfg.eval.eval_temperature or cfg.rollout.temperature, cfg.eval.eval_top_p or cfg.rollout.top_p
    model_dir = (
        str(resolve_model(cfg.model.student, cfg.model.student_revision)) if cfg.eval.eval_sampling == "model" else ""
    )
    sampling = resolve_sampling(cfg.eval.eval_sampling, temperature, top_p, model_dir)
    return EvalPlan.of(cfg.eval, cfg.eval.eval_samples, sampling, seed, share=share, show_progress=show_progress)


def task_data(cfg: TrainConfig) -> tuple[Task | None, Task | None]:
    """The task and the held-out grader of a prompt run (read before any model: a data problem shows at
    once); none for an environment, whose games are their own reward."""
    return (None, None) if cfg.env.env else load_tasks(cfg)


def make_sources(cfg: TrainConfig, tok, task: Task | None, eval_task: Task | None) -> tuple[Source, Source | None]:
    """The training source and the held-out one: the task's prompts (--eval-task's test prompts
    held out), or the environment's training and held-out games (--env); None: no evaluation
    (--no-eval, or prompts without reference answers: :func:`opd.rollout.prompt_set.load_tasks`)."""
    train = train_source(cfg, tok, task)
    if not cfg.eval.eval or not (cfg.env.env or eval_task):
        return train, None
    return train, held_out(cfg, tok, eval_task, train.games.env if isinstance(train, GameSource) else None)


def train_source(cfg: TrainConfig, tok, task: Task | None) -> Source:
    """The training split alone: the task's training prompts, or the environment's training games."""
    if cfg.env.env:
        return GameSource(GameSet.build(play_env(cfg.env, cfg.model.device), "train"), tok)
    task = cast(Task, task)  # None only with --env (task_data)
    prompts = PromptSet.build(
        task.examples("train"), tok, cfg.data.max_prompt_tokens, "training prompts", cfg.data.long_prompts
    )
    return PromptSource(prompts, task)


def held_out(cfg: TrainConfig, tok, grader: Task | None, env=None) -> Source:
    """The held-out split alone (what training evaluates; the demos evaluate their models on it)."""
    if cfg.env.env:
        env = env or play_env(cfg.env, cfg.model.device)
        return GameSource(GameSet.build(env, "test", cfg.eval.eval_size), tok)
    grader = cast(Task, grader)  # None only with --env (task_data) or without evaluation (make_sources)
    examples = eval_prompts(grader, cfg.eval.eval_size)
    return PromptSource(
        PromptSet.build(examples, tok, cfg.data.max_prompt_tokens, "test prompts"), grader, held_out=True
    )
