"""The agentic demo: the model recipe (shortened) and the demo pipeline (quick) run end to end on
ALFWorld games generated locally."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import run_options
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.config import SFTConfig, option_fields
from opd.errors import UserError
from opd.lab.demos.agentic import MAX_PROMPT_TOKENS, environment, make_agentic_models, run_agentic_demo

# Looked up, not imported: importing alfworld sets ALFWORLD_DATA for the whole process.
if importlib.util.find_spec("alfworld") is None:
    pytest.skip("the agentic demo needs the agent extra: pip install 'opd[agent]'", allow_module_level=True)


@pytest.mark.slow
def test_make_agentic_models_and_quick_agentic_demo(tmp_path):
    assets = tmp_path / "assets"
    made = make_agentic_models(assets, quick=True)
    assert set(made) == {"teacher", "student"} and made["student"]["steps"] == 6
    # The teacher in three stages, each from the one before (whose weights are not kept apart):
    # cloning, then the same games with mistakes, then the states the student's and its own play reach.
    assert [s["steps"] for s in made["teacher"]["stages"]] == [6, 4, 4] and made["teacher"]["steps"] == 4
    runs = assets / "runs"
    assert run_options(runs / "teacher-recovery", SFTConfig)["expert_mistakes"] > 0
    dagger = run_options(runs / "teacher-dagger", SFTConfig)
    assert dagger["init"] == str(runs / "teacher-recovery" / "final")
    assert dagger["dagger_from"] == [str(assets / "student"), str(runs / "teacher-recovery" / "final")]
    assert not (runs / "teacher" / "final").exists() and not (runs / "teacher-recovery" / "final").exists()
    # The student before the teacher: the last stage plays it. Alone, the teacher needs it made.
    assert list(json.loads((assets / "make_summary.json").read_text())) == ["student", "teacher"]
    with pytest.raises(UserError, match="--only student"):
        make_agentic_models(tmp_path / "elsewhere", quick=True, only="teacher")
    assert not (tmp_path / "elsewhere").exists()
    tok = AutoTokenizer.from_pretrained(assets / "student")
    for name, layers in (("teacher", 4), ("student", 2)):
        model = AutoModelForCausalLM.from_pretrained(assets / name)
        assert model.config.vocab_size == len(tok) and model.config.num_hidden_layers == layers
    # One tokenizer for both kinds of text: game words are tokens, so an episode's prompt fits.
    env = environment(quick=True)
    first = env.open(env.games("test")[0]).reset()
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert len(tok(prompt)["input_ids"]) <= MAX_PROMPT_TOKENS < len(prompt.encode()) / 2
    assert tok.decode(tok("Compute 12 + 7.")["input_ids"]) == "Compute 12 + 7."
    with pytest.raises(UserError, match="--only"):
        make_agentic_models(assets, quick=True, only="teachers")

    summary = run_agentic_demo(tmp_path / "demo", quick=True, assets=assets)
    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == summary
    assert summary["env"] == "alfworld" and summary["eval_size"] == 8
    assert (tmp_path / "demo" / "report" / "report.html").is_file()
    for objective in ("sampled", "lsm"):
        r = summary["objectives"][objective]
        run = tmp_path / "demo" / objective
        evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/" in line]
        assert r["final_acc"] == evals[-1]["eval/success_rate"] and r["steps"] == 3
        games = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
        assert len(games) == 8 and all((run / g["path"]).is_file() for g in games)
        assert (run / "final" / "config.json").is_file()
        assert run_options(run)["env"] == "alfworld"


def test_the_game_teacher_learns_from_the_demos_games_and_more():
    from opd.lab.demos.agentic import ENV, LEVEL, TEACHER_GAMES, env_args, teacher_env_args
    from opd.rollout.game_set import make_env

    demo, teacher = make_env(ENV, LEVEL, env_args(False)), make_env(ENV, LEVEL, teacher_env_args(False))
    demo_train, teacher_train = [g.id for g in demo.games("train")], [g.id for g in teacher.games("train")]
    assert len(teacher_train) == TEACHER_GAMES > len(demo_train)
    # The student clones the first of the demo's games; the teacher's include them, and the same
    # held-out games are the demo's and the recipe's evaluation.
    assert teacher_train[: len(demo_train)] == demo_train
    assert [g.id for g in teacher.games("test")] == [g.id for g in demo.games("test")]
    assert not set(teacher_train) & {g.id for g in teacher.games("test")}
    assert teacher_env_args(True) == env_args(True)  # the shortened recipe stays small


def test_packaged_models_come_from_the_recipe_as_written():
    """The packaged student and game teacher were made by today's recipe: each run's logged config
    equals the recipe's in everything but where it wrote and read models (they were made as separate
    `opd sft` runs, see docs/demos.md), each teacher stage starts from the one before, and the
    scores are the summary's."""
    import dataclasses
    from pathlib import Path

    from opd.lab.demos.agentic import ASSETS, student_sft_config, teacher_sft_configs
    from opd.rollout.game_set import parse_env_args

    paths = ("out", "init", "dagger_from", "tokenizer")
    defaults = {
        f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
        for _, f in option_fields(SFTConfig)
    }

    def settings(logged: dict, recipe) -> tuple[dict, dict]:
        expected = json.loads(json.dumps(recipe.flat()))
        # An option added after a run was made is missing from its log: the recipe must leave it
        # at what the run had: its default (e.g. env_workers, the same episodes with any number), or
        # the value that does what opd did before the option (validation_size 0: chosen on the test set).
        before = {"validation_size": 0}
        for k in set(expected) - set(logged):
            assert expected[k] == json.loads(json.dumps(before.get(k, defaults[k]))), k
        keep = [k for k in expected if k not in paths and k in logged]
        got, want = {k: logged[k] for k in keep}, {k: expected[k] for k in keep}
        # "a=1,b=2" (one CLI value) and ["a=1", "b=2"] are the same games
        got["env_args"], want["env_args"] = parse_env_args(got["env_args"]), parse_env_args(want["env_args"])
        return got, want

    made = json.loads((ASSETS / "make_summary.json").read_text())
    runs = ASSETS / "runs"
    logged = run_options(runs / "student", SFTConfig)
    got, want = settings(logged, student_sft_config(ASSETS))
    assert got == want
    stages = [run_options(runs / name, SFTConfig) for name in ("teacher", "teacher-recovery", "teacher-dagger")]
    for logged, recipe in zip(stages, teacher_sft_configs(ASSETS), strict=True):
        got, want = settings(logged, recipe)
        assert got == want, logged["out"]
    for before, stage in zip(stages, stages[1:]):
        assert Path(stage["init"]) == Path(before["out"]) / "final"
    assert Path(stages[2]["dagger_from"][1]) == Path(stages[1]["out"]) / "final"
    assert [
        json.loads((runs / n / "summary.json").read_text()) for n in ("teacher", "teacher-recovery", "teacher-dagger")
    ] == made["teacher"]["stages"]
