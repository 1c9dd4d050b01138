"""Small ALFWorld household problems, generated offline and written as ALFWorld's game files.

ALFWorld's real games come from AI2-THOR scenes that cannot be downloaded here, so this module
writes its own problems in the same ALFRED domain: a room of receptacles (countertops, a
fridge, drawers, ...) holding objects, and one of ALFWorld's six task types. Everything a game
*means* comes from alfworld itself: the PDDL domain (``alfworld/data/alfred.pddl``), the text
grammar (``alfred.twl2``), the goal formulas and their wording (``alfworld.gen.goal_library``),
and which objects fit which receptacles and can be cleaned, heated or cooled
(``alfworld.gen.constants``). What is written here is only the scene: which receptacles a room
has, where the objects start, and the difficulty levels.

A game is a folder, laid out like ``alfworld-download``'s::

    <games_dir>/<split>/<task_type>-s<seed>/game.tw-pddl    # {pddl_domain, grammar, pddl_problem,
                                                            #  solvable, walkthrough}
    <games_dir>/<split>/<task_type>-s<seed>/traj_data.json  # {task_type, pddl_params, ...}

Generation is a pure function of (level, seed): the same seed writes the same bytes. Every game
is checked before it is written: the goal is not already true, and the planner's plan, played
through the engine, wins (it is stored as the ``walkthrough``).

Usage::

    from opd.envs.alfworld_gen import generate_game, LEVELS
    folder = generate_game(level=2, seed=7, task_type="pick_heat_then_place_in_recep", out_dir=tmp)
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd.envs._textworld import alfworld_modules, alfworld_paths
from opd.envs.environment import EnvError
from opd.errors import UserError

# The six ALFWorld task types, in ALFWorld's own numbering (alfred_tw_env.TASK_TYPES).
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)


@dataclass(frozen=True)
class Level:
    """How hard the generated games are: room size, clutter, closed receptacles, task types."""

    receptacles: tuple[int, int]  # how many receptacles a room has (inclusive range)
    distractors: tuple[int, int]  # objects that have nothing to do with the task
    max_same: int  # at most this many receptacles of one kind (cabinet 1, cabinet 2, ...)
    closed: bool  # whether rooms have receptacles to open (fridge, drawers, cabinets, ...)
    task_types: tuple[str, ...]
    max_turns: int  # the default turn budget: about 2-3x the planner's plan, 1.5-2x the search expert's


LEVELS: dict[int, Level] = {
    # Open surfaces only, one object to move: the planner needs 4 actions (the search expert 4-6).
    1: Level((3, 4), (1, 2), 1, False, ("pick_and_place_simple",), 12),
    # All six task types, closed fridges and drawers, some clutter: plans of 3-10 actions (mean 6; search 4-15).
    2: Level((5, 7), (2, 4), 2, True, TASK_TYPES, 24),
    # Bigger rooms, repeated receptacles to search, more clutter: plans of 3-10 actions (mean 6; search 6-20),
    # many more wrong places to go.
    3: Level((8, 12), (5, 8), 3, True, TASK_TYPES, 30),
}

# The receptacles a room of each ALFRED scene type may have (the real scenes' furniture;
# alfworld ships no scene list without AI2-THOR). Task-required appliances are added on top.
ROOMS: dict[str, tuple[str, ...]] = {
    "Kitchen": (
        "CounterTop",
        "DiningTable",
        "Cabinet",
        "Drawer",
        "Fridge",
        "Microwave",
        "SinkBasin",
        "StoveBurner",
        "Shelf",
        "GarbageCan",
        "CoffeeMachine",
        "Toaster",
    ),  # fmt: skip
    "LivingRoom": ("Sofa", "ArmChair", "CoffeeTable", "SideTable", "TVStand", "Drawer", "Shelf", "Cabinet", "Dresser"),
    "Bedroom": ("Bed", "Desk", "Dresser", "SideTable", "Drawer", "Shelf", "GarbageCan", "LaundryHamper"),
    "Bathroom": ("CounterTop", "SinkBasin", "Cabinet", "Toilet", "TowelHolder", "HandTowelHolder", "GarbageCan"),
}
# Furniture a room may have several of (cabinet 1, cabinet 2, ...); one fridge, bed, ... per room.
REPEATABLE = {
    "Cabinet",
    "Drawer",
    "CounterTop",
    "Shelf",
    "SideTable",
    "StoveBurner",
    "GarbageCan",
    "ArmChair",
    "Dresser",
}
# Where a desk lamp stands (look_at_obj_in_light): lamps are not in alfworld's placement table.
LAMP_STANDS = ("Desk", "SideTable", "Dresser")
# The appliance each task needs, as the domain's actions require it (CleanObject needs a SinkBasin).
NEEDS = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable"),
}
# Receptacles too odd as a goal or a start for a tiny model's tasks (and the small movable ones,
# whose "inReceptacleObject" rules the domain leaves commented out).
_NOT_PLACES = {"Bowl", "Cup", "Mug", "Plate", "Pan", "Pot", "Box", "Cart", "PaintingHanger", "ToiletPaperHanger"}


def level_spec(level: int) -> Level:
    try:
        return LEVELS[int(level)]
    except (KeyError, ValueError, TypeError):
        raise UserError(f"unknown ALFWorld level {level!r}: use one of {', '.join(map(str, LEVELS))}") from None


def mangle(cls: str, n: int) -> str:
    """An ALFRED-style object id (``Apple_bar_1``): the engine's demangler turns it into the name
    "apple 1"; basins are ``Sink_bar_1_bar_SinkBasin`` as in ALFRED ("sinkbasin 1")."""
    if cls.endswith("Basin"):
        return f"{cls[: -len('Basin')]}_bar_{n}_bar_{cls}"
    return f"{cls}_bar_{n}"


@dataclass
class _Scene:
    task_type: str
    scene_type: str
    receptacles: list[tuple[str, str]]  # (id, class), in the order they get locations
    objects: list[tuple[str, str, str]]  # (id, class, receptacle id)
    params: dict[str, Any]  # traj_data's pddl_params


def _furniture(room: str, spec: Level, openable: list[str]) -> list[str]:
    """The receptacle classes a room of this level may have."""
    return [c for c in ROOMS[room] if c not in _NOT_PLACES and (spec.closed or c not in openable)]


def _receptacles(rng: random.Random, spec: Level, pool: list[str], required: list[str]) -> list[tuple[str, str]]:
    n = rng.randint(*spec.receptacles)
    classes = list(required)
    while len(classes) < n:
        room_left = [c for c in pool if classes.count(c) < (spec.max_same if c in REPEATABLE else 1)]
        if not room_left:
            break
        classes.append(rng.choice(room_left))
    rng.shuffle(classes)
    counts: dict[str, int] = {}
    out = []
    for cls in classes:
        counts[cls] = counts.get(cls, 0) + 1
        out.append((mangle(cls, counts[cls]), cls))
    return out


def _holders(receptacles, obj_cls: str, fits: dict[str, set[str]], avoid: str | None = None) -> list[str]:
    """Receptacle ids where an object of ``obj_cls`` may start (never in a goal receptacle)."""
    return [rid for rid, rcls in receptacles if obj_cls in fits.get(rcls, ()) and rcls != avoid]


def _scene(rng: random.Random, spec: Level, task_type: str) -> _Scene | None:
    """One attempt at a scene for ``task_type``; None when the draw does not fit (retry)."""
    C, _ = alfworld_modules()
    fits = {r: set(objs) for r, objs in C.VAL_RECEPTACLE_OBJECTS.items()}
    room = rng.choice(sorted(C.GOALS_VALID[task_type]))
    appliance, affordance = NEEDS.get(task_type, (None, None))
    required = [appliance] if appliance else []
    toggle = ""
    if task_type == "look_at_obj_in_light":
        toggle = "DeskLamp"
        required.append(rng.choice([c for c in LAMP_STANDS if c in ROOMS[room]]))
    # The goal receptacle: any furniture of the room an object fits in (not the lamp's stand).
    pool = _furniture(room, spec, C.OPENABLE_CLASS_LIST)
    parent = "" if toggle else rng.choice([c for c in pool if c != appliance])
    if parent:
        required.append(parent)
    recs = _receptacles(rng, spec, pool, required)
    # The target object: fits the goal receptacle, has the needed affordance, can start elsewhere.
    candidates = sorted(
        o
        for o in C.OBJECTS
        if (not parent or o in fits.get(parent, ()))
        and (affordance is None or o in C.VAL_ACTION_OBJECTS[affordance])
        and not o.endswith("Sliced")
        and _holders(recs, o, fits, avoid=parent)
    )
    if not candidates:
        return None
    target = rng.choice(candidates)
    objects: list[tuple[str, str, str]] = []
    counts: dict[str, int] = {}

    def place(cls: str, where: list[str]) -> None:
        counts[cls] = counts.get(cls, 0) + 1
        objects.append((mangle(cls, counts[cls]), cls, rng.choice(where)))

    for _ in range(2 if task_type == "pick_two_obj_and_place" else 1):
        place(target, _holders(recs, target, fits, avoid=parent))
    if toggle:
        place(toggle, [rid for rid, rcls in recs if rcls in LAMP_STANDS])
    # Distractors never of the target's class, so there is one right object (two for pick_two).
    others = sorted({o for r in ROOMS[room] for o in fits.get(r, ()) if o != target and not o.endswith("Sliced")})
    for _ in range(rng.randint(*spec.distractors)):
        cls = rng.choice(others)
        where = _holders(recs, cls, fits)
        if where:
            place(cls, where)
    params = {
        "object_target": target,
        "parent_target": parent,
        "toggle_target": toggle,
        "mrecep_target": "",
        "object_sliced": False,
    }
    return _Scene(task_type, room, recs, objects, params)


def _problem(scene: _Scene, seed: int) -> str:
    """The PDDL problem: ALFRED's predicates over the scene, the goal from alfworld's library."""
    C, glib = alfworld_modules()
    fits = {r: set(objs) for r, objs in C.VAL_RECEPTACLE_OBJECTS.items()}
    rclasses = sorted({c for _, c in scene.receptacles})
    oclasses = sorted({c for _, c, _ in scene.objects})
    # Location 0 is the middle of the room, where the agent starts; receptacle i stands at i+1.
    loc = {rid: f"loc_bar_{i + 1}" for i, (rid, _) in enumerate(scene.receptacles)}
    locations = ["loc_bar_0", *loc.values()]
    decl = ["agent1 - agent"]
    decl += [f"{c}Type - rtype" for c in rclasses] + [f"{c}Type - otype" for c in oclasses]
    decl += [f"{x} - location" for x in locations]
    decl += [f"{rid} - receptacle" for rid, _ in scene.receptacles] + [f"{oid} - object" for oid, _, _ in scene.objects]
    init = ["(= (total-cost) 0)", "(atLocation agent1 loc_bar_0)"]
    for rid, rcls in scene.receptacles:
        init += [f"(receptacleType {rid} {rcls}Type)", f"(receptacleAtLocation {rid} {loc[rid]})"]
        if rcls in C.OPENABLE_CLASS_LIST:
            init.append(f"(openable {rid})")
    init += [f"(canContain {r}Type {o}Type)" for r in rclasses for o in oclasses if o in fits.get(r, ())]
    for oid, ocls, rid in scene.objects:
        init += [
            f"(objectType {oid} {ocls}Type)",
            f"(inReceptacle {oid} {rid})",
            f"(objectAtLocation {oid} {loc[rid]})",
        ]
        for affordance, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable")):
            if ocls in C.VAL_ACTION_OBJECTS[affordance]:
                init.append(f"({pred} {oid})")
        if ocls in C.VAL_ACTION_OBJECTS["Toggleable"]:
            init.append(f"(toggleable {oid})")
        else:
            init.append(f"(pickupable {oid})")
        if ocls in C.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {oid})")
    p = scene.params
    goal = glib.gdict[scene.task_type]["pddl"].format(
        obj=p["object_target"], recep=p["parent_target"], toggle=p["toggle_target"], mrecep=p["mrecep_target"]
    )
    body = "\n        ".join
    return (
        f"(define (problem opd_{scene.task_type}_{seed})\n    (:domain alfred)\n"
        f"    (:objects\n        {body(decl)}\n    )\n    (:init\n        {body(init)}\n    )\n"
        + goal.replace("#", "-")  # the library writes "#" for PDDL's "-"; its last ")" closes define
    )


def goal_text(task_type: str, params: dict[str, Any], rng: random.Random) -> str:
    """The task's wording, one of alfworld's templates (as ``get_templated_task_desc`` does,
    but with our seeded ``rng`` instead of the global one)."""
    _, glib = alfworld_modules()
    template = rng.choice(glib.gdict[task_type]["templates"])
    low = {k: str(v).lower() for k, v in params.items()}
    return template.format(obj=low["object_target"], recep=low["parent_target"], toggle=low["toggle_target"], mrecep="")


def draw(task_type: str, level: int, seed: int) -> tuple[_Scene, str]:
    """The scene and the goal's text of one (task type, level, seed): cheap, no files."""
    if task_type not in TASK_TYPES:
        raise UserError(f"unknown ALFWorld task type {task_type!r}: use one of {', '.join(TASK_TYPES)}")
    spec = level_spec(level)
    rng = random.Random(f"alfworld:{level}:{task_type}:{seed}")  # str seeds hash stably across runs
    for _ in range(100):
        scene = _scene(rng, spec, task_type)
        if scene is not None:
            return scene, goal_text(task_type, scene.params, rng)
    raise RuntimeError(f"no {task_type} scene fits level {level} (seed {seed})")  # pragma: no cover


def game_files(task_type: str, level: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The contents of ``game.tw-pddl`` and ``traj_data.json`` for one game, unchecked."""
    scene, goal = draw(task_type, level, seed)
    domain_path, grammar_path = alfworld_paths()
    game = {
        "pddl_domain": Path(domain_path).read_text(),
        "grammar": Path(grammar_path).read_text().replace("UNKNOWN GOAL", goal),
        "pddl_problem": _problem(scene, seed),
        "solvable": True,
        "walkthrough": None,
        # Marks the walkthrough as the planner's (real ALFWorld files hold a perturbed one).
        "opd_generated": {"level": level, "seed": seed, "task_type": task_type},
    }
    traj = {
        "task_type": task_type,
        "pddl_params": scene.params,
        "scene": {"scene_type": scene.scene_type, "random_seed": seed},
        "task_id": f"opd_L{level}_{task_type}_{seed}",
        "turk_annotations": {"anns": [{"task_desc": goal, "high_descs": [], "assignment_id": "", "votes": []}]},
    }
    return game, traj


def generate_game(level: int, seed: int, task_type: str, out_dir: str | os.PathLike) -> Path:
    """Write the game of (level, seed, task_type) into ``out_dir`` (a folder), unless it is there.

    Checked before writing: the goal is not already met, and the planner's plan wins; the plan
    is stored as the game's ``walkthrough``. Written atomically (a temporary file, then a
    rename), so processes generating the same game at once do not see half a file."""
    out = Path(out_dir)
    if (out / "game.tw-pddl").is_file() and (out / "traj_data.json").is_file():
        return out
    game, traj = game_files(task_type, level, seed)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "traj_data.json", traj)
    game["walkthrough"] = _check(game, out, f"level {level} seed {seed} {task_type}")
    _write_json(out / "game.tw-pddl", game)
    return out


def _check(game: dict[str, Any], folder: Path, what: str) -> list[str]:
    from opd.envs._textworld import planner_plan, play_pddl

    plan = planner_plan(game)
    won_at_start, won = play_pddl(game, plan)
    if won_at_start or not plan or not won:
        # A bug in the scene rules, not bad input: say exactly which game.
        raise EnvError(f"generated ALFWorld game {what} ({folder}) is broken: won at start {won_at_start}, plan {plan}")
    return plan


def _write_json(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
