"""The multi-task demo: the model recipe (shortened), the demo pipeline (quick) and the experiment
(quick), end to end on arithmetic and ALFWorld games generated locally."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from helpers import run_options
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.config import SFTConfig
from opd.errors import UserError
from opd.lab.demos.multitask import GAME, MATH, make_multitask_models, run_multitask_demo, task_steps

# Looked up, not imported: importing alfworld sets ALFWORLD_DATA for the whole process.
if importlib.util.find_spec("alfworld") is None:
    pytest.skip("the multi-task demo needs the agent extra: pip install 'opd[agent]'", allow_module_level=True)


def test_missing_models_name_the_recipe(tmp_path, monkeypatch):
    import opd.lab.demos.agentic
    import opd.lab.demos.multitask

    with pytest.raises(
        UserError, match=r"missing in .*nowhere \(math_teacher, student\); run `opd make-demo-models --multitask"
    ):
        run_multitask_demo(tmp_path / "demo", assets=tmp_path / "nowhere")
    for name in ("math_teacher", "student"):  # made, but the game teacher was not copied beside them
        (tmp_path / "mt" / name).mkdir(parents=True)
        (tmp_path / "mt" / name / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"\(game_teacher\); run `opd make-demo-models --multitask --out .*mt`"):
        run_multitask_demo(tmp_path / "demo", assets=tmp_path / "mt")
    # the packaged models refer to the packaged agentic demo's game teacher: its own recipe makes it
    monkeypatch.setattr(opd.lab.demos.multitask, "ASSETS", tmp_path / "mt")
    monkeypatch.setattr(opd.lab.demos.agentic, "ASSETS", tmp_path / "agentic")
    with pytest.raises(
        UserError, match=r"game teacher .*agentic/teacher is missing; run `opd make-demo-models --agentic"
    ):
        run_multitask_demo(tmp_path / "demo")
    with pytest.raises(UserError, match=r"agentic demo's tokenizer.*`opd make-demo-models --agentic --out"):
        make_multitask_models(tmp_path / "mt", quick=True, agentic=tmp_path / "no-agentic")
    with pytest.raises(UserError, match="--only"):
        make_multitask_models(tmp_path / "mt", quick=True, only="teachers")


def test_packaged_models_come_from_the_recipe_as_written():
    """The packaged student and math teacher were made by today's recipe: the configs their runs
    logged equal the recipe's (all but where it wrote), and their scores are the summary's."""

    from opd.lab.demos.demo import teacher_sft_config
    from opd.lab.demos.multitask import ASSETS, student_sft_config

    made = json.loads((ASSETS / "make_summary.json").read_text())
    assert set(made) == {"math_teacher", "student"}
    for name, recipe in (("student", student_sft_config), ("math_teacher", teacher_sft_config)):
        logged = run_options(ASSETS / "runs" / name, SFTConfig)
        expected = recipe(Path(logged["out"]), logged["tokenizer"]).flat()
        # Options added since the models were made are not in their logs: where the games ran (the
        # same episodes with 0, 1 or N env workers), validation_size, which the recipe keeps at 0
        # (the checkpoint chosen on the test set, as when these models were made), and options whose
        # defaults are what ran then: no chat-template options, evaluation on, TF32 (a GPU's; made on a CPU),
        # no activation checkpointing, the check that chat-template options are ones the template reads, and
        # no Hub revisions (local folders).
        added = {
            "env_workers": None,
            "env_step_timeout": None,
            "validation_size": 0,
            "chat_template_kwargs": {},
            "eval": True,
            "tf32": None,
            "gradient_checkpointing": False,
            "check_chat_template_kwargs": True,
            **{f"{what}_revision": "" for what in ("task", "student", "eval", "teacher")},
        }
        for k in set(expected) - set(logged):
            assert k in added and added[k] in (None, expected[k]), k
        expected = {k: v for k, v in expected.items() if k in logged}
        assert logged == json.loads(json.dumps(expected)), name
        assert Path(logged["tokenizer"]).parts[-2:] == ("agentic", "tokenizer")  # the shared tokenizer
        assert json.loads((ASSETS / "runs" / name / "summary.json").read_text()) == made[name]
        assert (ASSETS / name / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The shortened recipe's models, on quick agentic models: (agentic dir, multi-task dir, what was made)."""
    from opd.lab.demos.agentic import make_agentic_models

    root = tmp_path_factory.mktemp("models")
    make_agentic_models(root / "agentic", quick=True)
    made = make_multitask_models(root / "multitask", quick=True, agentic=root / "agentic")
    return root / "agentic", root / "multitask", made


@pytest.mark.slow
def test_recipe_makes_a_math_teacher_and_a_student_of_both_tasks_on_the_shared_tokenizer(models):
    agentic, assets, made = models
    assert set(made) == {"math_teacher", "student"}
    assert made["math_teacher"]["steps"] == 10 and made["student"]["steps"] == 6
    assert set(made["student"]["best_by_task"]) == {MATH, GAME}
    shared = AutoTokenizer.from_pretrained(agentic / "tokenizer")
    for name, layers in (("math_teacher", 4), ("game_teacher", 4), ("student", 2)):
        model = AutoModelForCausalLM.from_pretrained(assets / name)
        assert model.config.num_hidden_layers == layers and model.config.vocab_size == len(shared)
    # the game teacher is the agentic demo's, copied so that the directory stands alone
    assert (assets / "game_teacher" / "model.safetensors").read_bytes() == (
        agentic / "teacher" / "model.safetensors"
    ).read_bytes()
    # the student learned both tasks in one run: a batch of each at every step, each evaluated
    config = run_options(assets / "runs" / "student", SFTConfig)
    assert [t["name"] for t in config["tasks"]] == [MATH, GAME] and config["task_mode"] == "mix"
    records = [json.loads(x) for x in (assets / "runs" / "student" / "metrics.jsonl").read_text().splitlines()]
    assert all({f"{MATH}/train/loss", f"{GAME}/train/loss"} <= set(r) for r in records if "train/loss" in r)
    assert any({f"eval/{MATH}/accuracy", f"eval/{GAME}/accuracy"} <= set(r) for r in records)
    assert run_options(assets / "runs" / "math_teacher", SFTConfig)["tokenizer"] == str(agentic / "tokenizer")


@pytest.mark.slow
def test_quick_multitask_demo(models, tmp_path):
    _, assets, _ = models
    summary = run_multitask_demo(tmp_path / "demo", quick=True, assets=assets)
    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == summary
    assert set(summary["models"]) == {"math_teacher", "game_teacher", "student"}
    assert set(summary["models"]["student"]) == {MATH, GAME}
    assert (tmp_path / "demo" / "report" / "report.html").is_file()
    assert set(summary["objectives"]) == {"sampled", "lsm-tail"}
    for name, r in summary["objectives"].items():
        run = tmp_path / "demo" / name
        config = run_options(run)
        assert config["task_mode"] == "alternate" and config["objective"] == name.split("-")[0]
        assert config["support"] == "teacher_topk" and config["tail"] == (name == "lsm-tail")
        teachers = {t["name"]: t["teacher"] for t in config["tasks"]}
        assert teachers == {MATH: str(assets / "math_teacher"), GAME: str(assets / "game_teacher")}
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        trained = [MATH if f"{MATH}/train/loss" in r else GAME for r in records if "train/loss" in r]
        assert trained == [MATH, GAME, MATH, GAME]  # math and game steps alternate
        last = [r for r in records if f"eval/{MATH}/accuracy" in r][-1]
        assert r["tasks"][MATH]["final_acc"] == last[f"eval/{MATH}/accuracy"]
        assert r["tasks"][GAME]["final_acc"] == last[f"eval/{GAME}/success_rate"]
        assert (run / "tasks" / MATH / "eval.jsonl").is_file() and (run / "tasks" / GAME / "eval.jsonl").is_file()


@pytest.mark.slow
def test_quick_multitask_experiment(models, tmp_path):
    from opd.lab.experiments import run
    from opd.lab.experiments.multitask import MEASURED_SHARE, SINGLE, VARIANTS
    from opd.lab.experiments.stats import INCONCLUSIVE

    _, assets, _ = models
    shutil.copytree(assets, tmp_path / "multitask" / "quick-models")  # made once for the module
    res = run("multitask", tmp_path, seeds=1, quick=True, show_progress=False)
    assert res["quick"] and len(res["claims"]) == 8  # (a), (b) x2, (c) x3, (d) x2
    assert all(c["verdict"] == INCONCLUSIVE for c in res["claims"])  # one seed decides nothing
    rows = {r[0]: r for r in res["tables"][0]["rows"]}
    assert set(rows) == set(VARIANTS) | set(SINGLE)
    assert rows["game-only/lsm"][2:4] == ["-", "-"] and rows["math-only/lsm"][4:6] == ["-", "-"]
    formats = next(t for t in res["tables"] if "holding a format token" in t["title"])
    assert [r[0] for r in formats["rows"]] == [*VARIANTS, "game-only/lsm"]
    assert all(cell != "-" for r in formats["rows"] for cell in r[1:])  # read from every run's logged metrics
    for variant, (task, _) in SINGLE.items():  # the same budget: the steps that task gets in a two-task run
        config = run_options(tmp_path / "multitask" / "runs" / variant / "seed0")
        assert config["steps"] == task_steps(4, task, math_share=MEASURED_SHARE) and [
            t["name"] for t in config["tasks"]
        ] == [task]
    for p in res["plots"]:
        assert (tmp_path / "multitask" / p).is_file()
    assert "--tasks" in (tmp_path / "multitask" / "commands.txt").read_text()


@pytest.mark.slow
def test_quick_multitask_tail_experiment(models, tmp_path):
    from opd.lab.demos.multitask import GAME_LR, LR
    from opd.lab.experiments import run
    from opd.lab.experiments.multitask_tail import AGENTIC, SINGLE_TASK, STUDENT, VARIANTS
    from opd.lab.experiments.stats import INCONCLUSIVE

    _, assets, _ = models
    shutil.copytree(assets, tmp_path / "multitask-tail" / "quick-models")
    res = run("multitask-tail", tmp_path, seeds=1, quick=True, show_progress=False, workers=2)
    assert len(res["claims"]) == 9  # (e) x2, (f) x2, (g), masking x2, (h), (i)
    assert all(c["verdict"] == INCONCLUSIVE for c in res["claims"])  # one seed decides nothing
    two, single, game, formats = res["tables"][:4]
    assert [r[0] for r in two["rows"]] == [STUDENT, *VARIANTS]
    assert all(cell != "-" for r in two["rows"] for cell in r[1:])  # every run on both tasks, the student too
    assert [r[0] for r in single["rows"]] == list(SINGLE_TASK)
    assert [r[0] for r in game["rows"]] == list(AGENTIC)
    assert all(cell != "-" for r in game["rows"] for cell in r[1:])
    assert [r[0] for r in formats["rows"]] == list(VARIANTS)
    for variant in AGENTIC:  # the game alone: the agentic demo's models, masked, the tail where named
        config = run_options(tmp_path / "multitask-tail" / "runs" / variant / "seed0")
        assert config["tail"] == variant.endswith("tail") and config["mask_special"] and config["env"] == "alfworld"
        assert config["teacher"].endswith("agentic/teacher")
    for variant in VARIANTS:
        config = run_options(tmp_path / "multitask-tail" / "runs" / variant / "seed0")
        assert config["tail"] == ("tail" in variant) and config["lr"] == LR
        assert {t["name"]: t.get("lr") for t in config["tasks"]} == {MATH: None, GAME: GAME_LR}  # the game's own
        assert config["mask_special"] == (variant in ("lsm", "lsm-tail"))
    for p in res["plots"]:
        assert (tmp_path / "multitask-tail" / p).is_file()


@pytest.mark.slow
def test_quick_multitask_game_experiment(models, tmp_path):
    """The demo's recipe over seeds: the student's evaluation and the demo's two objectives, as the demo runs them."""
    from opd.lab.demos.multitask import GAME_LR, MATH_SHARE, OBJECTIVES
    from opd.lab.experiments import run
    from opd.lab.experiments.multitask import QUICK_STEPS
    from opd.lab.experiments.stats import INCONCLUSIVE

    _, assets, _ = models
    shutil.copytree(assets, tmp_path / "multitask-game" / "quick-models")
    res = run("multitask-game", tmp_path, seeds=1, quick=True, show_progress=False)
    assert len(res["claims"]) == 4 and all(c["verdict"] == INCONCLUSIVE for c in res["claims"])
    assert [r[0] for r in res["tables"][0]["rows"]] == ["student", *OBJECTIVES]
    assert all(cell != "-" for r in res["tables"][0]["rows"] for cell in r[1:])  # the student on both tasks too
    for variant, change in OBJECTIVES.items():
        config = run_options(tmp_path / "multitask-game" / "runs" / variant / "seed0")
        assert config["steps"] == QUICK_STEPS and config["objective"] == change["objective"]
        assert config["tail"] == change.get("tail", False) and config["mask_special"] == (variant != "sampled")
        shares = {t["name"]: (t.get("share", 1), t.get("lr")) for t in config["tasks"]}  # a share of 1 is not written
        assert shares == {MATH: (MATH_SHARE, None), GAME: (1, GAME_LR)}
