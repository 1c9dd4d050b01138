"""Success-rate evaluation on an environment's held-out games.

* :func:`evaluate_agent`: greedy success rate on held-out games, avg@k / pass@k over sampled
  episodes, mean turns to success, invalid-action rate;
* :func:`write_eval_games`: the held-out games and their list (``eval_games/``, ``eval.jsonl``) in
  the run directory, so the figures can be checked by replaying them.

Evaluation reports ``accuracy`` equal to ``success_rate`` so that reports and experiments read one
key for prompt tasks and environments alike.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from opd.evaluation.estimators import avg_at_k, mean_pass_at_k
from opd.evaluation.sharing import ALONE, Share
from opd.rollout.episodes import EpisodeRecord, EpisodeRollout
from opd.rollout.game_set import GameSet, invalid_action_rate
from opd.runs.progress import progress_bar


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
    """Greedy success rate over ``games``; with ``samples`` > 0 also avg@k and pass@k (k = samples).

    Also the mean number of turns of the won greedy episodes (when one is won), the invalid-action
    rate (when the game lists its admissible commands) and the episodes a game error or a prompt longer than
    ``max_prompt_tokens`` ended (they count as lost).
    Seeds are per game and sample, as in :func:`opd.evaluation.model_eval.evaluate_model`; ``share``: this
    process's games when several evaluate together (:mod:`opd.evaluation.sharing`).
    """
    engine = EpisodeRollout(model, tokenizer)
    mine = share.items(len(games))
    greedy: dict[int, EpisodeRecord] = {}
    sampled_ok: dict[int, list[bool]] = {i: [] for i in mine}
    jobs = [(i, -1) for i in mine] + [(i, s) for s in range(samples) for i in mine]
    limits: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, max_action_tokens=max_action_tokens, max_turns=max_turns
    )
    with progress_bar("playing held-out games", total=len(jobs), enabled=show_progress) as bar:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            for is_greedy in (True, False):
                part = [(i, s) for i, s in chunk if (s < 0) == is_greedy]
                if not part:
                    continue
                played = engine.play(
                    games.env,
                    [games.games[i] for i, _ in part],
                    [seed * 7919 + i * 131 + s for i, s in part],
                    **limits,
                    temperature=temperature,
                    top_p=top_p,
                    greedy=is_greedy,
                    max_prompt_tokens=max_prompt_tokens,
                )
                for (i, _), rec in zip(part, played.records, strict=True):
                    if is_greedy:
                        greedy[i] = rec
                    else:
                        sampled_ok[i].append(rec.won)
            bar.advance(len(chunk))
    return game_figures(share.merged(len(games), [(greedy[i], sampled_ok[i]) for i in mine]), samples)


def game_figures(outcomes: list[tuple[EpisodeRecord, list[bool]]], samples: int) -> dict:
    """The figures of each game's outcome: its greedy episode, and whether each sampled one was won."""
    n = len(outcomes)
    greedy = [rec for rec, _ in outcomes]
    won = [r for r in greedy if r.won]
    invalid = invalid_action_rate(greedy)
    result = {"success_rate": len(won) / n, "accuracy": len(won) / n, "n": n}
    # Figures that are undefined (no game won; a game that lists no commands) are left out, not NaN.
    if won:
        result["mean_turns_to_success"] = sum(r.turns for r in won) / len(won)
    if invalid is not None:
        result["invalid_action_rate"] = invalid
    result["env_errors"] = sum(r.error is not None for r in greedy)
    if samples > 0:
        sampled = [oks for _, oks in outcomes]
        result.update({"avg_at_k": avg_at_k(sampled), "pass_at_k": mean_pass_at_k(sampled, samples), "k": samples})
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
