"""Evaluation on an environment's held-out games.

* :class:`GameItems`: the game side of the one evaluation (:mod:`opd.evaluation.core`): games played
  as episodes through a rollout engine; a won episode is correct. Its own figures, from each game's
  headline episode (greedy, else its first sample): ``success_rate``, mean turns to success,
  invalid-action rate, the episodes a game error ended;
* :func:`evaluate_agent`: the same with opd's own loop on a model (the demos, SFT);
* :func:`write_eval_games`: the held-out games and their list (``eval_games/``, ``eval.jsonl``) in
  the run directory, so the figures can be checked by replaying them.

Evaluation reports ``accuracy`` equal to ``success_rate`` so that reports and experiments read one
key for prompt tasks and environments alike.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd.evaluation.core import Rollout, figures_on_model
from opd.evaluation.sharing import ALONE, Share
from opd.rollout.engine import RolloutEngine, Sampling
from opd.rollout.episodes import ChatFormat, EpisodeRecord, EpisodeRollout
from opd.rollout.game_set import GameSet, invalid_action_rate


@dataclass
class GameItems:
    """Games played by an engine; ``limits``: the episode limits (``opd.config.sources.episode_limits``); ``chat``: the
    episodes' chat format when already checked (else made from ``tokenizer``)."""

    games: GameSet
    tokenizer: Any
    limits: dict[str, Any]
    chat: ChatFormat | None = None
    answers = False  # an episode has no answer to vote on: no maj@k

    def __len__(self) -> int:
        return len(self.games)

    def tokens_per_rollout(self) -> int:
        return int(self.limits.get("max_prompt_tokens") or 0) + int(self.limits["max_new_tokens"])

    def run(self, engine: RolloutEngine, items: list[int], seeds: list[int], sampling: Sampling) -> list[Rollout]:
        player = EpisodeRollout(engine, self.tokenizer, chat=self.chat)
        played = player.play(
            self.games.env,
            [self.games.games[i] for i in items],
            seeds,
            **self.limits,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            greedy=sampling.greedy,
            top_k=sampling.top_k,
        )
        return [_rollout(rec, self.games.games[i].goal) for i, rec in zip(items, played.records, strict=True)]

    def figures(self, headline: list[Rollout]) -> dict:
        return game_figures([r.extra for r in headline])


def _rollout(rec: EpisodeRecord, goal: str) -> Rollout:
    """An episode's outcome; its record: the goal as the prompt, the actions as the response, how it ended."""
    record: dict[str, Any] = {"prompt": goal, "response": " | ".join(rec.actions), "answer": None, "reference": None}
    record.update(end=rec.end, turns=rec.turns, error=rec.error)
    # The episode's observations stay out of the gathered outcome: the figures read the rest.
    light = EpisodeRecord(
        rec.game_id, rec.seed, actions=rec.actions, won=rec.won, end=rec.end, invalid_actions=rec.invalid_actions
    )
    light.error = rec.error
    return Rollout(rec.won, sum(e - s for s, e in rec.spans), rec.truncated, record, extra=light)


def evaluate_agent(
    model,
    tokenizer,
    games: GameSet,
    *,
    max_new_tokens: int,
    max_action_tokens: int,
    max_turns: int | None = None,
    max_prompt_tokens: int | None = None,
    samples: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
    show_progress: bool = False,
    share: Share = ALONE,
) -> dict:
    """Greedy success rate over ``games`` with opd's own loop on ``model``; with ``samples`` > 0 also avg@k
    and pass@k (k = samples): the figures of :func:`opd.evaluation.core.evaluate`."""
    limits: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        max_action_tokens=max_action_tokens,
        max_turns=max_turns,
        max_prompt_tokens=max_prompt_tokens,
    )
    items = GameItems(games, tokenizer, limits)
    return figures_on_model(
        model,
        tokenizer,
        items,
        samples,
        temperature,
        top_p,
        max_batch=batch_size,
        seed=seed,
        share=share,
        show_progress=show_progress,
    )


def game_figures(greedy: list[EpisodeRecord]) -> dict:
    """The figures of each game's headline episode."""
    n = len(greedy)
    won = [r for r in greedy if r.won]
    invalid = invalid_action_rate(greedy)
    result: dict[str, Any] = {"success_rate": len(won) / n}
    # Figures that are undefined (no game won; a game that lists no commands) are left out, not NaN.
    if won:
        result["mean_turns_to_success"] = sum(r.turns for r in won) / len(won)
    if invalid is not None:
        result["invalid_action_rate"] = invalid
    result["env_errors"] = sum(r.error is not None for r in greedy)
    return result


def write_eval_games(run_dir: Path, games: GameSet) -> list[dict]:
    """Copy the held-out games into ``RUN/eval_games/<game id>/`` and list them (the lines of
    ``eval.jsonl``: game id, its file there relative to the run directory, goal).

    A game is the folder that holds its file (``Game.path``), copied whole: ALFWorld's game file
    needs its ``traj_data.json`` beside it, TextWorld's ``game.z8`` its ``game.json``. Environments
    keep one game per folder; a game without a file (the toy game) is listed with no path.
    """
    lines = []
    for g in games.games:
        rel = None
        if g.path and Path(g.path).exists():
            src = Path(g.path)
            dest = run_dir / "eval_games" / _safe(g.id)
            shutil.copytree(src if src.is_dir() else src.parent, dest, dirs_exist_ok=True)
            rel = (dest if src.is_dir() else dest / src.name).relative_to(run_dir)
        lines.append({"game": g.id, "path": None if rel is None else str(rel), "goal": g.goal})
    return lines


def _safe(game_id: str) -> str:
    """A game id as one path component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in game_id)
