"""Behaviour-cloning data from an environment's expert, in the episode format the student later plays.

* :func:`expert_sequences`: the environment's expert episodes in the same episode format, with
  labels on the action tokens only, for ``opd sft --env`` (behaviour cloning: the game teacher and
  the student start there);
* :func:`dagger_sequences`: another player's episodes labelled by the expert from the states that
  player reached (``opd sft --dagger-from``); :func:`mistake_command`, the rejected commands an
  expert episode may be given on purpose (``--expert-mistakes``).
"""

from __future__ import annotations

import random

from opd.envs import Environment, Game, normal_command
from opd.errors import UserError
from opd.rollout.episodes import ChatFormat, EpisodeRecord


def expert_sequences(
    env: Environment, games: list[Game], tokenizer, max_len: int, mistakes: float = 0.0, seed: int = 0
) -> tuple[list, list, int]:
    """The expert's episodes as token sequences in the episode format of :mod:`opd.rollout.episodes` and
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
            "none): add it (see opd.envs.environment) or drop --dagger-from"
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
