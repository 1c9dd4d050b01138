"""Agentic OPD: the games a run plays, how its episodes are graded, and success-rate evaluation.

``opd train --env NAME`` replaces the prompt set with an environment's games (:mod:`opd.envs`):
each rollout is a multi-turn episode played by :class:`opd.episodes.EpisodeRollout`, the teacher
scores every token of it, and only the student's own action tokens are trained (the environment's
replies are context). The rest of the loop is the single-turn one. This module holds what differs:

* :class:`GameSet`, the games of a split, visited in the same seeded order as prompts
  (:func:`opd.data.batch_indices`), with the labels the logs need;
* :func:`episode_outcomes` and :func:`episode_metrics`: an episode's "correct" is "won", and the
  step logs turns, invalid actions, truncations and games that failed;
* :func:`evaluate_agent`: greedy success rate on held-out games, avg@k / pass@k over sampled
  episodes, mean turns to success, invalid-action rate;
* :func:`write_eval_games`: the held-out games and their list (``eval_games/``, ``eval.jsonl``) in
  the run directory, so the figures can be checked by replaying them;
* :func:`expert_sequences`: the environment's expert episodes in the same episode format, with
  labels on the action tokens only, for ``opd sft --env`` (behaviour cloning: the game teacher and
  the student start there), and :func:`dagger_sequences`: another player's episodes labelled by the
  expert from the states that player reached (``opd sft --dagger-from``).

Evaluation reports ``accuracy`` equal to ``success_rate`` so that reports and experiments read one
key for prompt tasks and environments alike.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from opd.data import batch_indices
from opd.envs import Environment, Game, get_env, normal_command
from opd.episodes import ChatFormat, EpisodeRecord, EpisodeRollout
from opd.errors import UserError
from opd.estimators import avg_at_k, mean_pass_at_k
from opd.progress import progress_bar
from opd.tasks import Example

__all__ = [
    "GameSet",
    "make_env",
    "parse_env_args",
    "episode_outcomes",
    "episode_metrics",
    "evaluate_agent",
    "write_eval_games",
    "expert_sequences",
    "dagger_sequences",
    "require_expert_next",
    "mistake_command",
    "check_episode_context",
]


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
    listed = [r for r in records if r.invalid_actions is not None]
    actions = sum(r.turns for r in listed)
    return sum(r.invalid_actions for r in listed) / actions if actions else None


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
) -> dict:
    """Greedy success rate over ``games``; with ``samples`` > 0 also avg@k and pass@k (k = samples).

    Also the mean number of turns of the won greedy episodes (when one is won), the invalid-action
    rate (when the game lists its admissible commands) and the episodes a game error or a prompt longer than
    ``max_prompt_tokens`` ended (they count as lost).
    Seeds are per game and sample, as in :func:`opd.evaluation.evaluate_model`.
    """
    engine = EpisodeRollout(model, tokenizer)
    n = len(games)
    greedy: list[EpisodeRecord] = []
    sampled_ok: list[list[bool]] = [[] for _ in range(n)]
    jobs = [(i, -1) for i in range(n)] + [(i, s) for s in range(samples) for i in range(n)]
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
                    max_new_tokens=max_new_tokens,
                    max_action_tokens=max_action_tokens,
                    max_turns=max_turns,
                    temperature=temperature,
                    top_p=top_p,
                    greedy=is_greedy,
                    max_prompt_tokens=max_prompt_tokens,
                )
                for (i, _), rec in zip(part, played.records, strict=True):
                    (greedy.append(rec) if is_greedy else sampled_ok[i].append(rec.won))
            bar.advance(len(chunk))
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
        result.update(
            {"avg_at_k": avg_at_k(sampled_ok), "pass_at_k": mean_pass_at_k(sampled_ok, samples), "k": samples}
        )
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


def expert_sequences(
    env: Environment, games: list[Game], tokenizer, max_len: int, mistakes: float = 0.0, seed: int = 0
) -> tuple[list, list, int]:
    """The expert's episodes as token sequences in the episode format of :mod:`opd.episodes` and
    their labels (the action tokens and their EOS; -100 on the prompt and the game's replies).

    ``mistakes``: before each expert action, with this probability, a command the game rejects is
    played first (see :func:`mistake_command`), unlabelled, with the game's reply: the clone learns
    to go on correctly after a mistake (DART-style noise injection). A clone of flawless episodes
    has never read a rejection, and as a teacher it then has no useful advice in exactly the
    states an on-policy student's mistakes reach. Seeded per game (``seed`` and the game's id).

    A game whose expert does not win, has no expert, fails (EnvError), or whose episode is longer
    than ``max_len`` tokens is left out and counted. Returns (sequences, labels, left out).
    """
    from opd.envs import EnvError

    fmt, eos = ChatFormat(tokenizer, tokenizer.eos_token_id), tokenizer.eos_token_id
    seqs, labels, skipped = [], [], 0
    for game in games:
        rng = random.Random(f"{seed}:{game.id}")
        try:
            session = env.open(game)
            try:
                ids, lab = _expert_episode(fmt, eos, env.system_prompt, session, mistakes, rng)
            finally:
                session.close()
        except EnvError:
            ids = None
        if ids is None or len(ids) > max_len:
            skipped += 1
            continue
        seqs.append(ids)
        labels.append(lab)
    return seqs, labels, skipped


class _Transcript:
    """An episode's tokens as it is written, and its labels: the trained commands' tokens (with
    their EOS), -100 on the prompt, the game's replies and commands not trained on."""

    def __init__(self, fmt: ChatFormat, eos: int, ids: list[int], labels: list[int]):
        self.fmt, self.eos, self.ids, self.labels = fmt, eos, ids, labels

    @classmethod
    def start(cls, fmt: ChatFormat, eos: int, system: str, first: str) -> _Transcript:
        ids = fmt.encode(fmt.prompt(system, first))
        return cls(fmt, eos, ids, [-100] * len(ids))

    def fork(self) -> _Transcript:
        return _Transcript(self.fmt, self.eos, list(self.ids), list(self.labels))

    def command(self, text: str, trained: bool) -> None:
        turn = self.fmt.encode(text) + [self.eos]
        self.ids.extend(turn)
        self.labels.extend(turn if trained else [-100] * len(turn))

    def reply(self, observation: str) -> None:
        text = self.fmt.encode(self.fmt.reply(observation, after_eos=True))
        self.ids.extend(text)
        self.labels.extend([-100] * len(text))


def _expert_episode(
    fmt: ChatFormat, eos: int, system: str, session, mistakes: float, rng: random.Random
) -> tuple[list[int], list[int]] | tuple[None, None]:
    out = _Transcript.start(fmt, eos, system, session.reset())
    actions = session.expert_actions()
    if not actions:
        return None, None
    for i, action in enumerate(actions):
        if mistakes and rng.random() < mistakes:
            wrong = mistake_command(session.admissible_commands(), action, rng)
            if wrong is not None:
                out.command(wrong, trained=False)
                result = session.step(wrong)
                if result.done:  # the game's turn limit: this episode cannot be the expert's any more
                    return None, None
                out.reply(result.observation)
        out.command(action, trained=True)
        result = session.step(action)
        if result.done or i == len(actions) - 1:
            return (out.ids, out.labels) if result.won else (None, None)
        out.reply(result.observation)
    return None, None


def dagger_sequences(
    env: Environment,
    played: list[tuple[Game, EpisodeRecord]],
    tokenizer,
    max_len: int,
    branches: int = 2,
    seed: int = 0,
) -> tuple[list, list, int]:
    """Training sequences from episodes another player played (a student's own), labelled by the
    expert from the states that player reached (DAgger's data, one round).

    Each episode is replayed with its own commands: those the expert would have played there are
    trained on, the others are context with the game's replies. At up to ``branches`` of the turns
    where the player went astray (chosen at random, seeded by ``seed`` and the game), a sequence
    ends with the expert's command from that state, trained on: what to do after this player's
    kind of mistakes, which expert episodes never show. Needs the sessions' ``expert_next()``.

    Returns (sequences, labels, episodes that gave none: no expert, a game error, nothing to fix, or
    every branch longer than ``max_len``).
    """
    from opd.envs import EnvError

    fmt, eos = ChatFormat(tokenizer, tokenizer.eos_token_id), tokenizer.eos_token_id
    seqs, labels, skipped = [], [], 0
    for n, (game, record) in enumerate(played):
        rng = random.Random(f"{seed}:{game.id}:{n}")
        try:
            session = env.open(game)
            try:
                found = _dagger_branches(fmt, eos, env.system_prompt, session, record, branches, rng)
            finally:
                session.close()
        except EnvError:
            found = []
        kept = [(ids, lab) for ids, lab in found if len(ids) <= max_len]
        skipped += not kept
        for ids, lab in kept:
            seqs.append(ids)
            labels.append(lab)
    return seqs, labels, skipped


def require_expert_next(session):
    """The session's ``expert_next`` (the optional method DAgger's labels need), or a UserError."""
    expert_next = getattr(session, "expert_next", None)
    if expert_next is None:
        raise UserError(
            f"--dagger-from needs an environment whose sessions have expert_next() ({type(session).__name__} has "
            "none): add it (see opd.envs.base) or drop --dagger-from"
        )
    return expert_next


def _dagger_branches(
    fmt: ChatFormat, eos: int, system: str, session, record: EpisodeRecord, branches: int, rng: random.Random
) -> list[tuple[list[int], list[int]]]:
    expert_next = require_expert_next(session)
    out = _Transcript.start(fmt, eos, system, session.reset())
    points = []  # (the transcript so far, the expert's command there)
    # The turns the game answered: a last command cut by the budget was never played.
    for action in record.actions[: max(len(record.observations) - 1, 0)]:
        expert = expert_next()
        if expert is None:
            break
        agrees = normal_command(action) == normal_command(expert)
        if not agrees:
            points.append((out.fork(), expert))
        out.command(action, trained=agrees)
        result = session.step(action)
        if result.done:
            break
        out.reply(result.observation)
    found = []
    for branch, expert in rng.sample(points, min(branches, len(points))):
        branch.command(expert, trained=True)
        found.append((branch.ids, branch.labels))
    return found


def mistake_command(admissible: list[str] | None, expert: str, rng: random.Random, tries: int = 20) -> str | None:
    """A plausible command the game rejects in this state: an admissible command (or the expert's
    next one) with its verb, one name or one number replaced by another verb, name ("pen" in "pen
    1") or number of the admissible commands: "take pen 1 from shelf 1" where the shelf holds no
    pen, "move apple 1 to ..." before the apple is held, what an imperfect player writes. None when
    the game does not list its admissible commands (a rejection could not be told from a move that
    changes the state) or no such command turns up."""
    if not admissible:
        return None
    valid = {normal_command(c) for c in admissible}
    bases = sorted(c.split() for c in {*valid, normal_command(expert)} if " " in c)  # "look": nothing to get wrong
    pools: dict[str, set[str]] = {"verb": set(), "name": set(), "number": set()}
    for words in bases:
        for i, w in enumerate(words):
            if role := _role(words, i):
                pools[role].add(w)
    for _ in range(tries if bases else 0):
        words = list(rng.choice(bases))
        i = rng.choice([j for j in range(len(words)) if _role(words, j)])
        words[i] = rng.choice(sorted(pools[_role(words, i)]))
        candidate = " ".join(words)
        if candidate not in valid:
            return candidate
    return None


def _role(words: list[str], i: int) -> str:
    """What a command's i-th word is: its verb, a name (followed by a number), a number, or ""."""
    if i == 0:
        return "verb"
    if words[i].isdigit():
        return "number"
    return "name" if i + 1 < len(words) and words[i + 1].isdigit() else ""


def check_episode_context(model, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Before any work: the longest prompt an episode may have plus its token budget must fit the
    model's positions (a longer first observation ends its episode, counted, instead)."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and max_prompt_tokens + max_new_tokens > context:
        raise UserError(
            f"--max-prompt-tokens {max_prompt_tokens} plus --max-new-tokens {max_new_tokens} (an episode's prompt "
            f"and its budget) exceed the model's context of {context} positions; lower one of them"
        )
