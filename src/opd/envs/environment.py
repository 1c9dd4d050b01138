"""The environment protocol: multi-turn text games (and tools) the student plays for agentic OPD.

An environment is two small objects, Gymnasium-like:

* an :class:`Environment` (one per kind, built by name from the registry): its games per split,
  the instructions shown to the model as the system turn, and ``open(game)`` which starts a
  session;
* a :class:`GameSession` (one per episode): ``reset()`` returns the first observation;
  ``step(action)`` returns the environment's reply, the reward, and whether the episode is over
  and won; ``admissible_commands()`` and ``expert_actions()`` where the game provides them, and
  optionally ``expert_next()``: the expert's next command from the current state, whatever was
  played before (it labels the states another player reached: ``opd sft --dagger-from``).

Actions and observations are plain text: the environment never sees tokens, and the trainer
never sees game internals. An action the game does not understand is the game's business (it
answers "Nothing happens." or similar); a session raises :class:`EnvError` only when it cannot
go on at all (a game file that fails to load, an engine that crashed), and the rollout then
ends that episode, counts it, and goes on with the others.

Plugging in your own environment::

    @dataclass
    class MySession:
        def reset(self) -> str: return "You are in a room. Goal: open the box."
        def step(self, action: str) -> StepResult:
            won = action.strip() == "open box"
            return StepResult("The box opens." if won else "Nothing happens.", float(won), won, won)
        def admissible_commands(self): return ["open box", "look"]
        def expert_actions(self): return ["open box"]
        def close(self): pass

    class MyEnv:
        name, system_prompt, max_turns = "box", "Play the game. Answer with one command.", 5
        def games(self, split): return [Game(id=f"{split}-0", goal="open the box")]
        def open(self, game): return MySession()

    register_env("box", lambda **kw: MyEnv())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from opd.errors import UserError

__all__ = [
    "EnvError",
    "Game",
    "StepResult",
    "GameSession",
    "Environment",
    "ENV_SPLITS",
    "register_env",
    "get_env",
    "env_names",
]

# "train" games are played in training; "test" games are held out for evaluation. Environments
# with more splits (ALFWorld's valid_seen / valid_unseen) map them onto these two and may accept
# their own names too.
ENV_SPLITS = ("train", "test")


def normal_command(text: str) -> str:
    """A command as games compare them: lower case, single spaces."""
    return " ".join(text.lower().split())


class EnvError(RuntimeError):
    """A game that cannot go on (failed to load, engine crashed): the episode ends and is counted,
    the run goes on. Not for actions the game rejects: those are answered with an observation."""


@dataclass(frozen=True)
class Game:
    """One playable game. ``id`` is unique within its environment and stable across runs (it
    seeds nothing by itself); ``path`` is the game file where there is one, in a folder of its
    own (a run copies that folder into ``eval_games/`` to keep its held-out games); ``goal`` the
    task's text (for eval.jsonl and reports)."""

    id: str
    goal: str = ""
    path: str | None = None
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one action.

    ``observation`` is the text the model reads next (already cleaned for a language model);
    ``reward`` this step's reward (not cumulative); ``done`` ends the episode (won, lost, or the
    game's own limit); ``won`` says whether it ended in success."""

    observation: str
    reward: float
    done: bool
    won: bool


@runtime_checkable
class GameSession(Protocol):
    """One episode of one game."""

    def reset(self) -> str:
        """Start (or restart) the episode; the first observation, goal included."""
        ...

    def step(self, action: str) -> StepResult:
        """Play ``action`` (free text, as the model wrote it, stripped)."""
        ...

    def admissible_commands(self) -> list[str] | None:
        """The commands the game accepts in the current state, or None if it does not say."""
        ...

    def expert_actions(self) -> list[str] | None:
        """A winning action sequence from the start of the episode, or None without an expert."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Environment(Protocol):
    """A kind of game: its games per split, its instructions, and sessions."""

    name: str
    system_prompt: str  # the system turn of every episode: what the game is, how to answer
    max_turns: int  # the episode ends (not won) after this many actions

    def games(self, split: str) -> list[Game]:
        """The games of ``split`` ("train" or "test"), in a fixed order."""
        ...

    def open(self, game: Game) -> GameSession:
        """A new session on ``game``; raises EnvError if the game cannot be loaded."""
        ...


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register_env(name: str, factory: Callable[..., Environment]) -> None:
    """Make ``get_env(name, **kwargs)`` build an environment with ``factory(**kwargs)``."""
    _REGISTRY[name] = factory


def env_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_env(name: str, **kwargs: Any) -> Environment:
    """Build an environment by name: ``get_env("alfworld", level=1, seed=0)``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UserError(
            f"unknown environment {name!r}: use one of {', '.join(env_names()) or '(none registered)'}"
        ) from None
    return factory(**kwargs)
