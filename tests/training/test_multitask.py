"""Multi-task OPD (``tasks:`` in the config): the schedule, each task's data and teacher, per-task
metrics and evaluation, resume and 2 ranks, and the config's errors. Tiny random models, CPU only."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import make_tiny_model
from helpers import (
    SMALL,
    assert_close_weights,
    final_weights,
    launch,
    read_metrics,
    run_options,
    step_records,
    train_killed_at,
)
from typer.testing import CliRunner

from opd.cli import app
from opd.config import ConfigError, TrainConfig, resolve_tasks
from opd.errors import UserError
from opd.models.loading import load_tokenizer
from opd.rollout.prompt_set import batch_indices
from opd.training import loop as train_mod
from opd.training import producer
from opd.training import setup as setup_mod
from opd.training.schedule import split_by_task, task_for_step, task_schedule
from opd.training.stepstats import FULL_VOCAB_KEYS

BASE = {**SMALL, "steps": 4, "batch_size": 4}
TOY = dict(env="toy", env_level=1, max_new_tokens=96, max_action_tokens=8, max_turns=4, eval_size=3)


@pytest.fixture(scope="module")
def teacher2(tiny_tokenizer, tmp_path_factory):
    """A second teacher on the student's tokenizer, different from the first."""
    return make_tiny_model(tiny_tokenizer, tmp_path_factory.mktemp("teacher2") / "t2", layers=1, width=48, seed=3)


def two_math(teacher2) -> list[dict]:
    """Two arithmetic tasks (different levels, so different prompts), each with its own teacher."""
    return [
        {"name": "easy", "task_level": 1},  # the global teacher
        {"name": "hard", "task_level": 3, "teacher": str(teacher2), "share": 0.5},
    ]


def mt_cfg(models, out, tasks, **kw) -> TrainConfig:
    student, teacher = models
    return TrainConfig.from_flat(
        student=str(student), teacher=str(teacher), out=str(out), tasks=tasks, **{**BASE, **kw}
    )


def compare(got: list[dict], want: list[dict], rel: float = 1e-6, abs_: float = 1e-9) -> None:
    """Equal records, overall and per task, but timings and the full-vocabulary diagnostics (their
    positions are a sample that depends on how the batch is laid out over ranks)."""
    sampled = lambda key: any(key == k or key.endswith("/" + k) for k in FULL_VOCAB_KEYS)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for w, g in zip(want, got, strict=True):
        assert set(g) == set(w)
        for key in w:
            if not key.startswith("time/") and not sampled(key):
                assert g[key] == pytest.approx(w[key], rel=rel, abs=abs_), (w["step"], key)


# ----------------------------------------------------------------------------- the schedule


def test_schedule_is_a_pure_function_of_step_shares_and_seed():
    assert [t for t, _ in task_schedule(6, [1, 1])] == [0, 1, 0, 1, 0, 1]
    two_to_one = [t for t, _ in task_schedule(30, [2, 1])]
    assert all(two_to_one[i : i + 3].count(0) == 2 for i in range(0, 30, 3))  # every window of 3: A twice
    # proportions follow the normalised shares, however they are written
    for shares in ([0.7, 0.2, 0.1], [7, 2, 1]):
        counts = [t for t, _ in task_schedule(100, shares)]
        assert [counts.count(i) for i in range(3)] == [70, 20, 10]
    # a prefix does not depend on the length asked for; one step alone gives the same answer
    long = task_schedule(50, [3, 2], seed=5)
    assert task_schedule(17, [3, 2], seed=5) == long[:17]
    assert all(task_for_step(s, [3, 2], seed=5) == long[s] for s in range(50))
    # the second element counts the task's earlier steps: its batch number in its own prompt order
    for s, (t, visit) in enumerate(long):
        assert visit == [x for x, _ in long[:s]].count(t)
    # the seed rotates which task goes first on ties
    assert [t for t, _ in task_schedule(4, [1, 1], seed=1)] == [1, 0, 1, 0]


def test_each_task_walks_its_own_prompt_order(tiny_models, teacher2, tmp_path):
    run = train_mod.setup(mt_cfg(tiny_models, tmp_path / "run", two_math(teacher2), batch_size=2))
    easy, hard = run.tasks
    assert easy.share == pytest.approx(2 / 3) and hard.share == pytest.approx(1 / 3)
    assert easy.source.examples[0].prompt != hard.source.examples[0].prompt
    seen = {"easy": 0, "hard": 0}
    for step in range(4):
        (at,) = producer.step_tasks(run, step)
        assert at.visit == seen[at.task.name] and at.slot0 == 0
        _, rows, _ = producer.rollout_stage(run, step, at)
        assert rows == batch_indices(len(at.task.source), at.visit, 2, run.cfg.run.seed)
        seen[at.task.name] += 1
    assert seen == {"easy": 3, "hard": 1}  # A, B, A, A


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("tasks", "kw", "match"),
    [
        ([], {}, "tasks is empty"),
        ([{"name": "a"}, {"name": "a"}], {}, "task 'a' is listed twice"),
        ([{"name": "a", "share": 0}], {}, "task 'a': share=0 must be a positive"),
        ([{"name": "a", "share": -1}], {}, "share=-1"),
        ([{"name": "a", "k": 4}], {}, "task 'a': 'k' is a global setting"),
        ([{"name": "a", "objective": "sampled"}], {}, "task 'a': 'objective' is a global setting"),
        ([{"name": "a", "colour": 1}], {}, "task 'a': 'colour' is not a setting"),
        ([{"name": "a", "top_p": 2.0}], {}, "task 'a': top_p=2.0"),
        ([{"name": "train"}], {}, "name='train'"),
        ([{"share": 1}], {}, "name=None"),
        (["math"], {}, "no such file"),
        ([{"name": "a"}], {"teacher": ""}, "task 'a' has no teacher; give it teacher: DIR"),
        ([{"name": "a"}, {"name": "b", "share": 0.001}], {"task_mode": "mix"}, "task 'b' gets no prompts in mix"),
        ([{"name": "a"}], {"task_mode": "both"}, "task_mode='both'"),
    ],
)
def test_bad_task_lists_name_the_task_and_the_fix(tasks, kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_flat(**{"teacher": "t", "tasks": tasks, **kw})


def test_task_overrides_resolve_into_checked_configs(tmp_path):
    tasks_file = tmp_path / "tasks.yaml"
    tasks_file.write_text(
        yaml.safe_dump(
            [
                {"name": "math", "share": 3, "max_new_tokens": 512, "temperature": 1},
                {"name": "game", "env": "toy", "teacher_url": "http://127.0.0.1:9", "batch_size": 2},
            ]
        )
    )
    cfg = TrainConfig.from_flat(teacher="t", teacher_dtype="bfloat16", env="", tasks=[str(tasks_file)], task_mode="mix")
    assert [t["name"] for t in cfg.multitask.tasks] == ["math", "game"]  # the file's list, kept in config.json
    math, game = resolve_tasks(cfg)
    assert (math.share, game.share) == (0.75, 0.25)
    assert math.cfg.rollout.max_new_tokens == 512 and isinstance(math.cfg.rollout.temperature, float)
    assert math.cfg.optimizer.batch_size == 48  # round(0.75 * 64) in mix mode
    assert (math.cfg.teacher.teacher, math.cfg.teacher.teacher_dtype) == ("t", "bfloat16")
    # a task's teacher_url replaces the global teacher (and its in-process dtype)
    assert (game.cfg.teacher.teacher, game.cfg.teacher.teacher_url, game.cfg.teacher.teacher_dtype) == (
        "",
        "http://127.0.0.1:9",
        "",
    )
    assert game.cfg.optimizer.batch_size == 2 and game.cfg.multitask.tasks is None
    assert resolve_tasks(TrainConfig.from_flat(teacher="t"))[0].name == ""  # a single-task run: one task, no name


def test_a_teacher_with_another_vocabulary_names_its_task(tiny_models, tmp_path):
    from opd.models.loading import tiny_qwen2
    from opd.models.tokenizer import train_tokenizer
    from opd.tasks import ArithmeticTask

    ex = ArithmeticTask(n_train=300, n_test=10, seed=5).examples("train")
    tok = train_tokenizer([e.prompt for e in ex] + [e.solution for e in ex], vocab_size=600)
    other = tmp_path / "other"
    tiny_qwen2(len(tok), 1, 32, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).save_pretrained(other)
    tok.save_pretrained(other)
    tasks = [{"name": "good"}, {"name": "odd", "teacher": str(other), "cross_tokenizer": "off"}]
    with pytest.raises(UserError, match="task 'odd': student and teacher tokenizers differ"):
        train_mod.setup(mt_cfg(tiny_models, tmp_path / "run", tasks))


# ----------------------------------------------------------------------------- teachers


class _Spy:
    """A teacher that records which rollouts it scored."""

    def __init__(self, real, label, log):
        self.real, self.label, self.log = real, label, log

    def score(self, batch, k, **kw):
        episode = bool((batch.action_mask_NT != batch.response_mask_NT).any())
        self.log.append((self.label, batch.num_rollouts, episode))
        return self.real.score(batch, k, **kw)

    def hidden_and_head(self, batch):
        return self.real.hidden_and_head(batch)


def test_each_rollout_is_scored_by_its_own_tasks_teacher(tiny_models, teacher2, tmp_path, monkeypatch):
    """Mix mode, a math task and the toy game with different teachers and batch sizes, and a third
    task sharing the first teacher: every step asks each teacher for exactly its tasks' rollouts,
    and the shared teacher is loaded once."""
    made, log = [], []
    real_make = setup_mod.make_teacher

    def spy_make(cfg, student, tok):
        made.append(cfg.teacher.teacher)
        return _Spy(real_make(cfg, student, tok), "t2" if cfg.teacher.teacher == str(teacher2) else "t1", log)

    monkeypatch.setattr(setup_mod, "make_teacher", spy_make)
    tasks = [
        {"name": "math", "batch_size": 3},
        {"name": "toy", "teacher": str(teacher2), "batch_size": 2, **TOY},
        {"name": "math3", "task_level": 3, "batch_size": 1},
    ]
    cfg = mt_cfg(tiny_models, tmp_path / "run", tasks, task_mode="mix", steps=2, ckpt_every=0)
    train_mod.train(cfg, show_progress=False)
    assert made == [str(tiny_models[1]), str(teacher2)]  # math and math3 share one teacher
    assert log == [("t1", 3, False), ("t2", 2, True), ("t1", 1, False)] * 2
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} == {"math", "toy", "math3"}
    assert all(("turns" in r) == (r["task"] == "toy") for r in records)


def test_a_teacher_server_that_is_down_names_its_task(tiny_models, teacher2, tmp_path, monkeypatch):
    from helpers import free_port

    down = [{"name": "math"}, {"name": "game", "teacher_url": f"http://127.0.0.1:{free_port()}"}]
    cfg = mt_cfg(tiny_models, tmp_path / "a", down, teacher_retries=0, teacher_timeout=2.0)
    with pytest.raises(UserError, match="task 'game': teacher server .* is unreachable"):
        train_mod.setup(cfg)
    # one that goes down mid-run stops it, naming the task; the last checkpoint stays
    real_make = setup_mod.make_teacher

    class GoesDown(_Spy):
        def score(self, batch, k, **kw):
            self.log.append(1)
            if len(self.log) > 1:
                raise UserError("teacher server http://x is unreachable after 4 attempts")
            return self.real.score(batch, k, **kw)

    def make(cfg, student, tok):
        real = real_make(cfg, student, tok)
        return GoesDown(real, "t2", []) if cfg.teacher.teacher == str(teacher2) else real

    monkeypatch.setattr(setup_mod, "make_teacher", make)
    with pytest.raises(UserError, match="task 'hard': teacher server http://x is unreachable"):
        train_mod.train(mt_cfg(tiny_models, tmp_path / "b", two_math(teacher2), task_mode="mix"), show_progress=False)
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == "step_0000000"


# ----------------------------------------------------------------------------- runs


def test_math_and_a_game_in_one_run_from_a_config_file(tiny_models, teacher2, tmp_path):
    student, teacher = tiny_models
    config = {
        "student": str(student),
        "out": str(tmp_path / "run"),
        **{k: v for k, v in BASE.items() if k != "ckpt_every"},
        "steps": 3,
        "eval_samples": 2,
        "ckpt_every": 0,
        "tasks": [
            {"name": "math", "teacher": str(teacher)},
            {"name": "toy", "teacher": str(teacher2), **TOY},
        ],
    }
    path = tmp_path / "multi.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["train", "--config", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = tmp_path / "run"
    steps = step_records(out)
    assert [("math/train/loss" in r, "toy/train/loss" in r) for r in steps] == [(1, 0), (0, 1), (1, 0)]
    toy_step = steps[1]
    assert toy_step["toy/rollout/turns"] == toy_step["rollout/turns"] >= 1
    assert toy_step["toy/rollout/accuracy"] == toy_step["rollout/accuracy"]
    assert toy_step["toy/train/loss"] == pytest.approx(toy_step["train/loss"], rel=1e-5)
    assert "math/train/grad_norm" not in steps[0]  # the step's, not a task's
    for key in ("rollout/format_token_rate", "diag/teacher_tail_mass", "diag/student_tail_mass"):
        assert 0.0 <= toy_step[f"toy/{key}"] <= 1.0 and 0.0 <= steps[0][f"math/{key}"] <= 1.0, key
    (ev,) = [r for r in read_metrics(out) if "eval/accuracy" in r]
    assert ev["eval/math/n"] == 4 and ev["eval/toy/n"] == 3 and ev["eval/toy/k"] == 2
    assert ev["eval/toy/success_rate"] == ev["eval/toy/accuracy"]
    assert ev["eval/accuracy"] == pytest.approx((ev["eval/math/accuracy"] + ev["eval/toy/accuracy"]) / 2)
    per_task = split_by_task(ev, ["math", "toy"])
    assert per_task["toy"]["eval/success_rate"] == ev["eval/toy/success_rate"]
    assert len((out / "tasks" / "math" / "eval.jsonl").read_text().splitlines()) == 4
    games = [json.loads(line) for line in (out / "tasks" / "toy" / "eval.jsonl").read_text().splitlines()]
    assert [g["game"] for g in games] == [f"toy-test-{i}" for i in range(3)]
    assert not (out / "eval.jsonl").exists()
    assert [t["name"] for t in run_options(out)["tasks"]] == ["math", "toy"]
    check_report_splits_by_task(out)


def check_report_splits_by_task(out) -> None:
    """The report of a multi-task run: each chart's series split by task, per-task depth heatmaps."""
    from opd.report import write_report
    from opd.report.charts import build_charts, summary_rows
    from opd.report.load import load_runs

    runs = load_runs([out])
    charts = {c["id"]: c for c in build_charts(runs)}
    loss = charts["loss"]["series"]
    # a task's own series in place of the overall one, which jumps between the tasks' steps
    assert [s["label"] for s in loss] == ["run · math", "run · toy"]
    assert len({s["color"] for s in loss}) == 2
    assert [s["x"] for s in loss] == [[0, 2], [1]]  # each task's own steps
    evals = {s["label"] for s in charts["eval-accuracy"]["series"]}
    assert evals == {f"run · {t} {k}" for t in ("math", "toy") for k in ("greedy", "avg@k")}
    for task in loss:  # a task keeps its colour from chart to chart
        name = task["label"] + " "
        assert {x["color"] for x in charts["eval-accuracy"]["series"] if x["label"].startswith(name)} == {task["color"]}
    assert [s["label"] for s in charts["turns"]["series"]] == ["run · toy"]
    tail = [s["label"] for s in charts["tail-mass"]["series"]]
    assert {"run · math student", "run · toy teacher"} <= set(tail)
    assert {"depth-reward-math-run", "depth-reward-toy-run", "depth-loss-toy-run"} <= set(charts)
    assert "math " in summary_rows(runs)[0]["after"] and "toy " in summary_rows(runs)[0]["after"]
    assert write_report([out], out / "report", show_progress=False).is_file()


def test_per_task_metrics_add_up_to_the_overall_ones_in_mix_mode(tiny_models, teacher2, tmp_path):
    tasks = [{"name": "a", "batch_size": 3}, {"name": "b", "task_level": 3, "teacher": str(teacher2)}]
    cfg = mt_cfg(tiny_models, tmp_path / "run", tasks, task_mode="mix", steps=3, ckpt_every=0, max_new_tokens=12)
    train_mod.train(cfg, show_progress=False)
    for r in step_records(tmp_path / "run"):
        n = {"a": 3, "b": 2}  # rollouts: its own batch_size; round(share 0.5 x batch_size 4)
        tokens = {t: r[f"{t}/train/loss_tokens"] for t in n}
        resp = {t: r[f"{t}/rollout/response_len"] * n[t] for t in n}  # response tokens
        assert r["train/loss_tokens"] == sum(tokens.values()) > 0
        # token_mean over all tasks' loss tokens together
        assert r["train/loss"] == pytest.approx(sum(tokens[t] * r[f"{t}/train/loss"] for t in n) / sum(tokens.values()))
        for key in ("rollout/accuracy", "rollout/eos_rate", "rollout/response_len"):
            assert r[key] == pytest.approx(sum(n[t] * r[f"{t}/{key}"] for t in n) / sum(n.values())), key
        for key in ("diag/reward_mean", "diag/out_of_support", "diag/negative_reward", "diag/teacher_tail_mass"):
            assert r[key] == pytest.approx(sum(resp[t] * r[f"{t}/{key}"] for t in n) / sum(resp.values())), key
        assert "a/train/lr" not in r and r["train/lr"] > 0


@pytest.mark.parametrize("mode,S", [("alternate", 0), ("mix", 0), pytest.param("alternate", 1, marks=pytest.mark.slow)])
def test_resume_equals_uninterrupted_with_two_tasks_and_two_teachers(
    tiny_models, teacher2, tmp_path, monkeypatch, mode, S
):
    """Also with rollouts one step ahead (--max-staleness 1): the worker holds both tasks' sources."""
    tasks = two_math(teacher2)
    kw = dict(task_mode=mode, batch_size=2, eval_every=2, max_staleness=S)
    train_mod.train(mt_cfg(tiny_models, tmp_path / "a", tasks, **kw), show_progress=False)
    killed = mt_cfg(tiny_models, tmp_path / "b", tasks, **kw)
    train_killed_at(killed, 3, monkeypatch)
    train_mod.train(killed.replace(resume=True), show_progress=False)
    compare(read_metrics(tmp_path / "b"), read_metrics(tmp_path / "a"))


@pytest.mark.slow
def test_two_ranks_match_one_process_with_two_tasks_and_two_teachers(tiny_models, teacher2, tmp_path):
    """Mix mode (both tasks at every step, their slots one after the other): 2 ranks of per-task
    batch 2 follow 1 process of per-task batch 4, overall and per task."""
    one_tasks = [{"name": "easy", "task_level": 1, "batch_size": 4}, {"name": "hard", "task_level": 3, "batch_size": 4}]
    one_tasks[1]["teacher"] = str(teacher2)
    train_mod.train(mt_cfg(tiny_models, tmp_path / "one", one_tasks, task_mode="mix"), show_progress=False)
    student, teacher = tiny_models
    two = {**BASE, "student": str(student), "teacher": str(teacher), "out": str(tmp_path / "two"), "task_mode": "mix"}
    two["tasks"] = [{**t, "batch_size": 2} for t in one_tasks]
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(two))
    launch("torchrun", ["train", "--config", str(path)])
    want, got = step_records(tmp_path / "one"), step_records(tmp_path / "two")
    assert len(got) == BASE["steps"]
    compare(got, want, rel=1e-4, abs_=1e-5)
    assert_close_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))


def test_a_task_may_have_a_teacher_with_another_tokenizer(tiny_models, tmp_path):
    """Per-task cross-tokenizer settings: with the default (auto) the odd teacher is wrapped for
    cross-tokenizer scoring, and the same-vocabulary task keeps its plain teacher."""
    from opd.models.loading import tiny_qwen2
    from opd.models.tokenizer import train_tokenizer
    from opd.tasks import ArithmeticTask
    from opd.teachers.crosstok import CrossTokenizerTeacher

    ex = ArithmeticTask(n_train=300, n_test=10, seed=5).examples("train")
    tok = train_tokenizer([e.prompt for e in ex] + [e.solution for e in ex], vocab_size=600)
    other = tmp_path / "other"
    tiny_qwen2(len(tok), 1, 32, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).save_pretrained(other)
    tok.save_pretrained(other)
    odd = {"teacher": str(other)}
    tasks = [
        {"name": "good"},
        {"name": "odd", **odd},
        {"name": "odd2", **odd, "task_level": 3},  # the same teacher, read the same way: shared
        {"name": "joined", **odd, "cross_joinable": "drop"},  # read another way: its own
        {"name": "prefixed", **odd, "cross_unmapped": "prefix", "cross_pairing": "within_group"},
    ]
    run = train_mod.setup(mt_cfg(tiny_models, tmp_path / "run", tasks))
    by_name = {t.name: t.teacher for t in run.tasks}
    assert type(by_name["odd"]) is CrossTokenizerTeacher
    assert type(by_name["good"]) is not CrossTokenizerTeacher
    assert by_name["odd2"] is by_name["odd"]
    assert len({id(by_name[n]) for n in ("odd", "joined", "prefixed")}) == 3
    assert (by_name["joined"].joinable, by_name["odd"].joinable) == ("drop", "keep")
    assert by_name["prefixed"].pairing == "within_group" and by_name["prefixed"].vmap.n_prefix > 0


def test_special_token_masking_is_set_per_task(tiny_models, tiny_tokenizer, tmp_path):
    """Two tasks alike but for --mask-special: the masked one's loss skips exactly the positions
    whose token is special, the other's keeps every position the model wrote."""
    tasks = [{"name": "masked", "mask_special": True}, {"name": "kept", "mask_special": False}]
    cfg = mt_cfg(tiny_models, tmp_path / "run", tasks, objective="lsm", steps=2, ckpt_every=0, eval_every=0)
    # many ordinary tokens made "special", so that both tasks' rollouts hold some: the test is not vacuous
    vocab = load_tokenizer(tiny_tokenizer).convert_ids_to_tokens(list(range(40, 140)))
    cfg = cfg.replace(special_tokens=sorted(set(vocab)))
    train_mod.train(cfg, show_progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    seen = {"masked": 0, "kept": 0}
    for r in records:
        wrote = [i for i, lp in enumerate(r["student_logprobs"]) if lp is not None]
        special = [i for i in wrote if r["tokens"][i] in cfg.objective.special_tokens]
        seen[r["task"]] += len(special)
        want = set(wrote) - set(special) if r["task"] == "masked" else set(wrote)
        assert {i for i, m in enumerate(r["loss_mask"]) if m} == want, r["task"]
    assert seen["masked"] > 0 and seen["kept"] > 0


def test_a_task_may_set_its_own_lr_in_alternate_mode(tiny_models, teacher2, tmp_path):
    """Each step takes its task's lr (times the schedule); the step's gradient is the same, so the
    weights move by the task's share of the update; mix mode refuses a task's lr."""
    tasks = [{"name": "a"}, {"name": "b", "task_level": 3, "teacher": str(teacher2), "lr": 2.5e-3}]
    cfg = mt_cfg(tiny_models, tmp_path / "run", tasks, lr=1e-3, warmup_steps=0, steps=4, ckpt_every=0, eval_every=0)
    train_mod.train(cfg, show_progress=False)
    lrs = {("a" if "a/train/loss" in r else "b"): r["train/lr"] for r in step_records(tmp_path / "run")}
    assert lrs == {"a": pytest.approx(1e-3), "b": pytest.approx(2.5e-3)}
    # the same run with the global lr: the first step (task a's) is identical, the second (b's) is not
    cfg2 = mt_cfg(
        tiny_models, tmp_path / "same", [tasks[0], {**tasks[1], "lr": 1e-3}], lr=1e-3, warmup_steps=0, steps=4
    )
    train_mod.train(cfg2.replace(ckpt_every=0, eval_every=0), show_progress=False)
    got, want = step_records(tmp_path / "run"), step_records(tmp_path / "same")
    assert got[0]["train/loss"] == pytest.approx(want[0]["train/loss"], rel=1e-6)
    assert got[1]["train/loss"] == pytest.approx(want[1]["train/loss"], rel=1e-6)  # b's first loss: before its update
    assert got[2]["train/loss"] != pytest.approx(want[2]["train/loss"], rel=1e-6)  # after b's larger step
    with pytest.raises(ConfigError, match=r"task 'b': its own lr needs --task-mode alternate"):
        resolve_tasks(mt_cfg(tiny_models, tmp_path / "mix", tasks, task_mode="mix"))
