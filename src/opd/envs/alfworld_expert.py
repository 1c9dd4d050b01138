"""The observational search expert for ALFWorld games: it acts only on what it has read.

The planner's plan (the games' stored walkthrough) is omniscient: it walks straight to the
receptacle that hides the object. A model cloned from it cannot know where that is from its
observations, so it learns to guess ("take soapbar 1 from countertop 1" where no soapbar was
seen). This expert plays the game instead, reading every observation: it visits the receptacles
in the order the first observation lists them, opening the closed ones, until it has seen what
the task needs, then takes it, cleans / heats / cools it (or carries it to a lamp it has seen)
and puts it in the first listed receptacle of the goal's kind. Every object an action names has
been shown by an earlier observation; receptacles and appliances are all in the first one.

The expert is a policy (:class:`SearchPolicy`): it reads each command played and the game's reply,
whoever played it, and says the next command from what it knows. So it can take over from any
state, a student's mistakes included (what :func:`opd.training.cloning.dagger_sequences` labels), and
:func:`search_expert` is that policy playing a game from its start.

The task (object, goal receptacle, lamp) comes from the game's ``traj_data.json``
(``pddl_params``), which both generated and real ALFWorld games have.
"""

from __future__ import annotations

import json
import re
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from opd.envs._textworld import PLAYERS
from opd.envs.environment import EnvError

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
_REJECTED = "Nothing happens."
_VERB_OBJ_AT = re.compile(r"^(take|move|clean|heat|cool) ([a-z]+ \d+) (?:from|to|with) ([a-z]+ \d+)$")
_VERB_AT = re.compile(r"^(go to|open|close|use) ([a-z]+ \d+)$")


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
    env = PLAYERS.take()
    try:
        env.load(game_path)
        policy = SearchPolicy.for_game(game_path, env.reset()["feedback"])
        actions: list[str] = []
        won = False
        while not won:
            if len(actions) >= _MAX_ACTIONS:
                raise EnvError(f"search expert: no win within {_MAX_ACTIONS} actions on {game_path}")
            command = policy.next_action()
            if command is None:
                break
            state, _, _ = env.step(command)
            actions.append(command)
            won = bool(state["won"])
            policy.observe(command, state["feedback"])
    except EnvError:
        PLAYERS.give_back(env)
        raise
    except Exception as e:
        env.close()  # it may be half-built: not back into the pool
        raise EnvError(f"search expert failed on {game_path}: {type(e).__name__}: {e}") from e
    PLAYERS.give_back(env)
    if not won:
        raise EnvError(f"search expert did not win {game_path} (played {actions})")
    return actions


class SearchPolicy:
    """The search expert as a policy: what it has read (receptacles, what was seen where, which are
    closed, where the player is, what it holds, what it cleaned / heated / cooled, placed or lit)
    and the next command that follows from it.

    ``observe`` takes any command and the game's reply: a rejected command ("Nothing happens.")
    changes nothing, an accepted one what it says. ``next_action`` is None when the task is done.
    """

    def __init__(self, first: str, task_type: str, params: dict[str, Any], game_path: str = "?"):
        self.path = game_path
        if task_type != "look_at_obj_in_light" and task_type not in _PLACING:
            raise EnvError(f"search expert: unknown task type {task_type!r} in {game_path}")
        self.task_type = task_type
        self.what = str(params["object_target"]).lower()
        self.lamp = str(params.get("toggle_target") or "").lower()
        # The goal receptacle's kind, searched last: an object already in one would mean the task
        # was (half) done before it started, which a game does not ask for.
        self.goal_kind = "" if task_type == "look_at_obj_in_light" else str(params["parent_target"]).lower()
        self.receptacles = items(first.split("Your task is to:")[0])
        if not self.receptacles:
            raise EnvError(f"search expert: no receptacles in the first observation of {game_path}")
        self.seen: dict[str, list[str]] = {}  # receptacle -> objects last seen in or on it
        self.closed: set[str] = set()  # receptacles the game said are closed, not opened since
        self.here: str | None = None
        self.holding: str | None = None
        self.changed: set[str] = set()  # objects cleaned, heated or cooled
        self.placed: set[str] = set()  # objects of the task put in the goal receptacle
        self.lit = False

    @classmethod
    def for_game(cls, game_path: str, first: str) -> SearchPolicy:
        return cls(first, *task_of(game_path), game_path)

    def observe(self, command: str, reply: str) -> None:
        if reply.strip().startswith(_REJECTED):
            return
        command = " ".join(command.lower().split())
        if m := _VERB_AT.match(command):
            verb, where = m.groups()
            if verb == "go to":
                self.here = where
                self.seen[where] = items(reply)
                if f"The {where} is closed" in reply:
                    self.closed.add(where)
            elif verb == "open":
                self.closed.discard(where)
                self.seen[where] = items(reply)
            elif verb == "close":
                self.closed.add(where)
            else:  # a lamp lit without the object in hand does not do the task
                self.lit = self.holding is not None and kind(self.holding) == self.what
        elif m := _VERB_OBJ_AT.match(command):
            verb, obj, where = m.groups()
            if verb == "take":
                self.holding = obj
                if obj in self.seen.get(where, []):
                    self.seen[where].remove(obj)
            elif verb == "move":
                self.holding = None
                self.seen.setdefault(where, []).append(obj)
                if kind(where) == self.goal_kind and self._ready(obj):
                    self.placed.add(obj)
            else:
                self.changed.add(obj)

    def next_action(self) -> str | None:
        if self.task_type == "look_at_obj_in_light":
            if self.lit:
                return None
            if self.holding is None or kind(self.holding) != self.what:
                return self._fetch()
            lamp, stand = self._find(self.lamp)
            if stand is None:
                return lamp  # the command that searches on
            return self._to(stand, open_it=False) or f"use {lamp}"
        if len(self.placed) >= (2 if self.task_type == "pick_two_obj_and_place" else 1):
            return None
        obj = self.holding
        if obj is None or kind(obj) != self.what or obj in self.placed:
            return self._fetch()
        if self.task_type in _APPLIANCE and obj not in self.changed:
            appliance, verb = _APPLIANCE[self.task_type]
            where = self._first(appliance)
            return self._to(where, open_it=False) or f"{verb} {obj} with {where}"
        target = self._first(self.goal_kind)
        return self._to(target, open_it=True) or f"move {obj} to {target}"

    def _ready(self, obj: str) -> bool:
        return kind(obj) == self.what and (self.task_type not in _APPLIANCE or obj in self.changed)

    def _fetch(self) -> str:
        """Towards taking an object of the task's kind (first putting down anything else held)."""
        if self.holding is not None:
            return f"move {self.holding} to {self.here}"
        obj, where = self._find(self.what, self.placed)
        if where is None:
            return obj  # a command that goes on searching
        return self._to(where, open_it=True) or f"take {obj} from {where}"

    def _find(self, what: str, skip: AbstractSet[str] = frozenset()) -> tuple[str, str | None]:
        """(object, receptacle) for the first object of kind ``what`` not in ``skip`` where one
        was seen; else (the command that searches on, None): the next receptacle in the listed
        order (goal kind last) not yet seen open."""
        for receptacle, objects in self.seen.items():
            if receptacle not in self.closed:
                for obj in objects:
                    if kind(obj) == what and obj not in skip:
                        return obj, receptacle
        later = [r for r in self.receptacles if kind(r) == self.goal_kind]
        for receptacle in [r for r in self.receptacles if r not in later] + later:
            if receptacle not in self.seen or receptacle in self.closed:  # unvisited, or closed since
                return (f"open {receptacle}" if self.here == receptacle else f"go to {receptacle}"), None
        raise EnvError(f"search expert: no {what} anywhere in {self.path}")

    def _to(self, receptacle: str, open_it: bool) -> str | None:
        """The command that gets there (and opens it, when asked and it is closed), or None: there."""
        if self.here != receptacle:
            return f"go to {receptacle}"
        if open_it and receptacle in self.closed:
            return f"open {receptacle}"
        return None

    def _first(self, what: str) -> str:
        for receptacle in self.receptacles:
            if kind(receptacle) == what:
                return receptacle
        raise EnvError(f"search expert: the room of {self.path} has no {what}")
