"""Checkpoints kept by rule: the N newest (--keep-checkpoints), the best by an evaluation figure
(--keep-best, max or min), refused at start when the run never evaluates it; the best one's path in
summary.json, final/ from it on request, and a resumed run going on from the newest."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cfg_for, read_metrics

from opd.config import ConfigError, TrainConfig
from opd.runs.rundir import RunDir
from opd.training import loop as train_mod


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def save_pretrained(self, path, safe_serialization=True, state_dict=None):
        path.mkdir(parents=True)
        (path / "w.txt").write_text("x")


def test_pruning_keeps_the_newest_and_the_best_by_the_rule(tmp_path):
    rd = RunDir(tmp_path / "run", enabled=True)
    scores = {0: 0.2, 1: 0.9, 2: 0.5, 3: 0.9, 4: 0.1, 5: None}  # step 3 ties step 1: the earlier stays best
    for step, score in scores.items():
        rd.save_checkpoint(step, _Model(), {"step": step}, keep=2, score=score, best=("eval/accuracy", "max"))
    names = sorted(p.name for p in rd.ckpt_root.glob("step_*"))
    assert names == ["step_0000001", "step_0000004", "step_0000005"]
    assert (rd.ckpt_root / "best").read_text() == "step_0000001"
    assert rd.best_checkpoint()["value"] == 0.9 and rd.best_checkpoint()["step"] == 1
    assert rd.latest_checkpoint().name == "step_0000005"  # resume reads the newest, not the best
    low = RunDir(tmp_path / "low", enabled=True)
    for step, score in scores.items():
        low.save_checkpoint(step, _Model(), {"step": step}, keep=1, score=score, best=("eval/loss", "min"))
    assert sorted(p.name for p in low.ckpt_root.glob("step_*")) == ["step_0000004", "step_0000005"]
    plain = RunDir(tmp_path / "plain", enabled=True)
    for step in range(5):
        plain.save_checkpoint(step, _Model(), {"step": step}, keep=3)
    assert sorted(p.name for p in plain.ckpt_root.glob("step_*")) == [f"step_000000{i}" for i in (2, 3, 4)]
    assert plain.best_checkpoint() is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(keep_best="eval/accuracy", eval=False), "with evaluation off"),
        (
            dict(keep_best="eval/pass_at_k", eval_samples=0),
            r"never evaluates eval/pass_at_k; it logs eval/accuracy, eval/response_tokens_max, eval/response_tokens_mean, eval/truncation_rate$",
        ),
        (dict(keep_best="eval/success_rate"), "never evaluates eval/success_rate"),
        (dict(keep_best="accuracy:best"), r"end it in :max or :min"),
        (dict(final_best=True), "final_best needs --keep-best"),
        (dict(keep_checkpoints=0), "keep_checkpoints=0 must be >= 1"),
    ],
)
def test_a_rule_the_run_cannot_meet_is_refused_at_start(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_flat(student="s", teacher="t", **options)


def test_rules_accept_the_figures_the_run_logs():
    assert TrainConfig.from_flat(student="s", teacher="t", keep_best="pass_at_k:max", eval_samples=2).run.keep_best
    tasks = [{"name": "a", "task": "arithmetic"}, {"name": "b", "task": "arithmetic"}]
    assert TrainConfig.from_flat(student="s", teacher="t", tasks=tasks, keep_best="eval/b/accuracy:min").run.keep_best
    with pytest.raises(ConfigError, match="never evaluates eval/c/accuracy"):
        TrainConfig.from_flat(student="s", teacher="t", tasks=tasks, keep_best="eval/c/accuracy")


def test_the_evaluations_own_figures_are_the_ones_rules_may_name():
    """The rule's list of figures and what the evaluation returns must not drift apart."""
    from opd.config.options import evaluated_figures
    from opd.evaluation.core import EvalPlan, Rollout, evaluate

    class Items:  # three prompts with answers; every rollout correct when its seed is even
        answers = True

        def __len__(self):
            return 3

        def tokens_per_rollout(self):
            return 4

        def run(self, engine, items, seeds, sampling):
            return [Rollout(s % 2 == 0, 3, False, {"prompt": "p", "response": "r"}, str(s % 3)) for s in seeds]

        def figures(self, headline):
            return {}

    settings = {"n", "k", "maj_k", "sampling"}  # what the evaluation was, not how well it went
    for samples, maj_k in ((0, 0), (2, 0), (2, 2)):
        got = evaluate(None, Items(), EvalPlan(samples=samples, maj_k=maj_k)).figures
        cfg = TrainConfig.from_flat(student="s", teacher="t", eval_samples=samples, maj_k=maj_k)
        assert {f"eval/{k}" for k in got} - {f"eval/{k}" for k in settings} == evaluated_figures(cfg)


def test_a_run_keeps_its_best_checkpoint_names_it_and_writes_final_from_it(tiny_models, tmp_path):
    cfg = cfg_for(
        tiny_models,
        tmp_path,
        steps=4,
        eval_every=1,
        ckpt_every=0,
        keep_checkpoints=1,
        eval_samples=0,
        keep_best="eval/accuracy:min",
        final_best=True,
        lr=0.05,
    )
    train_mod.train(cfg, show_progress=False)
    run = tmp_path / "run"
    evals = [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]
    scores = [r["eval/accuracy"] for r in evals]
    best_step = scores.index(min(scores))  # the earliest of the lowest
    summary = json.loads((run / "summary.json").read_text())
    best = summary["best_checkpoint"]
    assert (best["step"], best["value"], best["metric"]) == (best_step, min(scores), "eval/accuracy")
    kept = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{best_step:07d}", "step_0000003"})
    from safetensors.torch import load_file

    final, chosen = load_file(run / "final" / "model.safetensors"), load_file(f"{best['model']}/model.safetensors")
    assert all(torch.equal(final[k], chosen[k]) for k in chosen) and summary["final"] == "best checkpoint"
    card = (run / "final" / "README.md").read_text()  # the figures of the weights it holds: the best step's
    assert f"The evaluation at step {best_step} (of the weights in this folder):" in card
    assert f"| eval/accuracy | {min(scores):.4g} |" in card
