"""TextWorld's own games: the cooking games of the First TextWorld Problems (``tw-cooking``).

The player is told to cook the meal in the cookbook: find the cookbook, read the recipe, find
the ingredients (opening doors and containers at higher levels), prepare the meal, eat it.
Games are generated in-process by TextWorld (``textworld.challenges.CHALLENGES``, compiled with
Inform 7), written on first use under ``games_dir`` (default ``~/.cache/opd/textworld/<level>``)
and reused afterwards; generation is a function of (level, seed) (the story file's header
also carries the compile date, Inform's serial number). Train games use TextWorld's
"train" foods and even seeds, test games its "test" foods and odd seeds.

Rewards are the game's points divided by its maximum, per step, so a won episode sums to 1.
Observations are built from the game's objective, room description and inventory at the
start and its feedback afterwards, without the banner, the status line or score messages.

Usage::

    env = get_env("textworld", level=1)
    session = env.open(env.games("train")[0])
    print(session.reset())
    print(session.step("examine cookbook").observation)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd.envs._textworld import TextWorldSession, check_int, require, squeeze
from opd.envs.environment import EnvError, Game
from opd.errors import UserError

SYSTEM_PROMPT = (
    "You are playing a text adventure. Each turn, read what you see and reply with exactly one "
    "command, for example: examine cookbook, go north, open fridge, take carrot from fridge, "
    "slice carrot with knife, cook carrot with stove, prepare meal, eat meal, inventory, look."
)
GOAL = "cook the recipe in the cookbook and eat the meal"


@dataclass(frozen=True)
class CookingLevel:
    settings: dict[str, Any]  # tw-cooking's settings (all keys are required by its make())
    max_turns: int  # about 3x the walkthrough's length


def _settings(recipe: int, take: int, go: int, open: bool = False, cook: bool = False, cut: bool = False) -> dict:
    return {"recipe": recipe, "take": take, "go": go, "open": open, "cook": cook, "cut": cut, "drop": False}


LEVELS: dict[int, CookingLevel] = {
    1: CookingLevel(_settings(recipe=1, take=1, go=1), 15),  # one room, one ingredient: walkthrough 5
    2: CookingLevel(_settings(recipe=1, take=1, go=6, open=True), 30),  # six rooms, doors: about 6-12
    3: CookingLevel(_settings(recipe=2, take=2, go=6, open=True, cook=True, cut=True), 50),  # about 12-20
}
_MAX_PER_SPLIT = 10**6

# What the Inform 7 engine adds around the story text.
_NOISE = re.compile(
    r"^\s*(>.*|.*-= .+ =-\d+/\d+\s*|Your score has just gone up by .*|\*\*\* The End \*\*\*"
    r"|You scored \d+ out of a possible \d+.*|Would you like to RESTART.*)$",
    re.MULTILINE,
)


def clean(text: str) -> str:
    """A TextWorld text without the prompt/status line and the score and end-of-game messages."""
    return squeeze(_NOISE.sub("", text or ""))


@contextlib.contextmanager
def _quiet_jericho():
    # jericho warns that TextWorld's games are "not fully supported" (its own score and change
    # detection): TextWorld tracks the game state itself, so nothing used here is missing.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        yield


def check_story_file(path: str | os.PathLike) -> None:
    """Raise ValueError unless ``path`` is a whole Z-machine story file.

    The interpreter (jericho) ends the whole process with "Fatal error: Story file read error"
    on a bad file, so a corrupted game would kill the training run instead of one episode. The
    header's version, length and checksum catch a truncated or overwritten file first."""
    data = Path(path).read_bytes()
    if len(data) < 64 or not 1 <= data[0] <= 8:
        raise ValueError("not a Z-machine story file (bad header)")
    scale = 2 if data[0] <= 3 else 4 if data[0] <= 5 else 8
    length = int.from_bytes(data[0x1A:0x1C], "big") * scale
    if length > len(data) or sum(data[0x40:length]) % 0x10000 != int.from_bytes(data[0x1C:0x1E], "big"):
        raise ValueError("damaged Z-machine story file (length or checksum does not match its header)")


class CookingSession(TextWorldSession):
    def _make_engine(self) -> Any:
        textworld = require("textworld")
        infos = textworld.EnvInfos(
            objective=True,
            description=True,
            inventory=True,
            feedback=True,
            admissible_commands=True,
            score=True,
            max_score=True,
            won=True,
            lost=True,
        )
        if not Path(self.path).with_suffix(".json").is_file():
            raise FileNotFoundError(f"{Path(self.path).with_suffix('.json')} is missing")
        check_story_file(self.path)
        with _quiet_jericho():
            return textworld.start(self.path, infos)

    def _first_text(self, state: Any) -> str:
        parts = (state["objective"], clean(state["description"]), state["inventory"])
        return squeeze("\n\n".join(p.strip() for p in parts if p and p.strip()))

    def _text(self, state: Any) -> str:
        return clean(state["feedback"])

    def _score_of(self, state: Any) -> float:
        return float(state["score"]) / max(float(state["max_score"] or 1), 1.0)

    def _expert(self) -> list[str] | None:
        # The game's walkthrough: it reads the cookbook first, as a player who does not know the
        # recipe must (the quest's shorter policy_commands skip that).
        data = json.loads(Path(self.path).with_suffix(".json").read_text())
        return list(data.get("metadata", {}).get("walkthrough") or []) or None


class TextWorldEnv:
    """tw-cooking games at a difficulty ``level`` (see the module docstring)."""

    name = "textworld"
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        level: int = 1,
        seed: int = 0,
        num_train: int = 200,
        num_test: int = 20,
        games_dir: str | os.PathLike | None = None,
        max_turns: int | None = None,
    ):
        if level not in LEVELS:
            raise UserError(f"unknown textworld level {level!r}: use one of {', '.join(map(str, LEVELS))}")
        self.level = level
        self.seed = check_int("seed", seed, 0)
        self.num = {"train": check_int("num_train", num_train, 1), "test": check_int("num_test", num_test, 1)}
        if max(self.num.values()) > _MAX_PER_SPLIT:
            raise UserError(f"num_train and num_test must be at most {_MAX_PER_SPLIT}")
        self.max_turns = LEVELS[level].max_turns if max_turns is None else check_int("max_turns", max_turns, 1)
        base = Path(games_dir) if games_dir is not None else Path.home() / ".cache" / "opd" / "textworld" / str(level)
        self.games_dir = base.expanduser()
        require("textworld")  # a missing engine is a UserError now, not at the first game

    def games(self, split: str) -> list[Game]:
        if split not in self.num:
            raise UserError(f"unknown split {split!r} for textworld games: use 'train' or 'test'")
        out = []
        for i in range(self.num[split]):
            seed = 2 * (self.seed * _MAX_PER_SPLIT + i) + (split == "test")  # train even, test odd
            path = self.games_dir / split / f"cooking-s{seed}" / "game.z8"
            info = {"level": self.level, "seed": seed, "split": split}
            out.append(Game(id=f"{split}/cooking-s{seed}", goal=GOAL, path=str(path), info=info))
        return out

    def open(self, game: Game) -> CookingSession:
        if game.path is None:
            raise EnvError(f"game {game.id} has no game file")
        if not Path(game.path).is_file():
            try:
                generate_cooking(self.level, game.info["seed"], game.info["split"], Path(game.path).parent)
            except (KeyError, TypeError):
                raise EnvError(
                    f"game {game.id}: its file {game.path} is missing and it is not a generated game"
                ) from None
        session = CookingSession(game.path, self.max_turns)
        session.load()
        return session


def generate_cooking(level: int, seed: int, split: str, out_dir: str | os.PathLike) -> Path:
    """Write tw-cooking game (level, seed) of TextWorld's food ``split`` into the folder ``out_dir``
    (``game.z8`` with its ``game.json``), unless it is there. Compiled in a temporary folder that
    is renamed into place, so processes generating the same game at once do not clash."""
    out = Path(out_dir)
    if (out / "game.z8").is_file() and (out / "game.json").is_file():
        return out
    textworld = require("textworld")
    challenges = require("textworld.challenges")
    generator = require("textworld.generator")
    settings = {**LEVELS[level].settings, "recipe_seed": 0, "split": "test" if split == "test" else "train"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        options = textworld.GameOptions()
        options.seeds = seed
        options.path = str(tmp / "game.z8")
        options.force_recompile = True
        with _quiet_jericho():  # make() plays the game once to record its walkthrough
            game = challenges.CHALLENGES["tw-cooking"][1](settings, options)  # (description, make, argparser)
            generator.compile_game(game, options)
        try:
            os.rename(tmp, out)
        except OSError:  # another process got there first; its game is the same
            if not (out / "game.z8").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_OPTIONS = ("level", "seed", "num_train", "num_test", "games_dir", "max_turns")


def make_textworld(**kwargs: Any) -> TextWorldEnv:
    """``get_env("textworld", ...)``: see :class:`TextWorldEnv` for the options."""
    unknown = sorted(set(kwargs) - set(_OPTIONS))
    if unknown:
        raise UserError(f"unknown textworld option(s) {', '.join(unknown)}: use {', '.join(_OPTIONS)}")
    return TextWorldEnv(**kwargs)
