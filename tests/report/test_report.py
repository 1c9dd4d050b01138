"""The run report without a browser: loading run directories, what each chart is fed, the page, the CLI.

The runs are real: two 3-step trainings (sampled-token OPD and LSM) of the tiny random models,
laid out like the demo's (``demo/{sampled,lsm}`` with ``demo/summary.json``), plus copies damaged
by hand for the robustness tests. ``make_report_runs`` (tests/report_runs.py) makes them, for
test_report_browser.py too.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import matplotlib.pyplot as plt
import pytest
from report_runs import LOG_ROLLOUTS, STEPS, K, make_report_runs
from typer.testing import CliRunner

from opd.cli import app
from opd.errors import UserError
from opd.report import png, write_report
from opd.report.charts import build_charts, ema, summary_rows
from opd.report.inspector import PROB_SCALE, display_token, inspector_data, pick_steps
from opd.report.load import RunData, load_run, load_runs


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    return make_report_runs(tiny_models, tmp_path_factory.mktemp("report"))


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- loading


def test_load_finished_run_reads_everything(runs):
    sampled, lsm = runs
    run = load_run(lsm)
    steps = [r for r in jsonl(lsm / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in run.steps] == [0, 1, 2]
    assert [r["train/loss"] for r in run.steps] == [r["train/loss"] for r in steps]
    assert [r["step"] for r in run.evals] == [1, 2]
    assert len(run.rollouts) == STEPS * LOG_ROLLOUTS
    assert run.skipped == [] and not run.in_progress
    assert run.config["objective"] == "lsm"
    # teacher and starting student from the parent's summary.json; this run has no entry of its own there
    assert run.summary["teacher_acc"] == 0.9 and "final_acc" not in run.summary
    assert load_run(sampled).summary["wall_s"] == 12.0
    # every top-K id of every logged position has a label (rollout_records logs them as topk_tokens)
    ids = {i for r in run.rollouts for row in r["teacher_topk_ids"] for i in row}
    assert ids <= run.vocab.keys()


def test_load_in_progress_and_malformed_run(runs, tmp_path):
    run_dir = tmp_path / "broken"
    shutil.copytree(runs[1], run_dir)
    shutil.rmtree(run_dir / "final")  # as if the run were still going
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(
            '[1, 2]\n{"step": "x", "train/loss": 1}\n{"step": 3, "train/loss": NaN, "train/grad_norm": 2.0}\n'
            '{"step": 4, "train/lo'
        )  # the last line cut off by a kill
    lines = (run_dir / "rollouts.jsonl").read_text().splitlines()
    bad = json.loads(lines[0])
    bad["teacher_logprobs"] = bad["teacher_logprobs"][:-1]
    (run_dir / "rollouts.jsonl").write_text("\n".join([json.dumps(bad)] + lines[1:] + ['{"step": 9, "tok']) + "\n")
    run = load_run(run_dir)
    assert [r["step"] for r in run.steps] == [0, 1, 2, 3]
    assert "train/loss" not in run.steps[3] and run.steps[3]["train/grad_norm"] == 2.0
    assert len(run.rollouts) == STEPS * LOG_ROLLOUTS - 1
    notes = "\n".join(run.skipped)
    assert "metrics.jsonl: 3 malformed line(s) skipped (line" in notes
    assert "non-numeric or NaN values skipped for train/loss" in notes
    assert "rollouts.jsonl: 1 malformed line(s)" in notes and "1 record(s) with missing or mismatched" in notes
    assert "run in progress or stopped early" in notes and "no final model yet" in notes
    assert run.in_progress


def test_load_missing_files_and_bad_dirs(runs, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(runs[0] / "metrics.jsonl", bare / "metrics.jsonl")
    run = load_run(bare)
    assert run.config == {} and len(run.steps) == STEPS and run.rollouts == [] and run.summary == {}
    assert any("config.json is missing" in s for s in run.skipped)
    assert any("rollouts.jsonl is missing" in s for s in run.skipped)
    (bare / "config.json").write_text("{not json")
    assert any("config.json is not valid JSON" in s for s in load_run(bare).skipped)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is not a run directory .* pass a directory written by `opd train`"):
        load_run(tmp_path / "empty")
    demo_hint = re.escape(f"it holds run directories: pass them, e.g. `opd report {runs[1]} {runs[0]}`")
    with pytest.raises(UserError, match=demo_hint):
        load_run(runs[0].parent)
    with pytest.raises(UserError, match="is not a directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(UserError, match="no run directory given"):
        load_runs([])


def test_same_named_runs_get_distinct_names(runs, tmp_path):
    other = tmp_path / "other" / "lsm"
    shutil.copytree(runs[1], other, ignore=shutil.ignore_patterns("final"))
    assert [r.name for r in load_runs([runs[1], other])] == ["demo/lsm", "other/lsm"]


# ----------------------------------------------------------------------------- what each chart is fed


def by_id(charts):
    return {c["id"]: c for c in charts}


def test_line_charts_are_fed_the_logged_metrics(runs):
    loaded = load_runs(list(runs))
    charts = by_id(build_charts(loaded))
    for key, cid in (
        ("train/loss", "loss"),
        ("train/kl_to_teacher", "kl"),
        ("diag/overlap", "overlap"),
        ("diag/negative_reward", "negative-reward"),
        ("rollout/eos_rate", "eos-rate"),
    ):
        series = charts[cid]["series"]
        assert [s["run"] for s in series] == ["sampled", "lsm"]
        for s, run_dir in zip(series, runs):
            logged = [r for r in jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
            assert s["x"] == [r["step"] for r in logged] and s["y"] == [r[key] for r in logged]
            assert "smooth" not in s  # three points: no moving average drawn over them
    mass = charts["tail-mass"]["series"]
    assert [(s["label"], s["dashed"]) for s in mass] == [
        ("sampled student", False),
        ("sampled teacher", True),
        ("lsm student", False),
        ("lsm teacher", True),
    ]
    grad = charts["grad-norm"]
    for s, run in zip(grad["series"], loaded):
        assert s["marks"] == [r["step"] for r in run.steps if r["train/clipped"]]
    assert grad["hlines"] == [{"y": 1.0, "label": "clip at 1"}]


def test_eval_chart_and_summary_rows(runs):
    loaded = load_runs(list(runs))
    ev = by_id(build_charts(loaded))["eval-accuracy"]
    assert {(s["label"], tuple(s["x"])) for s in ev["series"]} == {
        ("sampled greedy", (1, 2)),
        ("sampled avg@k", (1, 2)),
        ("lsm greedy", (1, 2)),
        ("lsm avg@k", (1, 2)),
    }
    assert ev["hlines"] == [{"y": 0.9, "label": "teacher"}, {"y": 0.1, "label": "student before"}]
    rows = summary_rows(loaded)
    for row, run in zip(rows, loaded):
        after = run.evals[-1]["eval/accuracy"]
        assert row["after"] == f"{100 * after:.1f}% (step 2)"
        assert row["gap_recovery"] == f"{100 * (after - 0.1) / (0.9 - 0.1):.0f}%"
        assert row["teacher"] == "90.0%" and row["before"] == "10.0%" and row["steps"] == "3 / 3"
    assert rows[0]["wall"] == "12s" and rows[0]["objective"] == "sampled" and "K=8 teacher_topk" in rows[1]["settings"]


def _evaluated(tmp_path, evals_by_run: dict) -> list[RunData]:
    return [
        RunData(tmp_path / name, name, evals=evals, summary={"teacher_acc": 0.94, "student_init_acc": 0.3})
        for name, evals in evals_by_run.items()
    ]


def test_runs_evaluated_once_show_their_values_as_bars_not_a_point_on_a_step_axis(tmp_path):
    once = lambda acc, avg: [{"step": 400, "eval/accuracy": acc, "eval/avg_at_k": avg}]  # noqa: E731
    runs = _evaluated(tmp_path, {"sampled": once(0.46, 0.44), "lsm": once(0.62, 0.55)})
    ev = by_id(build_charts(runs))["eval-accuracy"]
    assert ev["kind"] == "bar" and ev["xlabel"] == "evaluated once, at step 400"
    assert [(b["label"], b["value"], b["dashed"], b["step"]) for b in ev["bars"]] == [
        ("sampled greedy", 0.46, False, 400),
        ("sampled avg@k", 0.44, True, 400),
        ("lsm greedy", 0.62, False, 400),
        ("lsm avg@k", 0.55, True, 400),
    ]
    assert ev["hlines"] == [{"y": 0.94, "label": "teacher"}, {"y": 0.3, "label": "student before"}]
    fig, ax = plt.subplots()
    png._bars(ax, ev)
    assert [t.get_text() for t in ax.get_xticklabels()] == [b["label"] for b in ev["bars"]]
    assert sorted(t.get_text() for t in ax.texts if t.get_text()[0].isdigit()) == ["0.44", "0.46", "0.55", "0.62"]
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1
    plt.close(fig)
    assert png.draw(ev, tmp_path / "ev.png").read_bytes()[:4] == b"\x89PNG"
    # a run evaluated twice keeps the line over steps (the other's one point on it)
    runs[1].evals.insert(0, {"step": 200, "eval/accuracy": 0.5, "eval/avg_at_k": 0.48})
    assert by_id(build_charts(runs))["eval-accuracy"]["kind"] == "line"


def test_a_share_that_stays_0_says_none_on_a_0_to_1_axis(tmp_path):
    steps = [
        {"step": i, "train/loss": 1.0 - i / 10, "rollout/repetition_rate": 0.0, "rollout/eos_rate": 0.5 + i / 10}
        for i in range(3)
    ]
    charts = by_id(build_charts([RunData(tmp_path, "run", steps=steps)]))
    rep, eos, loss = charts["repetition"], charts["eos-rate"], charts["loss"]
    assert (rep["ymin"], rep["ymax"], rep["none"]) == (0.0, 1.0, "none: 0 at every logged step")
    assert eos["ymin"] == 0.0 and "ymax" not in eos and "none" not in eos  # a share that moved: from 0, to its data
    assert not {"ymin", "ymax", "none"} & loss.keys()  # not a share: its axis follows its data
    fig, ax = plt.subplots()
    png._line(ax, rep)
    assert ax.get_ylim() == (0.0, 1.0) and rep["none"] in [t.get_text() for t in ax.texts]
    plt.close(fig)


def test_heatmaps_and_scatter_are_fed_depth_and_sampled_tokens(runs):
    loaded = load_runs(list(runs))
    charts = by_id(build_charts(loaded))
    for run, run_dir in zip(loaded, runs):
        logged = [r for r in jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
        heat = charts[f"depth-reward-{run.name}"]
        assert heat["x"] == [0, 1, 2] and heat["z"] == [r["depth/reward"] for r in logged] and heat["buckets"] == 8
        assert heat["bound"] > 0 and charts[f"depth-loss-{run.name}"]["sign"] == -1
        sc = charts[f"scatter-{run.name}"]
        tokens = [
            (s, t)
            for r in jsonl(run_dir / "rollouts.jsonl")
            for s, t in zip(r["student_logprobs"], r["teacher_logprobs"])
        ]
        assert sc["tokens"] == len(tokens) == len(sc["positive"]) + len(sc["negative"])
        probs = lambda keep, tokens=tokens: sorted(
            [round(math.exp(s), 4), round(math.exp(t), 4)] for s, t in tokens if keep(s, t)
        )
        assert sorted(sc["positive"]) == probs(lambda s, t: t > s) and sorted(sc["negative"]) == probs(
            lambda s, t: t <= s
        )


def test_ema_and_step_picking():
    assert ema([3.0] * 5, 0.9) == pytest.approx([3.0] * 5)
    assert ema([1.0, 0.0], 0.5)[0] == 1.0 and ema([1.0, 0.0], 0.5)[1] == pytest.approx(1 / 3)
    picked = pick_steps(list(range(200)), 24)
    assert len(picked) == 24 and picked[0] == 0 and picked[-1] == 199 and picked == sorted(set(picked))
    assert pick_steps([5, 3, 3], 10) == [3, 5] and pick_steps([1, 2, 3], 1) == [3]


def test_display_token():
    assert display_token("Ġanswer") == " answer" and display_token("Ċ") == "\n" and display_token("▁the") == " the"
    assert display_token("<|im_end|>") == "<|im_end|>" and display_token("ä½ł") == "你"


def test_inspector_packs_rollouts(runs):
    run = load_run(runs[1])
    data = inspector_data(run, max_steps=2)
    assert data["steps"] == [0, 2] and data["logged_steps"] == 3 and data["k"] == K
    raw = [r for r in jsonl(runs[1] / "rollouts.jsonl") if r["step"] == 2]
    packed = data["rollouts"]["2"]
    assert len(packed) == LOG_ROLLOUTS
    for p, r in zip(packed, raw):
        assert p["ids"] == r["token_ids"] and p["topk"] == r["teacher_topk_ids"]
        assert p["mask"] == [int(m) for m in r["loss_mask"]]
        assert p["tp"][0] == [round(math.exp(x) * PROB_SCALE) for x in r["teacher_topk_logprobs"][0]]
        assert p["sp"][-1] == [round(math.exp(x) * PROB_SCALE) for x in r["student_topk_logprobs"][-1]]
        assert all(data["vocab"][str(i)] == display_token(r["topk_tokens"][str(i)]) for row in p["topk"] for i in row)


# ----------------------------------------------------------------------------- the page and the CLI


def page_data(html_text):
    blob = re.search(r'<script type="application/json" id="opd-data">(.*?)</script>', html_text, re.S).group(1)
    return json.loads(blob)


def test_write_report_is_self_contained_with_pngs(runs, tmp_path):
    path = write_report(list(runs), tmp_path / "rep", show_progress=False)
    text = path.read_text()
    # nothing to fetch: no external scripts, styles, images or fonts; the only URL is SVG's namespace name
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", text)
    assert set(re.findall(r"https?://[^\s\"'`)]+", text)) == {"http://www.w3.org/2000/svg"}
    data = page_data(text)
    assert [r["name"] for r in data["runs"]] == ["sampled", "lsm"]
    ids = [c["id"] for c in data["charts"]]
    assert len(ids) == len(set(ids)) == 15 + 2 * 2 + 2  # line charts, two heatmaps and a scatter per run
    for cid in ids:
        png = tmp_path / "rep" / "charts" / f"{cid}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_report_of_damaged_run_says_what_was_skipped(runs, tmp_path):
    run_dir = tmp_path / "live"
    shutil.copytree(runs[0], run_dir, ignore=shutil.ignore_patterns("final", "rollouts.jsonl"))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/lo')
    text = write_report([run_dir], tmp_path / "rep", show_progress=False).read_text()
    assert "Left out of this report" in text and "rollouts.jsonl is missing" in text and "1 malformed line(s)" in text
    data = page_data(text)
    assert data["runs"][0]["inspector"]["steps"] == [] and "scatter-live" not in [c["id"] for c in data["charts"]]


def test_cli_report(runs, tmp_path):
    result = CliRunner().invoke(
        app, ["report", *map(str, runs), "--out", str(tmp_path / "r"), "--inspector-steps", "2"]
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert f"report: {tmp_path / 'r' / 'report.html'}" in result.output.replace("\n", "")
    assert page_data((tmp_path / "r" / "report.html").read_text())["runs"][1]["inspector"]["steps"] == [0, 2]
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert isinstance(bad.exception, UserError) and "is not a directory" in str(bad.exception)
    bad = CliRunner().invoke(app, ["report", str(runs[0]), "--inspector-steps", "0"])
    assert isinstance(bad.exception, UserError) and "--inspector-steps 1 or more" in str(bad.exception)
