"""A tiny text game, "unlock the box": pure Python, deterministic, seeded; for tests and as the
template for your own environment (copy this file, keep the protocol of :mod:`opd.envs.environment`).

Each game has a few rooms joined in a line, keys and boxes of different colours lying about, and
one goal: open the box of a given colour, which needs the key of that colour in hand. Commands::

    go to ROOM        take COLOUR key        open COLOUR box        look        inventory

A command the game does not accept in the current state is answered "Nothing happens." (the
model's mistake is part of the episode, never an error). Winning gives reward 1 and ends the
episode; every other step gives 0. ``get_env("toy", level=2, n_train=64, n_test=16, max_turns=8)``
(level L: L + 1 rooms); train and test games come from disjoint seeds, and a game's layout is a
function of its seed alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from opd.envs.environment import EnvError, Game, StepResult

ROOMS = ("kitchen", "hall", "garden", "cellar", "attic")
COLOURS = ("red", "blue", "green", "yellow")
TEST_SEED_OFFSET = 1_000_000  # test seeds start here: no train game is ever a test game


@dataclass
class ToySession:
    """One episode of one toy game; its layout is drawn from ``seed``."""

    seed: int
    rooms: int = 3
    place: dict[str, str] = field(init=False)  # "red key" / "blue box" -> room
    goal: str = field(init=False)

    def __post_init__(self):
        rng = random.Random(self.seed)
        self.names = list(ROOMS[: self.rooms])
        colours = rng.sample(COLOURS, 2)
        self.goal = colours[0]
        self.place = {f"{c} {kind}": rng.choice(self.names) for c in colours for kind in ("key", "box")}
        self.start = rng.choice(self.names)
        self.reset()

    def reset(self) -> str:
        self.here, self.held, self.won = self.start, set[str](), False
        return f"Goal: open the {self.goal} box.\n{self._look()}"

    def _look(self) -> str:
        things = sorted(t for t, room in self.place.items() if room == self.here and t not in self.held)
        i = self.names.index(self.here)
        exits = [self.names[j] for j in (i - 1, i + 1) if 0 <= j < len(self.names)]
        seen = ", ".join(f"a {t}" for t in things) or "nothing"
        return f"You are in the {self.here}. You see {seen}. Exits: {', '.join(exits)}."

    def admissible_commands(self) -> list[str]:
        i = self.names.index(self.here)
        cmds = [f"go to {self.names[j]}" for j in (i - 1, i + 1) if 0 <= j < len(self.names)]
        here = sorted(t for t, room in self.place.items() if room == self.here and t not in self.held)
        cmds += [f"take {t}" for t in here if t.endswith("key")]
        cmds += [f"open {t}" for t in here if t.endswith("box") and t.replace("box", "key") in self.held]
        return cmds + ["look", "inventory"]

    def step(self, action: str) -> StepResult:
        if self.won:
            raise EnvError("step() after the episode ended; call reset()")
        cmd = " ".join(action.lower().split())
        if cmd not in self.admissible_commands():
            return StepResult("Nothing happens.", 0.0, False, False)
        verb, _, what = cmd.partition(" ")
        if verb == "go":
            self.here = what.removeprefix("to ")
            return StepResult(self._look(), 0.0, False, False)
        if verb == "take":
            self.held.add(what)
            return StepResult(f"You take the {what}.", 0.0, False, False)
        if verb == "open":
            self.won = what == f"{self.goal} box"
            text = f"You unlock the {what}." + (" You win!" if self.won else " It is empty.")
            return StepResult(text, float(self.won), self.won, self.won)
        if verb == "inventory":
            return StepResult(
                "You carry " + (", ".join(f"a {t}" for t in sorted(self.held)) or "nothing") + ".", 0.0, False, False
            )
        return StepResult(self._look(), 0.0, False, False)  # look

    def expert_actions(self) -> list[str]:
        """Walk to the goal key, take it, walk to the goal box, open it (from the start of the episode)."""
        return self._plan(self.start, set())

    def expert_next(self) -> str | None:
        """The expert's next command from the current state (None once won)."""
        return None if self.won else self._plan(self.here, self.held)[0]

    def _plan(self, here: str, held: set[str]) -> list[str]:
        key, box = f"{self.goal} key", f"{self.goal} box"
        legs = [] if key in held else [(self.place[key], f"take {key}")]
        route = []
        for target, last in [*legs, (self.place[box], f"open {box}")]:
            step = 1 if self.names.index(target) > self.names.index(here) else -1
            for j in range(self.names.index(here) + step, self.names.index(target) + step, step):
                route.append(f"go to {self.names[j]}")
            route.append(last)
            here = target
        return route

    def close(self) -> None:
        pass


class ToyEnv:
    """The toy environment: ``n_train`` and ``n_test`` games of ``rooms`` rooms each."""

    name = "toy"
    system_prompt = (
        "You play a text game. Each turn, answer with exactly one command: go to ROOM, take COLOUR key, "
        "open COLOUR box, look, or inventory."
    )

    def __init__(
        self, level: int | None = None, n_train: int = 64, n_test: int = 16, rooms: int = 3, max_turns: int = 8
    ):
        if level is not None:  # the trainer's --env-level: level L has L + 1 rooms
            rooms = level + 1
        if not 2 <= rooms <= len(ROOMS) or n_train < 0 or n_test < 0 or max_turns < 1:
            raise ValueError(f"toy env: need 2 <= rooms <= {len(ROOMS)}, n_train, n_test >= 0, max_turns >= 1")
        self.n = {"train": n_train, "test": n_test}
        self.rooms, self.max_turns = rooms, max_turns

    def games(self, split: str) -> list[Game]:
        if split not in self.n:
            raise ValueError(f"toy env has splits 'train' and 'test', not {split!r}")
        offset = 0 if split == "train" else TEST_SEED_OFFSET
        out = []
        for i in range(self.n[split]):
            seed = offset + i
            out.append(
                Game(
                    id=f"toy-{split}-{i}", goal=f"open the {ToySession(seed, self.rooms).goal} box", info={"seed": seed}
                )
            )
        return out

    def open(self, game: Game) -> ToySession:
        if "seed" not in game.info:
            raise EnvError(f"game {game.id!r} is not a toy game (no seed in its info)")
        return ToySession(int(game.info["seed"]), self.rooms)
