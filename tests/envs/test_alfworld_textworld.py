"""The agentic environments: generated ALFWorld games, real ALFWorld data layouts, tw-cooking.

Games are generated once per test session into a temporary folder (about 1.5 s an ALFWorld game
and 3-8 s a cooking game on 2 cores), so the file stays under two minutes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opd.envs import EnvError, Game, GameSession, get_env
from opd.envs._textworld import clean_action, planner_plan
from opd.envs.alfworld_gen import LEVELS, TASK_TYPES, game_files, generate_game
from opd.errors import UserError

WRONG = ["go to the moon", "take apple 1 from nowhere", "dance"]


@pytest.fixture(scope="session")
def alf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("alfworld")


@pytest.fixture(scope="session")
def alf_env(alf_dir):
    # Six train games at level 2: one of each task type (types cycle in TASK_TYPES order).
    return get_env("alfworld", level=2, num_train=6, num_test=2, games_dir=alf_dir, generated=True)


@pytest.fixture(scope="session")
def alf_games(alf_env):
    games = alf_env.games("train")
    for game in games:  # generate them all (open() writes a missing game)
        alf_env.open(game).close()
    return games


def play(session, actions):
    return [session.step(a) for a in actions]


# -- ALFWorld generation


def test_generation_is_deterministic_and_seeded(tmp_path):
    a = generate_game(2, 10, "pick_heat_then_place_in_recep", tmp_path / "a")
    b = generate_game(2, 10, "pick_heat_then_place_in_recep", tmp_path / "b")
    for name in ("game.tw-pddl", "traj_data.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    other, _ = game_files("pick_heat_then_place_in_recep", 2, 12)
    assert other["pddl_problem"] != json.loads((a / "game.tw-pddl").read_text())["pddl_problem"]
    game = json.loads((a / "game.tw-pddl").read_text())
    assert game["solvable"] is True and game["walkthrough"]
    assert "UNKNOWN GOAL" not in game["grammar"] and "_bar_1" in game["pddl_problem"]
    traj = json.loads((a / "traj_data.json").read_text())
    assert traj["task_type"] == "pick_heat_then_place_in_recep"
    assert traj["pddl_params"]["object_target"] and traj["pddl_params"]["parent_target"]


def test_train_and_test_games_are_disjoint(tmp_path):
    env = get_env("alfworld", level=1, num_train=60, num_test=60, games_dir=tmp_path, generated=True)
    train, test = env.games("train"), env.games("test")
    assert len(train) == 60 and len(test) == 60
    assert not {g.id for g in train} & {g.id for g in test}
    assert not {g.info["seed"] for g in train} & {g.info["seed"] for g in test}
    problems = {
        s: {game_files(g.info["task_type"], 1, g.info["seed"])[0]["pddl_problem"] for g in gs}
        for s, gs in (("train", train), ("test", test))
    }
    assert not problems["train"] & problems["test"]
    assert len(problems["train"]) == 60  # different seeds, different games
    assert [g.id for g in env.games("train")] == [g.id for g in train]  # a fixed order
    # Listing does not write anything: games are generated when first opened.
    assert not any(tmp_path.iterdir())


def test_validation_games_are_a_split_of_their_own(tmp_path):
    """Recipes are chosen on the valid split: no game of it is a train or test game, its games do
    not move when the train or test split grows, and test_split='valid' makes evaluation play it."""
    env = get_env("alfworld", level=1, num_train=40, num_test=40, num_valid=40, games_dir=tmp_path, generated=True)
    splits = {s: env.games(s) for s in ("train", "test", "valid")}
    seeds = {s: {g.info["seed"] for g in gs} for s, gs in splits.items()}
    assert all(len(v) == 40 for v in seeds.values())
    assert not seeds["valid"] & seeds["train"] and not seeds["valid"] & seeds["test"]
    problems = {
        s: {game_files(g.info["task_type"], 1, g.info["seed"])[0]["pddl_problem"] for g in gs}
        for s, gs in splits.items()
    }
    assert len(problems["valid"]) == 40 and not problems["valid"] & (problems["train"] | problems["test"])
    bigger = get_env(
        "alfworld", level=1, num_train=5000, num_test=500, num_valid=40, games_dir=tmp_path, generated=True
    )
    assert [g.id for g in bigger.games("valid")] == [g.id for g in splits["valid"]]
    assert not {g.info["seed"] for g in bigger.games("train")} & seeds["valid"]
    as_test = get_env("alfworld", level=1, num_valid=40, test_split="valid", games_dir=tmp_path, generated=True)
    assert [g.id for g in as_test.games("test")] == [g.id for g in splits["valid"]]
    assert all(g.id.startswith("valid/") for g in splits["valid"])


def test_level_one_is_simple_pick_and_place(tmp_path):
    env = get_env("alfworld", level=1, num_train=4, games_dir=tmp_path, generated=True)
    games = env.games("train")
    assert {g.info["task_type"] for g in games} == {"pick_and_place_simple"}
    problems = [game_files(g.info["task_type"], 1, g.info["seed"])[0]["pddl_problem"] for g in games]
    assert not any("(openable" in p for p in problems)  # nothing to open at level 1
    assert LEVELS[2].task_types == TASK_TYPES and env.max_turns == LEVELS[1].max_turns


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_expert_wins_every_task_type(alf_env, alf_games, task_type):
    game = next(g for g in alf_games if g.info["task_type"] == task_type)
    session = alf_env.open(game)
    assert isinstance(session, GameSession)
    session.reset()
    expert = session.expert_actions()
    assert expert and len(expert) <= alf_env.max_turns
    assert expert[0] in session.admissible_commands()
    results = play(session, expert)
    assert all(r.reward == 0.0 and not r.done for r in results[:-1])
    assert results[-1] == results[-1].__class__(results[-1].observation, 1.0, True, True)
    session.close()


def test_stored_walkthrough_is_the_planners_plan(alf_dir, alf_games):
    env = get_env("alfworld", level=2, num_train=6, games_dir=alf_dir, generated=True, expert="planner")
    session = env.open(alf_games[0])
    assert session.expert_actions() == planner_plan(alf_games[0].path)
    session.reset()
    assert play(session, session.expert_actions())[-1].won
    session.close()


def test_search_expert_searches_in_the_listed_order(alf_env, alf_games):
    # Hand-checked: the room lists desk 1, drawer 1 (closed), garbagecan 2, garbagecan 1,
    # shelf 1, sidetable 2, sidetable 1, and the bowl is on shelf 1. The planner walks straight
    # there; the search expert looks everywhere before it (opening the drawer), but not on the
    # sidetables (the goal's kind, searched last), then puts the bowl on the first sidetable listed.
    game = alf_games[0]
    assert game.id == "train/pick_and_place_simple-s0"
    session = alf_env.open(game)
    assert "you see a desk 1, a drawer 1, a garbagecan 2" in session.reset()
    assert session.expert_actions() == [
        "go to desk 1",
        "go to drawer 1",
        "open drawer 1",
        "go to garbagecan 2",
        "go to garbagecan 1",
        "go to shelf 1",
        "take bowl 1 from shelf 1",
        "go to sidetable 2",
        "move bowl 1 to sidetable 2",
    ]
    assert planner_plan(game.path)[0] == "go to shelf 1"
    session.close()


def test_search_expert_without_its_task_is_env_error(alf_env, alf_games, tmp_path):
    folder = tmp_path / "no_traj"
    shutil.copytree(Path(alf_games[0].path).parent, folder)
    (folder / "traj_data.json").unlink()
    session = alf_env.open(Game(id="no_traj", path=str(folder / "game.tw-pddl")))
    with pytest.raises(EnvError, match=r"no search expert for .*no_traj.*cannot read its task from .*traj_data\.json"):
        session.expert_actions()
    session.close()


def named_objects(action: str, receptacles: set[str]) -> set[str]:
    """The numbered things an action names that are not receptacles ("take egg 2 from cabinet 1")."""
    return set(re.findall(r"[a-z]+ \d+", action)) - receptacles


@pytest.mark.parametrize("level", [1, 2, 3])
def test_search_expert_wins_naming_only_what_it_has_seen(level, alf_env, alf_games, tmp_path):
    # Level 2: one game of each task type. Level 3 (big rooms, 1.5 s to generate a game): the
    # two tasks whose search differs, a second object to find and a lamp to find while holding.
    env, games = alf_env, alf_games
    if level != 2:
        env = get_env("alfworld", level=level, num_train=2 if level == 1 else 6, games_dir=tmp_path, generated=True)
        games = env.games("train")
        if level == 3:
            games = [g for g in games if g.info["task_type"] in ("look_at_obj_in_light", "pick_two_obj_and_place")]
        assert len(games) == 2
    for game in games:
        check_search_episode(env, game)


def check_search_episode(env, game) -> None:
    """The expert's episode searches before it takes, names nothing unseen, and wins."""
    session = env.open(game)
    seen = session.reset()
    listed = re.findall(r"[a-z]+ \d+", seen.split("Your task")[0])
    receptacles = set(listed)
    actions = session.expert_actions()
    # Until it first takes something, it searches: no receptacle skipped, in the listed order
    # with the goal's kind last (the planner walks straight to the object instead).
    goal_kind = json.loads((Path(game.path).parent / "traj_data.json").read_text())["pddl_params"]
    goal_kind = goal_kind["parent_target"].lower()
    order = [r for r in listed if r.split()[0] != goal_kind] + [r for r in listed if r.split()[0] == goal_kind]
    first_take = next(n for n, a in enumerate(actions) if a.startswith("take "))
    visits = [a[len("go to ") :] for a in actions[:first_take] if a.startswith("go to ")]
    assert visits and visits == order[: len(visits)], (game.id, actions)
    results = []
    for action in actions:
        unseen = named_objects(action, receptacles) - set(re.findall(r"[a-z]+ \d+", seen))
        assert not unseen, f"{game.id}: {action!r} names {unseen} before any observation showed them"
        if action.startswith("go to "):
            assert action[6:] in receptacles  # only receptacles the first observation listed
        results.append(session.step(action))
        seen += "\n" + results[-1].observation
    assert results[-1].won and len(results) <= env.max_turns, game.id
    assert "Nothing happens." not in [r.observation for r in results], game.id
    session.close()


def test_alfworlds_own_expert_solves_generated_games(alf_games):
    # The games are ALFWorld games, not just PDDL: alfworld's hand-coded expert (which reads
    # traj_data.json's pddl_params and explores like a player) wins them too. Not pick_two: that
    # policy keeps going back to where it found the first object (it failed 9 of 16 generated
    # ones); ALFWorld's own generator marks such games unsolvable, ours use the planner's plan.
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos
    from textworld.envs import PddlEnv

    infos = textworld.EnvInfos(admissible_commands=True, won=True, extras=["gamefile", "expert_plan"])
    env = AlfredExpert(AlfredInfos(AlfredDemangler(PddlEnv(infos))), expert_type="handcoded")
    for game in [g for g in alf_games if g.info["task_type"] != "pick_two_obj_and_place"]:
        env.load(game.path)
        state = env.reset()
        for _ in range(40):
            state, _, done = env.step(state["extra.expert_plan"][0])
            if done:
                break
        assert state["won"], game.id


def test_wrong_actions_get_the_engines_reply(alf_env, alf_games):
    session = alf_env.open(alf_games[0])
    session.reset()
    results = play(session, WRONG)
    assert [r.observation for r in results] == ["Nothing happens."] * 3
    assert not any(r.done or r.won or r.reward for r in results)
    # The engine still plays on: the expert wins from here (wrong commands change nothing).
    assert play(session, session.expert_actions())[-1].won
    session.close()


def _random_play(env, games, seed):
    """Each game played 10 turns by a seeded mix of admissible and rejected commands: every
    observation, reward, end and admissible list."""
    rng = random.Random(seed)
    out = []
    for game in games:
        session = env.open(game)
        trace = [session.reset()]
        for _ in range(10):
            admissible = session.admissible_commands()
            action = rng.choice(admissible) if rng.random() < 0.7 else rng.choice(WRONG)
            r = session.step(action)
            trace.append((action, r.observation, r.reward, r.done, r.won, admissible))
            if r.done:
                break
        session.close()
        out.append(trace)
    return out


def test_engine_caches_play_exactly_as_textworld(alf_env, alf_games):
    from opd.envs import _pddl_cache

    cached = [_random_play(alf_env, alf_games, seed) for seed in (0, 1)]  # the second pass hits the caches
    assert not textgen_parse_is_textworlds()  # opening games installed the caches
    _pddl_cache.uninstall()
    try:
        assert textgen_parse_is_textworlds()
        plain = [_random_play(alf_env, alf_games, seed) for seed in (0, 1)]
    finally:
        _pddl_cache.install()
    assert cached == plain
    assert sum(len(t) for t in plain[0]) > 6 * 5  # the games were played, not just reset


def test_engine_caches_step_aside_when_textworld_moves(monkeypatch):
    """A textworld whose internals were renamed plays as it ships, without the caches."""
    import textworld.envs.pddl.textgen as textgen

    from opd.envs import _pddl_cache

    _pddl_cache.uninstall()
    try:
        monkeypatch.delattr(textgen, "_parse_and_convert")
        _pddl_cache.install()
        assert not _pddl_cache._originals  # nothing patched
    finally:
        monkeypatch.undo()
        _pddl_cache.install()
    assert _pddl_cache._originals and not textgen_parse_is_textworlds()


def textgen_parse_is_textworlds() -> bool:
    """Textworld's own parse and context copy in place (both, or neither, patched by the caches)."""
    import textworld.envs.pddl.textgen as textgen

    ours = {f.__module__ == "textworld.envs.pddl.textgen" for f in (textgen._parse_and_convert, textgen.copy_context)}
    assert len(ours) == 1, "the caches patched one of textgen's functions and not the other"
    return ours.pop()


def test_observations_are_clean(alf_env, alf_games):
    for game in alf_games:
        session = alf_env.open(game)
        first = session.reset()
        assert "Welcome" not in first and "-=" not in first
        assert first.startswith("You are in the middle of a room. Looking quickly around you, you see ")
        assert first.endswith(f"Your task is to: {game.goal}.")
        step = session.step(session.expert_actions()[0]).observation
        assert step.startswith("You arrive at ") and step == step.strip()
        session.close()


def test_turn_limit_and_after_the_end(alf_dir, alf_games):
    env = get_env("alfworld", level=2, num_train=6, games_dir=alf_dir, generated=True, max_turns=2)
    session = env.open(alf_games[0])
    session.reset()
    first, second = play(session, WRONG[:2])
    assert not first.done and second.done and not second.won
    assert session.step("look") == second.__class__("The game is over.", 0.0, True, False)
    session.close()


def test_actions_are_normalised():
    assert clean_action("  Go to Fridge 1.\nthen open it") == "go to fridge 1"
    assert clean_action('> "take apple 1 from countertop 1"') == "take apple 1 from countertop 1"
    assert clean_action("\n\n") == ""


# -- real ALFWorld data (a fake layout built from generated games)


def fake_alfworld_data(root: Path, games: list[Game]) -> Path:
    """``$ALFWORLD_DATA/json_2.1.1/<split>/<task>-.../trial_.../`` as alfworld-download lays it out."""
    splits = {"train": games[:3], "valid_seen": games[3:4], "valid_unseen": games[4:6]}
    for split, gs in splits.items():
        for i, g in enumerate(gs):
            trial = root / "json_2.1.1" / split / f"{g.info['task_type']}-Obj-None-Recep-{i}" / f"trial_T{i}"
            shutil.copytree(Path(g.path).parent, trial)
            data = json.loads((trial / "game.tw-pddl").read_text())
            data.pop("opd_generated")  # as a real file: its walkthrough is not the planner's
            data["walkthrough"] = ["look"]
            (trial / "game.tw-pddl").write_text(json.dumps(data))
    # What AlfredTWEnv skips: movable receptacles, sliced objects, unsolvable games.
    skipped = root / "json_2.1.1" / "train"
    shutil.copytree(Path(games[0].path).parent, skipped / "pick_and_place_with_movable_recep-A-B-C-1" / "trial_1")
    shutil.copytree(Path(games[0].path).parent, skipped / "pick_and_place_simple-AppleSliced-None-C-1" / "trial_1")
    unsolvable = skipped / "pick_and_place_simple-X-None-Y-9" / "trial_1"
    shutil.copytree(Path(games[0].path).parent, unsolvable)
    data = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**data, "solvable": False}))
    return root


def test_real_alfworld_layout(alf_games, tmp_path, monkeypatch):
    root = fake_alfworld_data(tmp_path / "alfworld_data", alf_games)
    monkeypatch.setenv("ALFWORLD_DATA", str(root))
    env = get_env("alfworld")
    assert env.max_turns == 50
    train = env.games("train")
    assert len(train) == 3 and all(g.id.count("/") == 1 and "trial_T" in g.id for g in train)
    assert sorted(g.goal for g in train) == sorted(g.goal for g in alf_games[:3])
    assert len(env.games("test")) == 2 and env.games("test") == env.games("valid_unseen")
    assert len(env.games("valid_seen")) == 1
    assert len(get_env("alfworld", test_split="valid_seen").games("test")) == 1
    with pytest.raises(UserError, match="test_split='valid' plays generated games' validation split"):
        get_env("alfworld", test_split="valid")
    assert len(get_env("alfworld", max_games=2).games("train")) == 2
    # A real game is played by the same engine; its expert is the planner's, not the stored one.
    game = train[0]
    session = env.open(game)
    assert game.goal in session.reset()
    assert env.expert == "planner" and session.expert_actions() == planner_plan(game.path)
    assert play(session, session.expert_actions())[-1].won
    session.close()
    searching = get_env("alfworld", expert="search")
    session = searching.open(game)
    session.reset()
    assert play(session, session.expert_actions())[-1].won
    session.close()
    # data_dir= does the same without the variable; generated=True ignores the variable.
    monkeypatch.delenv("ALFWORLD_DATA")
    assert len(get_env("alfworld", data_dir=root / "json_2.1.1").games("train")) == 3
    monkeypatch.setenv("ALFWORLD_DATA", str(root))
    assert get_env("alfworld", generated=True, games_dir=tmp_path / "gen").games("train")[0].id.startswith("train/")


def test_bad_alfworld_data_errors_clearly(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("ALFWORLD_DATA", str(missing))
    with pytest.raises(UserError, match=r"ALFWORLD_DATA=.*nowhere does not exist.*json_2\.1\.1.*alfworld-download"):
        get_env("alfworld")
    assert not missing.exists()  # importing alfworld did not create it
    assert os.environ["ALFWORLD_DATA"] == str(missing)  # nor changed the variable
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(UserError, match=r"has no json_2\.1\.1"):
        get_env("alfworld")
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(UserError, match=r"no playable ALFWorld games in .*train"):
        get_env("alfworld").games("train")


# -- bad input


def test_corrupted_game_files_raise_env_error(alf_env, alf_games, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(Path(alf_games[0].path).parent, folder)
    game = Game(id="broken", goal="", path=str(folder / "game.tw-pddl"))
    (folder / "game.tw-pddl").write_text('{"pddl_domain": "(define')
    with pytest.raises(EnvError, match="broken/game.tw-pddl"):
        alf_env.open(game)
    data = json.loads(Path(alf_games[0].path).read_text())
    (folder / "game.tw-pddl").write_text(json.dumps({**data, "pddl_problem": "(define (problem x) (:objects"}))
    with pytest.raises(EnvError, match="broken/game.tw-pddl"):
        alf_env.open(game).reset()
    with pytest.raises(EnvError, match="missing and it is not a generated game"):
        alf_env.open(Game(id="gone", path=str(tmp_path / "gone" / "game.tw-pddl")))


def test_engine_failure_mid_episode_is_env_error(alf_env, alf_games, monkeypatch):
    session = alf_env.open(alf_games[0])
    session.reset()

    def crash(command):
        raise RuntimeError("engine crashed")

    monkeypatch.setattr(session._env, "step", crash)
    with pytest.raises(EnvError, match="failed on 'look'.*engine crashed"):
        session.step("look")
    session.close()


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("alfworld", {"level": 9}, "unknown ALFWorld level 9: use one of 1, 2, 3"),
        ("alfworld", {"levle": 2}, "unknown ALFWorld option.*levle.*use level"),
        ("alfworld", {"num_train": 0}, "num_train=0: expected an integer >= 1"),
        ("alfworld", {"test_split": "dev"}, "test_split='dev'.*valid_unseen.*'valid' for generated"),
        ("alfworld", {"num_train": 999_990, "num_valid": 20}, "num_train \\+ num_valid must be at most 1000000"),
        ("alfworld", {"expert": "oracle"}, "expert='oracle': use 'search' or 'planner'"),
        ("textworld", {"level": 7}, "unknown textworld level 7"),
        ("textworld", {"recipe": 2}, "unknown textworld option.*recipe"),
    ],
)
def test_bad_arguments(name, kwargs, message, tmp_path):
    with pytest.raises(UserError, match=message):
        get_env(name, games_dir=tmp_path, **kwargs)


def test_unknown_split(alf_env):
    with pytest.raises(UserError, match="unknown split 'dev'.*'train', 'test' or 'valid'"):
        alf_env.games("dev")


def test_missing_engine_names_the_extra(monkeypatch):
    import importlib.util

    from opd.envs import _textworld

    real = importlib.import_module

    def no_textworld(name, *a, **k):
        if name.startswith("textworld"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(_textworld.importlib, "import_module", no_textworld)
    with pytest.raises(UserError, match=r"pip install 'opd\[agent\]'"):
        get_env("textworld")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install 'opd\[agent\]'"):
        _textworld.alfworld_paths()


def test_alfworld_imports_offline_without_side_effects(tmp_path):
    # A fresh process: alfworld's import would create ~/.cache/alfworld and set ALFWORLD_DATA.
    code = (
        "import os; from opd.envs import get_env; env = get_env('alfworld', num_train=2);"
        "print(len(env.games('train')), os.environ.get('ALFWORLD_DATA'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    env.update(HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "None"]
    assert not (tmp_path / ".cache" / "alfworld").exists()


# -- TextWorld's cooking games


@pytest.fixture(scope="session")
def cooking(tmp_path_factory):
    env = get_env("textworld", level=1, num_train=1, num_test=1, games_dir=tmp_path_factory.mktemp("tw"))
    game = env.games("train")[0]
    env.open(game).close()  # generates it, whichever test runs first (under xdist too)
    return env, game


def test_cooking_expert_wins_with_clean_observations(cooking):
    env, game = cooking
    session = env.open(game)
    first = session.reset()
    assert first.startswith("You are hungry!") and "cookbook" in first
    assert "$$" not in first and "=-0/" not in first and "-= Kitchen =-\n" in first
    expert = session.expert_actions()
    assert expert[:2] == ["inventory", "examine cookbook"] and expert[-1] == "eat meal"
    results = play(session, expert)
    texts = [r.observation for r in results]
    assert not any(">" in t or "=-" in t or "score" in t.lower() or "RESTART" in t for t in texts)
    assert results[-1].done and results[-1].won and not any(r.done for r in results[:-1])
    assert sum(r.reward for r in results) == pytest.approx(1.0)  # points over the maximum
    assert "Recipe #1" in texts[1]
    session.close()


def test_cooking_wrong_actions_and_splits(cooking):
    env, game = cooking
    session = env.open(game)
    session.reset()
    dance, inedible = play(session, ["dance", "eat fridge"])
    assert dance.observation == "That's not a verb I recognise." and not (dance.done or dance.reward)
    assert not inedible.won and inedible.reward == 0.0
    assert "examine cookbook" in session.admissible_commands()
    session.close()
    test = env.games("test")[0]
    assert test.info["seed"] % 2 == 1 and game.info["seed"] % 2 == 0 and test.id != game.id


def test_cooking_generation_is_deterministic(cooking, tmp_path):
    from opd.envs.textworld_games import generate_cooking

    env, game = cooking
    again = generate_cooking(1, game.info["seed"], "train", tmp_path / "again")
    first = Path(game.path).parent
    assert (again / "game.json").read_bytes() == (first / "game.json").read_bytes()
    # The story file's header carries the compile date (bytes 0x12-0x17, Inform's serial number).
    mask = lambda b: b[:0x12] + b[0x18:]  # noqa: E731
    assert mask((again / "game.z8").read_bytes()) == mask((first / "game.z8").read_bytes())
    assert (first / "game.z8").read_bytes() != generate_cooking(1, 2, "train", tmp_path / "other").joinpath(
        "game.z8"
    ).read_bytes()


def test_cooking_corrupted_file(cooking, tmp_path):
    env, game = cooking
    folder = tmp_path / "bad"
    shutil.copytree(Path(game.path).parent, folder)
    # jericho would end the whole process on these: the session must refuse them first.
    story = (folder / "game.z8").read_bytes()
    for damaged in (b"not a story file", story[: len(story) // 2], story[:100] + b"x" + story[101:]):
        (folder / "game.z8").write_bytes(damaged)
        with pytest.raises(EnvError, match="bad/game.z8.*story file"):
            env.open(Game(id="bad", path=str(folder / "game.z8")))


# -- the search expert as a policy: its next command from any state (DAgger's labels)


def follow_expert(session, limit: int = 60) -> list:
    """Play ``expert_next()`` until it has nothing more to say (or ``limit`` commands)."""
    results = []
    while len(results) < limit and (command := session.expert_next()) is not None:
        results.append((command, session.step(command)))
        if results[-1][1].done:
            break
    return results


def test_expert_next_from_the_start_is_the_expert_episode(alf_env, alf_games):
    for game in alf_games:
        session = alf_env.open(game)
        session.reset()
        commands = [c for c, _ in follow_expert(session)]
        assert commands == session.expert_actions(), game.id
        session.close()


def test_expert_next_takes_over_after_detours_and_names_only_what_was_seen(alf_dir, alf_games):
    """Another player's commands first (admissible ones, rejected ones, held objects put elsewhere),
    then the expert from wherever that left the game: it still wins, and names no object before an
    observation showed it."""
    import random

    env = get_env("alfworld", level=2, num_train=6, games_dir=alf_dir, generated=True, max_turns=200)
    for game in alf_games:
        for trial in range(3):
            rng = random.Random(f"{game.id}:{trial}")
            session = env.open(game)
            text = session.reset()
            receptacles = set(re.findall(r"[a-z]+ \d+", text.split("Your task")[0]))
            for _ in range(rng.randrange(3, 12)):
                command = rng.choice([*session.admissible_commands(), *WRONG])
                result = session.step(command)
                text += "\n" + result.observation
                assert not result.done, (game.id, command)  # a detour this short never ends a level-2 game
            tail = follow_expert(session)
            for command, result in tail:
                unseen = named_objects(command, receptacles) - set(re.findall(r"[a-z]+ \d+", text))
                assert not unseen, (game.id, trial, command)
                text += "\n" + result.observation
            assert tail and tail[-1][1].won, (game.id, trial, [c for c, _ in tail])
            assert session.expert_next() is None  # nothing more to do
            session.close()


def test_expert_next_after_a_rejected_command_is_unchanged(alf_env, alf_games):
    session = alf_env.open(alf_games[0])
    session.reset()
    first = session.expert_next()
    assert session.step("take apple 1 from nowhere").observation == "Nothing happens."
    assert session.expert_next() == first == session.expert_actions()[0]
    session.close()


def test_toy_expert_next_takes_over_from_any_state():
    import random

    env = get_env("toy", level=3, n_train=8, max_turns=100)
    for game in env.games("train"):
        rng = random.Random(game.id)
        session = env.open(game)
        session.reset()
        assert session.expert_next() == session.expert_actions()[0]
        for _ in range(rng.randrange(0, 6)):
            session.step(rng.choice([*session.admissible_commands(), "dance"]))
        if session.won:
            continue
        tail = follow_expert(session)
        assert tail[-1][1].won and session.expert_next() is None
