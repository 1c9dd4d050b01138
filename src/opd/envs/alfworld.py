"""ALFWorld, the default agentic environment: household tasks played as a text game.

The student reads "You are in the middle of a room. Looking quickly around you, you see a
countertop 1, a fridge 1, ... Your task is to: put a clean apple in fridge." and answers one
command a turn ("go to countertop 1", "take apple 1 from countertop 1", "clean apple 1 with
sinkbasin 1", ...) until the task is done (reward 1) or the turns run out.

Two sources of games, one engine (ALFWorld's: textworld's PddlEnv over alfworld's PDDL domain
and grammar, with alfworld's name demangler):

* generated (default): small problems of the six ALFWorld task types at a difficulty
  ``level`` (see :mod:`opd.envs.alfworld_gen`), written on first use under ``games_dir``
  (default ``~/.cache/opd/alfworld/<level>``) and reused afterwards. Train games have even
  seeds, test games odd ones, so the two never share a game. A third split, ``valid``, holds
  games for choosing a recipe without touching the test games (``test_split="valid"`` makes
  evaluation play them): even seeds counted down from the far end of the train games' stream,
  so it shares no game with either split, whatever their sizes.
* real: with ``ALFWORLD_DATA`` set (or ``data_dir=``), ALFWorld's own games from the folder
  ``alfworld-download`` fills: "train" plays ``json_2.1.1/train``, "test" plays
  ``valid_unseen`` (``test_split="valid_seen"`` for the other; both names are splits too).

The expert (``expert_actions()``) of generated games searches: it acts only on what it has read
(:mod:`opd.envs.alfworld_expert`); ``expert="planner"`` gives the PDDL planner's omniscient
plan instead, the default for real games.

Usage::

    env = get_env("alfworld", level=2, seed=0)       # or get_env("alfworld") with ALFWORLD_DATA
    game = env.games("train")[0]
    session = env.open(game)
    obs = session.reset()
    result = session.step("go to countertop 1")
    session.close()
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any, cast

from opd.envs._textworld import PLAYERS, TextWorldSession, alfworld_modules, check_int, planner_plan, squeeze
from opd.envs.alfworld_expert import SearchPolicy, search_expert, task_of
from opd.envs.alfworld_gen import LEVELS, TASK_TYPES, draw, generate_game, level_spec
from opd.envs.environment import EnvError, Game, StepResult
from opd.errors import UserError

SYSTEM_PROMPT = (
    "You are a household robot in a text game. Each turn, read what you see and reply with "
    "exactly one command, for example: go to countertop 1, open fridge 1, take apple 1 from "
    "countertop 1, move apple 1 to fridge 1, heat apple 1 with microwave 1, cool apple 1 with "
    "fridge 1, clean apple 1 with sinkbasin 1, use desklamp 1, look, inventory. Finish the task."
)
REAL_SPLITS = ("train", "valid_seen", "valid_unseen")
REAL_TURNS = 50  # the budget ALFWorld's own evaluations give a real game
_BANNER = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
_GOAL = re.compile(r"Your task is to: (.*?)\.?\"\s*$", re.MULTILINE)
_TEST_OFFSET = 1  # test seeds are odd, train seeds even: see _seed
_MAX_PER_SPLIT = 10**6
EXPERTS = ("search", "planner")


class AlfworldSession(TextWorldSession):
    def __init__(self, path: str, max_turns: int, expert: Any):
        super().__init__(path, max_turns)
        self._expert_of = expert
        self._history: list[tuple[str, str]] = []  # the first observation, then (command, reply)
        self._task: tuple[str, dict] | None = None  # read from traj_data.json when first needed

    def reset(self) -> str:
        text = super().reset()
        self._history = [("", text)]
        return text

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        self._history.append((action, result.observation))
        return result

    def expert_next(self) -> str | None:
        """The search expert's next command from here, whatever was played so far (it reads the
        episode's transcript, see :class:`~opd.envs.alfworld_expert.SearchPolicy`); None once the
        task is done or before ``reset()``."""
        if not self._history:
            return None
        if self._task is None:
            self._task = task_of(self.path)
        task_type, params = self._task
        policy = SearchPolicy(self._history[0][1], task_type, params, self.path)
        for command, reply in self._history[1:]:
            policy.observe(command, reply)
        return policy.next_action()

    def _make_engine(self) -> Any:
        env = PLAYERS.take()
        try:
            env.load(self.path)
        except Exception:
            env.close()  # half-loaded: not back into the pool
            raise
        return env

    def _release(self, env: Any, broken: bool) -> None:
        if broken:
            env.close()
        else:
            PLAYERS.give_back(env)

    def _first_text(self, state: Any) -> str:
        return squeeze(_BANNER.sub("", state["feedback"]))

    def _text(self, state: Any) -> str:
        return squeeze(state["feedback"])

    def _expert(self) -> list[str] | None:
        return self._expert_of(self.path)


class AlfworldEnv:
    """ALFWorld games, generated or real (see the module docstring).

    Generated games: ``level`` (1-3, see ``alfworld_gen.LEVELS``), ``seed`` (another set of
    games), ``num_train`` / ``num_test`` / ``num_valid`` games per split, ``games_dir`` (the
    cache), ``test_split="valid"`` (evaluation plays the validation games). Real games:
    ``data_dir`` (default ``$ALFWORLD_DATA``; ``generated=True`` ignores the variable),
    ``test_split`` (what "test" plays), ``max_games`` (a cap per split). Both: ``max_turns``
    (default: the level's, or 50 for real games); ``expert``: what ``expert_actions()`` plays,
    "search" (default for generated games: searches the receptacles in the listed order and acts
    only on what it has seen, see :mod:`opd.envs.alfworld_expert`) or "planner" (the PDDL
    planner's omniscient plan, default for real games, where the search is untested)."""

    name = "alfworld"
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        level: int = 1,
        seed: int = 0,
        num_train: int = 500,
        num_test: int = 50,
        num_valid: int = 50,
        games_dir: str | os.PathLike | None = None,
        data_dir: str | os.PathLike | None = None,
        generated: bool = False,
        test_split: str = "valid_unseen",
        max_turns: int | None = None,
        max_games: int | None = None,
        expert: str | None = None,
    ):
        level_spec(level)  # an unknown level is a UserError naming the levels
        self.level = int(level)
        alfworld_modules()  # a missing engine is a UserError now, not at the first game
        self.seed = check_int("seed", seed, 0)
        self.num = {
            "train": check_int("num_train", num_train, 1),
            "test": check_int("num_test", num_test, 1),
            "valid": check_int("num_valid", num_valid, 1),
        }
        if max(self.num.values()) > _MAX_PER_SPLIT:
            raise UserError(f"num_train, num_test and num_valid must be at most {_MAX_PER_SPLIT}")
        if self.num["train"] + self.num["valid"] > _MAX_PER_SPLIT:  # the two share one stream of seeds
            raise UserError(f"num_train + num_valid must be at most {_MAX_PER_SPLIT}")
        if test_split not in ("valid_seen", "valid_unseen", "valid"):
            raise UserError(
                f"test_split={test_split!r}: use 'valid_unseen' (the default) or 'valid_seen' for real games,"
                " 'valid' for generated games' validation split"
            )
        self.test_split = test_split
        self.max_games = None if max_games is None else check_int("max_games", max_games, 1)
        self.data_dir = None if generated else _real_root(data_dir)
        if self.data_dir is not None and test_split == "valid":
            raise UserError(
                "test_split='valid' plays generated games' validation split; real ALFWorld games have"
                " 'valid_seen' and 'valid_unseen' (or pass generated=True)"
            )
        if expert is not None and expert not in EXPERTS:
            raise UserError(f"expert={expert!r}: use 'search' or 'planner'")
        self.expert = expert or ("planner" if self.data_dir else "search")
        default_turns = REAL_TURNS if self.data_dir else LEVELS[self.level].max_turns
        self.max_turns = default_turns if max_turns is None else check_int("max_turns", max_turns, 1)
        base = Path(games_dir) if games_dir is not None else Path.home() / ".cache" / "opd" / "alfworld" / str(level)
        self.games_dir = base.expanduser()
        self._plans: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # What an env worker process receives (opd.envs.workers): a lock does not pickle, and each
        # process finds the expert plans it needs.
        return {k: v for k, v in self.__dict__.items() if k not in ("_plans", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._plans, self._lock = {}, threading.Lock()

    # -- games
    def games(self, split: str) -> list[Game]:
        if self.data_dir is not None:
            return self._real_games(self.data_dir, split)
        if split == "test" and self.test_split == "valid":
            split = "valid"
        if split not in self.num:
            raise UserError(f"unknown split {split!r} for generated ALFWorld games: use 'train', 'test' or 'valid'")
        types = LEVELS[self.level].task_types
        out = []
        for i in range(self.num[split]):
            task_type = types[i % len(types)]  # every type equally often, in a fixed order
            seed = _seed(self.seed, split, i)
            _, goal = draw(task_type, self.level, seed)
            folder = self.games_dir / split / f"{task_type}-s{seed}"
            info = {"task_type": task_type, "level": self.level, "seed": seed, "split": split}
            out.append(Game(id=f"{split}/{task_type}-s{seed}", goal=goal, path=str(folder / "game.tw-pddl"), info=info))
        return out

    def _real_games(self, data_dir: Path, split: str) -> list[Game]:
        folder_name = {"train": "train", "test": self.test_split}.get(split, split)
        if folder_name not in REAL_SPLITS:
            raise UserError(f"unknown ALFWorld split {split!r}: use train, test, valid_seen or valid_unseen")
        folder = data_dir / folder_name
        out = []
        for traj_path in sorted(folder.rglob("traj_data.json")):
            game = _real_game(folder, traj_path, split)
            if game is not None:
                out.append(game)
                if self.max_games and len(out) >= self.max_games:
                    break
        if not out:
            raise UserError(
                f"no playable ALFWorld games in {folder}: expected <task>-<...>/<trial>/ folders with game.tw-pddl"
                f" (solvable) and traj_data.json, as alfworld-download writes them; run alfworld-download"
                f" with ALFWORLD_DATA={data_dir.parent}, or unset ALFWORLD_DATA (or pass generated=True) to play generated games"
            )
        return out

    # -- sessions
    def open(self, game: Game) -> AlfworldSession:
        if game.path is None:
            raise EnvError(f"game {game.id} has no game file")
        if self.data_dir is None and not Path(game.path).is_file():
            self._generate(game)
        session = AlfworldSession(game.path, self.max_turns, self._expert)
        session.load()
        return session

    def _generate(self, game: Game) -> None:
        info = game.info
        try:
            folder = Path(cast(str, game.path)).parent  # open() checked that the game has a path
            generate_game(info["level"], info["seed"], info["task_type"], folder)
        except (KeyError, TypeError):
            raise EnvError(f"game {game.id}: its file {game.path} is missing and it is not a generated game") from None

    def _expert(self, path: str) -> list[str]:
        """The expert's actions, found once per game file: the search expert plays the game; the
        planner's plan is stored in generated games and computed for real ones."""
        with self._lock:
            if path in self._plans:
                return list(self._plans[path])
        if self.expert == "search":
            plan = search_expert(path)
        else:
            data = json.loads(Path(path).read_text())
            walkthrough = data.get("walkthrough") if data.get("opd_generated") else None
            plan = list(walkthrough) if walkthrough else planner_plan(path)
        with self._lock:
            self._plans[path] = plan
        return list(plan)


def _seed(base: int, split: str, i: int) -> int:
    """Game ``i`` of ``split``: train seeds even, test seeds odd, so the two never overlap;
    validation seeds even, from the far end of the train stream (num_train + num_valid is capped)."""
    if split == "valid":
        i = _MAX_PER_SPLIT - 1 - i
    return 2 * (base * _MAX_PER_SPLIT + i) + (_TEST_OFFSET if split == "test" else 0)


def _real_root(data_dir: str | os.PathLike | None) -> Path | None:
    """The ``json_2.1.1`` folder of real ALFWorld data, or None to play generated games."""
    source = "data_dir" if data_dir is not None else "ALFWORLD_DATA"
    raw = data_dir if data_dir is not None else os.environ.get("ALFWORLD_DATA")
    if raw is None or str(raw) == "":
        return None
    root = Path(raw).expanduser()
    for candidate in (root / "json_2.1.1", root):
        if any((candidate / s).is_dir() for s in REAL_SPLITS):
            return candidate
    state = "does not exist" if not root.exists() else "has no json_2.1.1/{train,valid_seen,valid_unseen} folders"
    raise UserError(
        f"{source}={raw} {state}: expected the folder alfworld-download fills"
        f" ({root}/json_2.1.1/<split>/<task>/<trial>/game.tw-pddl + traj_data.json);"
        f" run `ALFWORLD_DATA={raw} alfworld-download`, point {source} at that folder,"
        " or unset it (or pass generated=True) to play generated games"
    )


def _real_game(split_dir: Path, traj_path: Path, split: str) -> Game | None:
    """One real game, filtered as ALFWorld's AlfredTWEnv does (no movable receptacles or
    sliced objects, one of the six task types, a game file marked solvable)."""
    rel = traj_path.parent.relative_to(split_dir).as_posix()
    game_path = traj_path.parent / "game.tw-pddl"
    if "movable" in rel or "Sliced" in rel or not game_path.is_file():
        return None
    try:
        traj = json.loads(traj_path.read_text())
        data = json.loads(game_path.read_text())
    except (OSError, ValueError):
        return None  # a broken file among thousands: skipped here, as AlfredTWEnv does
    if traj.get("task_type") not in TASK_TYPES or not data.get("solvable"):
        return None
    match = _GOAL.search(data.get("grammar", ""))
    info = {"task_type": traj["task_type"], "split": split}
    return Game(id=rel, goal=match.group(1) if match else "", path=str(game_path), info=info)


_OPTIONS = (
    "level",
    "seed",
    "num_train",
    "num_test",
    "num_valid",
    "games_dir",
    "data_dir",
    "generated",
    "test_split",
    "max_turns",
    "max_games",
    "expert",
)


def make_alfworld(**kwargs: Any) -> AlfworldEnv:
    """``get_env("alfworld", ...)``: see :class:`AlfworldEnv` for the options."""
    unknown = sorted(set(kwargs) - set(_OPTIONS))
    if unknown:
        raise UserError(f"unknown ALFWorld option(s) {', '.join(unknown)}: use {', '.join(_OPTIONS)}")
    return AlfworldEnv(**kwargs)
