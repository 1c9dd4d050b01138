"""The observational search expert for ALFWorld games: it acts only on what it has read.

The planner's plan (the games' stored walkthrough) is omniscient: it walks straight to the
receptacle that hides the object. A model cloned from it cannot know where that is from its
observations, so it learns to guess ("take soapbar 1 from countertop 1" where no soapbar was
seen). This expert plays the game instead, reading every observation: it visits the receptacles
in the order the first observation lists them, opening the closed ones, until it has seen what
the task needs, then takes it, cleans / heats / cools it (or carries it to a lamp it has seen)
and puts it in the first listed receptacle of the goal's kind. Every object an action names has
been shown by an earlier observation; receptacles and appliances are all in the first one.

The task (object, goal receptacle, lamp) comes from the game's ``traj_data.json``
(``pddl_params``), which both generated and real ALFWorld games have.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from opd.envs._textworld import PLAYERS
from opd.envs.base import EnvError

# Which appliance each transforming task uses, and the verb that uses it (alfworld's grammar).
_APPLIANCE = {
    "pick_clean_then_place_in_recep": ("sinkbasin", "clean"),
    "pick_heat_then_place_in_recep": ("microwave", "heat"),
    "pick_cool_then_place_in_recep": ("fridge", "cool"),
}
_PLACING = (*_APPLIANCE, "pick_and_place_simple", "pick_two_obj_and_place")
_ITEM = re.compile(r"\ban? ([a-z]+ \d+)")
_SEEN = re.compile(r"you see (.*?)(?:\.\s*$|\.\s*\n)", re.IGNORECASE | re.DOTALL)
# Far above any game's search (visiting and opening every receptacle twice): a loop guard.
_MAX_ACTIONS = 200


def task_of(game_path: str) -> tuple[str, dict[str, Any]]:
    """(task type, pddl_params) from the ``traj_data.json`` beside a game file."""
    traj_path = Path(game_path).parent / "traj_data.json"
    try:
        traj = json.loads(traj_path.read_text())
        return traj["task_type"], traj["pddl_params"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EnvError(f"no search expert for {game_path}: cannot read its task from {traj_path} ({e})") from e


def items(text: str) -> list[str]:
    """The things a "you see a X 1, a Y 2, and a Z 1" sentence names, in order ([] for nothing)."""
    match = _SEEN.search(text)
    return _ITEM.findall(match.group(1)) if match else []


def kind(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def search_expert(game_path: str) -> list[str]:
    """The search expert's winning commands for a game, found by playing it (deterministic)."""
    task_type, params = task_of(game_path)
    env = PLAYERS.take()
    try:
        env.load(game_path)
        player = _Searcher(env, env.reset()["feedback"], game_path)
        player.solve(task_type, params)
    except EnvError:
        PLAYERS.give_back(env)
        raise
    except Exception as e:
        env.close()  # it may be half-built: not back into the pool
        raise EnvError(f"search expert failed on {game_path}: {type(e).__name__}: {e}") from e
    PLAYERS.give_back(env)
    if not player.won:
        raise EnvError(f"search expert did not win {game_path} (played {player.actions})")
    return player.actions


class _Searcher:
    """One play-through: what has been seen where, where the player is, what it did."""

    def __init__(self, env: Any, first: str, game_path: str):
        self.env = env
        self.path = game_path
        room = first.split("Your task is to:")[0]
        self.receptacles = items(room)
        if not self.receptacles:
            raise EnvError(f"search expert: no receptacles in the first observation of {game_path}")
        self.seen: dict[str, list[str]] = {}  # receptacle -> objects last seen in or on it
        self.closed: set[str] = set()  # receptacles the game said are closed, not opened since
        self.here: str | None = None
        self.actions: list[str] = []
        self.won = False
        self.goal_kind = ""  # the goal receptacle's kind, searched last

    def act(self, command: str) -> str:
        if len(self.actions) >= _MAX_ACTIONS:
            raise EnvError(f"search expert: no win within {_MAX_ACTIONS} actions on {self.path}")
        state, _, _ = self.env.step(command)
        self.actions.append(command)
        self.won = bool(state["won"])
        return state["feedback"]

    def go(self, receptacle: str, open_it: bool) -> None:
        """Go to a receptacle (and open it, when asked and the game said it is closed)."""
        if self.here != receptacle:
            text = self.act(f"go to {receptacle}")
            self.here = receptacle
            self.seen[receptacle] = items(text)
            if f"The {receptacle} is closed" in text:
                self.closed.add(receptacle)
        if open_it and receptacle in self.closed:
            text = self.act(f"open {receptacle}")
            self.closed.discard(receptacle)
            self.seen[receptacle] = items(text)

    def find(self, what: str, skip: set[str]) -> tuple[str, str]:
        """(object, receptacle) for the first object of kind ``what`` not in ``skip``: where it
        was already seen, else by visiting unvisited receptacles in the listed order.

        Receptacles of the goal's kind come last: an object already in one would mean the task
        was (half) done before it started, which a game does not ask for."""
        later = [r for r in self.receptacles if kind(r) == self.goal_kind]
        order = [r for r in self.receptacles if r not in later] + later
        for receptacle in [*self.seen, *order]:
            if receptacle not in self.seen:
                self.go(receptacle, open_it=True)
            for obj in self.seen[receptacle]:
                if kind(obj) == what and obj not in skip:
                    return obj, receptacle
        raise EnvError(f"search expert: no {what} anywhere in {self.path}")

    def first(self, what: str) -> str:
        for receptacle in self.receptacles:
            if kind(receptacle) == what:
                return receptacle
        raise EnvError(f"search expert: the room of {self.path} has no {what}")

    def take(self, what: str, skip: set[str]) -> str:
        obj, receptacle = self.find(what, skip)
        self.go(receptacle, open_it=False)
        self.act(f"take {obj} from {receptacle}")
        self.seen[receptacle].remove(obj)
        return obj

    def solve(self, task_type: str, params: dict[str, Any]) -> None:
        what = str(params["object_target"]).lower()
        if task_type == "look_at_obj_in_light":
            self.take(what, set())
            lamp, stand = self.find(str(params["toggle_target"]).lower(), set())
            self.go(stand, open_it=False)
            self.act(f"use {lamp}")
            return
        if task_type not in _PLACING:
            raise EnvError(f"search expert: unknown task type {task_type!r} in {self.path}")
        self.goal_kind = str(params["parent_target"]).lower()
        target = self.first(self.goal_kind)
        placed: set[str] = set()
        for _ in range(2 if task_type == "pick_two_obj_and_place" else 1):
            obj = self.take(what, placed)
            if task_type in _APPLIANCE:
                appliance, verb = _APPLIANCE[task_type]
                where = self.first(appliance)
                self.go(where, open_it=False)
                self.act(f"{verb} {obj} with {where}")
            self.go(target, open_it=True)
            self.act(f"move {obj} to {target}")
            placed.add(obj)
