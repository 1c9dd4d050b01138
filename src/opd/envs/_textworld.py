"""What the ALFWorld and TextWorld environments share: importing the optional engines, the
ALFWorld engine (textworld's PddlEnv with alfworld's name demangler), its planner, cleaning
actions and observations, and one session class over any TextWorld environment.

Not a public API; :mod:`opd.envs.alfworld` and :mod:`opd.envs.textworld_games` are.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import tempfile
import threading
from functools import cache
from pathlib import Path
from typing import Any

from opd.envs import _pddl_cache
from opd.envs.environment import EnvError, StepResult
from opd.errors import UserError

INSTALL_HINT = "pip install 'opd[agent]'"


def require(module: str) -> Any:
    """Import an optional engine, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"the agentic environments need alfworld and textworld ({e}): run {INSTALL_HINT}") from None


def check_int(name: str, value: Any, low: int) -> int:
    """An integer option, or a UserError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{name}={value!r}: expected an integer >= {low}")
    return value


def alfworld_paths() -> tuple[str, str]:
    """alfworld's PDDL domain and grammar files, found without importing alfworld (see below)."""
    spec = importlib.util.find_spec("alfworld")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the ALFWorld environment needs the alfworld package: run {INSTALL_HINT}")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return str(data / "alfred.pddl"), str(data / "alfred.twl2")


@cache
def alfworld_modules() -> tuple[Any, Any]:
    """``alfworld.gen.constants`` and ``alfworld.gen.goal_library``.

    Importing any alfworld module runs ``alfworld/info.py``, which creates the folder named by
    ``ALFWORLD_DATA`` (default ``~/.cache/alfworld``) and then sets ``ALFWORLD_DATA`` in this
    process's environment. Both would make a wrong ``ALFWORLD_DATA`` look usable and make a
    missing one look set, so the import runs with the variable pointing at a temporary folder
    that exists, and the caller's value is put back afterwards."""
    require("textworld")
    before = os.environ.get("ALFWORLD_DATA")
    os.environ["ALFWORLD_DATA"] = tempfile.gettempdir()
    try:
        constants = require("alfworld.gen.constants")
        glib = require("alfworld.gen.goal_library")
        require("alfworld.agents.environment.alfred_tw_env")  # the demangler, below
    finally:
        if before is None:
            os.environ.pop("ALFWORLD_DATA", None)
        else:
            os.environ["ALFWORLD_DATA"] = before
    return constants, glib


def pddl_env(**infos: bool) -> Any:
    """ALFWorld's text engine: textworld's PddlEnv, with alfworld's demangler so that objects
    read "apple 1", not "apple_bar_1" (what alfworld's own AlfredTWEnv plays, minus its
    multiprocess gym batching)."""
    alfworld_modules()
    textworld = require("textworld")
    pddl = require("textworld.envs.pddl")
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler

    request = textworld.EnvInfos(admissible_commands=True, won=True, **infos)
    _pddl_cache.install()  # the engine re-parses the same text at every load, reset and step
    try:
        env = pddl.PddlEnv(request)
    except ImportError as e:  # textworld without its [pddl] extra (fast-downward)
        raise UserError(f"the ALFWorld engine needs fast-downward ({e}): run {INSTALL_HINT}") from None
    return AlfredDemangler(env, shuffle=False)


class EnginePool:
    """Idle ALFWorld engines, reused from game to game.

    Each PddlEnv loads its own copy of fast-downward's 33 MB library (so that engines do not
    share the planner's global state) and never unloads it: an engine per episode would grow
    the process by one library copy per episode. Engines are taken for a session (or a check)
    and given back when it closes, so there are only ever as many as were in use at once."""

    def __init__(self, **infos: bool):
        self._infos = infos
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return pddl_env(**self._infos)

    def give_back(self, env: Any) -> None:
        with self._lock:
            self._idle.append(env)


PLAYERS = EnginePool()  # sessions and checks
PLANNERS = EnginePool(policy_commands=True)  # replans on every step: for expert plans only


def planner_plan(game: str | dict[str, Any]) -> list[str]:
    """The planner's winning commands from the start of an ALFWorld game (file or its data)."""
    env = PLANNERS.take()
    try:
        env.load(game)
        plan = list(env.reset()["policy_commands"] or [])
    except Exception:
        env.close()  # a failed load may leave it half-built: do not reuse it
        raise
    PLANNERS.give_back(env)
    return plan


def play_pddl(game: str | dict[str, Any], commands: list[str]) -> tuple[bool, bool]:
    """(won at the start, won after ``commands``) for an ALFWorld game."""
    env = PLAYERS.take()
    try:
        env.load(game)
        state = env.reset()
        won_at_start = bool(state["won"])
        for command in commands:
            state, _, _ = env.step(command)
    except Exception:
        env.close()
        raise
    PLAYERS.give_back(env)
    return won_at_start, bool(state["won"])


_LEADING = re.compile(r"^(?:>\s*|action:\s*|command:\s*)", re.IGNORECASE)


def clean_action(text: str) -> str:
    """The command in what a model wrote: its first non-empty line, lower case, single spaces,
    without a "> " prompt, quotes or final period (the engines match commands exactly)."""
    line = next((s for s in str(text).splitlines() if s.strip()), "")
    line = _LEADING.sub("", line.strip()).strip().strip("\"'`").rstrip(".!").strip()
    return " ".join(line.lower().split())


def squeeze(text: str) -> str:
    """Blank-line runs to one blank line, no trailing spaces, no outer whitespace."""
    lines = [s.rstrip() for s in text.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


class TextWorldSession:
    """A :class:`~opd.envs.environment.GameSession` over a TextWorld environment.

    Subclasses say how to get a loaded engine (``_make_engine``) and give it back
    (``_release``), how to turn its states into text (``_first_text``, ``_text``) and what the
    expert plays (``_expert``). Every engine error becomes an :class:`EnvError` naming the game."""

    def __init__(self, path: str, max_turns: int):
        self.path = path
        self.max_turns = max_turns
        self._env: Any = None
        self._state: Any = None
        self._turns = 0
        self._score = 0.0
        self._done = False

    # -- subclass hooks
    def _make_engine(self) -> Any:
        raise NotImplementedError

    def _release(self, env: Any, broken: bool) -> None:
        env.close()

    def _first_text(self, state: Any) -> str:
        raise NotImplementedError

    def _text(self, state: Any) -> str:
        raise NotImplementedError

    def _expert(self) -> list[str] | None:
        raise NotImplementedError

    def _score_of(self, state: Any) -> float:
        return float(bool(state["won"]))

    # -- the protocol
    def load(self) -> None:
        """Load the game now (``open()`` calls this, so a broken file fails there)."""
        if self._env is not None:
            return
        try:
            self._env = self._make_engine()
        except UserError:
            raise
        except Exception as e:  # the engines' errors are many (JSON, PDDL, Inform7, OSError)
            raise EnvError(f"cannot load game {self.path}: {type(e).__name__}: {e}") from e

    def reset(self) -> str:
        self.load()
        try:
            self._state = self._env.reset()
            text = self._first_text(self._state)
            self._score = self._score_of(self._state)
        except Exception as e:
            self._drop(broken=True)
            raise EnvError(f"cannot start game {self.path}: {type(e).__name__}: {e}") from e
        self._turns, self._done = 0, False
        return text

    def step(self, action: str) -> StepResult:
        if self._state is None or self._env is None:
            raise EnvError(f"step() before reset() on game {self.path}")
        if self._done:
            return StepResult("The game is over.", 0.0, True, bool(self._state["won"]))
        try:
            state, _, _ = self._env.step(clean_action(action))
            text = self._text(state)
            score = self._score_of(state)
        except Exception as e:
            self._done = True
            self._drop(broken=True)
            raise EnvError(f"game {self.path} failed on {action!r}: {type(e).__name__}: {e}") from e
        self._state = state
        self._turns += 1
        # The engines report a cumulative score; the protocol's reward is per step.
        reward, self._score = score - self._score, score
        won = bool(state["won"])
        self._done = won or bool(state.get("lost")) or self._turns >= self.max_turns
        return StepResult(text, reward, self._done, won)

    def admissible_commands(self) -> list[str] | None:
        if self._state is None:
            return None
        return list(self._state["admissible_commands"] or [])

    def expert_actions(self) -> list[str] | None:
        try:
            return self._expert()
        except (EnvError, UserError):
            raise
        except Exception as e:
            raise EnvError(f"no expert for game {self.path}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self._drop(broken=False)

    def _drop(self, broken: bool) -> None:
        env, self._env = self._env, None
        if env is not None:
            self._release(env, broken)
