"""The run report of an agentic run (``opd train --env``): whole episodes in the rollout records,
the environment's tokens marked apart in the inspector's data, success-rate charts.

The run is real: 3 steps of the toy game with the tiny random models, every rollout logged, so
the records can be checked against the step's own counts. ``make_agentic_run`` (tests/report_runs.py)
makes it, for test_report_browser.py too.
"""

from __future__ import annotations

import json

import pytest
from helpers import read_metrics, step_records
from report_runs import BATCH, MAX_TURNS, make_agentic_run

from opd.report import write_report
from opd.report.charts import build_charts, rate_word
from opd.report.inspector import inspector_data
from opd.report.load import RunData, load_run
from opd.runs.records import MODEL_FIELDS


@pytest.fixture(scope="module")
def agent(tiny_models, tmp_path_factory):
    return make_agentic_run(tiny_models, tmp_path_factory.mktemp("report_agentic"))


def rollouts(run_dir):
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def test_records_hold_whole_episodes_with_the_environment_flagged(agent):
    records = rollouts(agent)
    assert len(records) == 3 * BATCH
    replies = 0
    for rec in records:
        n, action = len(rec["tokens"]), rec["action"]
        assert len(action) == len(rec["token_ids"]) == len(rec["loss_mask"]) == n
        for key in MODEL_FIELDS:  # model fields only at the model's tokens
            assert len(rec[key]) == n and all((v is None) == (not a) for v, a in zip(rec[key], action)), key
        assert not any(m for m, a in zip(rec["loss_mask"], action) if not a)
        # the turns' spans are exactly the action tokens; what lies between them is the environment's
        spans = [(t["start"], t["end"]) for t in rec["turns"]]
        assert [i for s, e in spans for i in range(s, e)] == [i for i, a in enumerate(action) if a]
        assert 1 <= len(rec["turns"]) <= MAX_TURNS and rec["response"] == " | ".join(t["action"] for t in rec["turns"])
        assert rec["won"] == rec["correct"] and rec["end"] in ("won", "lost", "max_turns", "budget")
        env_text = "".join(t for t, a in zip(rec["tokens"], action) if not a).replace("Ġ", " ")
        for turn in rec["turns"][:-1]:  # every turn but the last is answered by an observation, shown as context
            assert turn["observation"] and turn["observation"].split()[0] in env_text
            replies += 1
        assert all(isinstance(t["reward"], float) for t in rec["turns"])
    assert replies > 0  # the run must have had multi-turn episodes for this test to mean anything


def test_flagged_tokens_match_the_steps_counts(agent):
    records = rollouts(agent)
    for step in step_records(agent):
        mine = [r for r in records if r["step"] == step["step"]]
        actions = sum(sum(r["action"]) for r in mine)
        masked = sum(1 for r in mine for a, m in zip(r["action"], r["loss_mask"]) if a and not m)
        # every rollout of the step is logged: the flagged action tokens are the loss tokens plus the
        # special tokens the loss leaves out (the end-of-turn tokens)
        assert step["train/loss_tokens"] == actions - masked
        assert masked == sum(1 for r in mine for a, t in zip(r["action"], r["tokens"]) if a and t == "<|im_end|>")
        assert step["rollout/response_len"] == pytest.approx(actions / BATCH)
        assert step["rollout/turns"] == pytest.approx(sum(len(r["turns"]) for r in mine) / BATCH)


def test_inspector_data_marks_the_environment_and_the_turns(agent):
    run = load_run(agent)
    # (an eval with no game won logs its mean turns to success as NaN, which the notes mention)
    assert not [note for note in run.skipped if "rollouts" in note] and len(run.rollouts) == 3 * BATCH
    data = inspector_data(run, max_steps=3)
    raw = [r for r in rollouts(agent) if r["step"] == 2]
    for packed, rec in zip(data["rollouts"]["2"], raw, strict=True):
        assert packed["env"] == [1 - a for a in rec["action"]] and packed["ids"] == rec["token_ids"]
        for i, is_env in enumerate(packed["env"]):
            unscored = [packed[k][i] for k in ("s", "t", "loss", "topk", "tp", "sp")]
            assert all(v is None for v in unscored) if is_env else None not in unscored
        assert [(t["start"], t["end"], t["reward"]) for t in packed["turns"]] == [
            (t["start"], t["end"], t["reward"]) for t in rec["turns"]
        ]
        assert packed["outcome"] == {"won": rec["won"], "end": rec["end"], "turns": len(rec["turns"])}


def test_agentic_charts_say_success_rate(agent, tmp_path):
    charts = {c["id"]: c for c in build_charts([load_run(agent)])}
    steps = step_records(agent)
    evals = [r for r in read_metrics(agent) if "eval/success_rate" in r]
    ev = charts["eval-accuracy"]
    assert ev["title"] == "Eval success rate" and ev["ylabel"] == "success rate"
    greedy = next(s for s in ev["series"] if not s["dashed"])
    assert greedy["y"] == [r["eval/success_rate"] for r in evals] and greedy["x"] == [1, 2]
    train_rate = charts["rollout-accuracy"]
    assert train_rate["title"] == "Training success rate (rollouts)" and train_rate["ylabel"] == "success rate"
    assert train_rate["series"][0]["y"] == [r["rollout/accuracy"] for r in steps]
    assert charts["turns"]["series"][0]["y"] == [r["rollout/turns"] for r in steps]
    assert charts["invalid-actions"]["series"][0]["y"] == [r["rollout/invalid_action_rate"] for r in steps]
    # the scatter of sampled tokens holds the model's tokens only, never the environment's
    assert charts["scatter-agent"]["tokens"] == sum(sum(r["action"]) for r in rollouts(agent))
    write_report([agent], tmp_path / "rep", show_progress=False)
    for cid in ("eval-accuracy", "rollout-accuracy", "turns", "invalid-actions"):
        assert (tmp_path / "rep" / "charts" / f"{cid}.png").read_bytes()[:4] == b"\x89PNG"


def test_rate_word_follows_the_runs_kinds(tmp_path):
    agentic, single = RunData(tmp_path, "a", config={"env": "toy"}), RunData(tmp_path, "s", config={"env": ""})
    assert rate_word([agentic]) == "success rate" and rate_word([single]) == "accuracy"
    assert rate_word([single, RunData(tmp_path, "old")]) == "accuracy"  # configs written before --env
    assert rate_word([agentic, single]) == "accuracy / success rate"
