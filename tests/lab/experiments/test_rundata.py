"""Run data: what an experiment's analysis reads of its runs, recorded and replayed
(``opd.lab.experiments.rundata``), and docs/RESULTS.md recomputed from the committed recordings."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from opd.errors import UserError
from opd.lab.experiments import NAMES, run
from opd.lab.experiments.core import (
    DATA,
    DONE,
    RECORDED,
    Analysis,
    Experiment,
    RunSpec,
    Settings,
    derived,
    read_done,
    read_metrics,
    read_run_file,
    run_experiment,
)
from opd.lab.experiments.results_md import build_results_md, recompute
from opd.lab.experiments.rundata import RunData

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "RESULTS.md"


def _runs(tmp_path: Path) -> Settings:
    s = Settings(tmp_path / "exp", seeds=1, quick=False)
    run_dir = s.run_dir("a/seed0")
    run_dir.mkdir(parents=True)
    records = [{"step": t, "loss": 0.1 * t, "diag/x": t * t, "noise": "x" * 50} for t in range(5)]
    records.insert(2, {"step": 1, "eval/accuracy": 0.25})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    (run_dir / DONE).write_text(json.dumps({"wall_s": 3.5, "result": {"accuracy": 0.5, "n": 8, "big": [1] * 100}}))
    (run_dir / "probe.json").write_text(json.dumps({"rows": [{"a": 1, "b": 2}, {"a": 3, "b": 4}]}))
    return s


def _analysis(s: Settings) -> dict:
    """A small analysis touching every kind of read: records' keys, 'in' tests, nested fields, lists."""
    recs = read_metrics(s, "a/seed0")
    done = read_done(s, "a/seed0")
    rows = read_run_file(s, "a/seed0", "probe.json")["rows"]
    windows = derived(s, "w:a/seed0", lambda runs: {0: (1.5, math.nan), 7: [2]})
    return {
        "losses": [r["loss"] for r in recs if "loss" in r],
        "accuracy": [r.get("eval/accuracy") for r in recs],
        "n_records": len(recs),
        "done": (done["result"]["accuracy"], done["result"].get("n"), done["wall_s"]),
        "a": [r["a"] for r in rows],
        "windows": windows,
        "missing": read_metrics(s, "b/seed0"),
    }


def test_recording_keeps_what_was_read_and_replays_to_the_same_values(tmp_path):
    s = _runs(tmp_path)
    first = _analysis(s)
    recorded = s.reads.recording()
    metrics = recorded["files"]["a/seed0/metrics.jsonl"]
    assert len(metrics) == 6  # every record keeps its place: counts and positions hold
    assert metrics[2] == {"eval/accuracy": 0.25} and metrics[0] == {"loss": 0.0}  # "noise" and unread keys dropped
    assert recorded["files"]["a/seed0/DONE.json"] == {"wall_s": 3.5, "result": {"accuracy": 0.5, "n": 8}}
    assert recorded["files"]["a/seed0/probe.json"] == {"rows": [{"a": 1}, {"a": 3}]}
    assert recorded["files"]["b/seed0/metrics.jsonl"] is None  # a missing file is recorded as missing
    s.reads.write(tmp_path / DATA)
    shutil.rmtree(s.runs)  # the replay must not touch the runs
    again = _analysis(Settings(tmp_path / "exp", seeds=1, quick=False, reads=RunData.load(tmp_path / DATA)))
    assert json.dumps(again) == json.dumps(first)  # NaN, int keys and tuples round-trip
    assert again["windows"] == {0: (1.5, again["windows"][0][1]), 7: [2]} and math.isnan(again["windows"][0][1])


def test_a_replay_that_reads_more_than_was_recorded_says_so(tmp_path):
    s = _runs(tmp_path)
    read_metrics(s, "a/seed0")
    s.reads.write(tmp_path / DATA)
    replay = Settings(tmp_path / "exp", seeds=1, quick=False, reads=RunData.load(tmp_path / DATA))
    with pytest.raises(UserError, match=r"no a/seed0/DONE.json: the analysis now reads more .* rerun the experiment"):
        read_done(replay, "a/seed0")
    with pytest.raises(UserError, match="no derived value 'w'"):
        derived(replay, "w", lambda runs: 1)
    with pytest.raises(UserError, match="not run data written by `opd experiment`"):
        (tmp_path / "bad.json").write_text("{cut")
        RunData.load(tmp_path / "bad.json")
    with pytest.raises(UserError, match="has not finished"):
        read_done(_runs(tmp_path / "other"), "c/seed0")


@pytest.mark.slow
def test_variance_quick_is_recomputed_from_its_run_data(tmp_path):
    res = run("variance", tmp_path, seeds=2, quick=True, show_progress=False)
    data = tmp_path / "variance" / DATA
    assert data.is_file()
    again = recompute("variance", res, data)
    for key in ("tables", "claims", "notes", "plots"):
        assert again[key] == res[key], key
    doc = build_results_md([tmp_path], tmp_path / "docs" / "RESULTS.md", log=lambda line: None)
    assert (tmp_path / "docs/results/variance" / DATA).is_file()  # kept beside the document
    # The document's numbers come from the data, not from results.json: changed data, changed tables.
    recorded = json.loads(data.read_text())
    for records in recorded["files"].values():
        for r in records if isinstance(records, list) else []:
            if isinstance(r, dict) and "kl" in r:
                r["kl"] *= 10
    (tmp_path / "docs/results/variance" / DATA).write_text(json.dumps(recorded))
    before = doc.read_text()
    after = build_results_md([], doc, log=lambda line: None).read_text()
    assert after != before and "## variance" in after


def test_results_md_sections_with_run_data_are_what_opd_results_makes_of_it(tmp_path):
    """The committed docs/RESULTS.md is what `opd results` makes from the committed results and run data."""
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "results")
    shutil.copy(DOC, tmp_path / "RESULTS.md")
    assert build_results_md([], tmp_path / "RESULTS.md", log=lambda line: None).read_text() == DOC.read_text()


def test_results_md_is_remade_from_the_committed_data_alone(tmp_path):
    """Deleting docs/RESULTS.md and running `opd results` makes it again, from docs/results/ alone."""
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "results")
    made = build_results_md([], tmp_path / "RESULTS.md", log=lambda line: None).read_text()
    assert made == DOC.read_text()


def test_every_experiment_s_intervals_are_recomputed_from_its_per_seed_data():
    """Every experiment commits its run data (docs/results/NAME/data.json), so every table and verdict
    in RESULTS.md is recomputed from per-seed values, not copied from a results.json."""
    unrecorded = [n for n in NAMES if not (ROOT / "docs" / "results" / n / DATA).is_file()]
    assert unrecorded == [], f"no committed run data for {', '.join(unrecorded)}: run the experiment and `opd results`"


# ----------------------------------------------------------------------------- --recorded


def _made(params, run_dir):
    """A python step that logs that it ran, writes a file, and returns a value a seed sets."""
    with open(run_dir.parents[params["depth"]] / "calls.txt", "a") as f:
        f.write(run_dir.name + "\n")
    (run_dir / "out.txt").write_text(str(params["value"]))
    return {"value": params["value"]}


def _toy_experiment(tmp_path: Path, first_reads_seed0: bool = False) -> Experiment:
    """A plan: a data step; per seed a run reading it; optionally a run reading seed 0's output."""

    def plan(s: Settings) -> list[RunSpec]:
        specs = [RunSpec("data", "python", {"value": 0, "depth": 0}, _made)]
        for k in range(s.seeds):
            src = str(s.run_dir("data") / "out.txt")
            specs.append(RunSpec(f"x/seed{k}", "python", {"value": 10 * k + 1, "depth": 1, "src": src}, _made))
        if first_reads_seed0:
            src = str(s.run_dir("x/seed0") / "out.txt")
            specs.append(RunSpec("after0", "python", {"value": 5, "depth": 0, "src": src}, _made))
        return specs

    def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
        a = Analysis()
        values = [read_done(s, f"x/seed{k}")["result"]["value"] for k in range(s.seeds)]
        shares = [
            derived(s, f"share:x/seed{k}", lambda runs, k=k: (runs / f"x/seed{k}/out.txt").read_text())
            for k in range(s.seeds)
        ]
        a.table("values", ["seed", "value", "derived"], [[k, v, d] for k, (v, d) in enumerate(zip(values, shares))])
        return a

    return Experiment("toy", "a toy", "", plan, analyze)


def _calls(out: Path) -> list[str]:
    calls = out / "toy" / "runs" / "calls.txt"
    return calls.read_text().split() if calls.is_file() else []


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_recorded_runs_are_read_from_the_recording_and_new_seeds_are_made(tmp_path, capsys, workers):
    """`opd experiment --recorded`: seeds added to committed run data, without the runs' folders."""
    exp = _toy_experiment(tmp_path)
    first = run_experiment(exp, tmp_path / "a", seeds=2, quick=False, show_progress=False, workers=workers)
    assert _calls(tmp_path / "a") == ["data", "seed0", "seed1"]
    recording = tmp_path / "a" / "toy" / DATA
    out = tmp_path / "b"  # another machine: no run folders at all
    more = run_experiment(exp, out, 3, False, False, workers, recorded=recording)
    # seed 2 reads the data step's output, so that is made; the recorded seeds are not
    assert sorted(_calls(out)) == ["data", "seed2"]
    assert "2 of 4 runs read from" in capsys.readouterr().out
    status = {r["run"]: r["status"] for r in more["run_log"]}
    assert status == {"data": "ran", "x/seed0": RECORDED, "x/seed1": RECORDED, "x/seed2": "ran"}
    assert more["tables"][0]["rows"][:2] == first["tables"][0]["rows"]  # the recorded seeds' values
    assert more["tables"][0]["rows"][2] == ["2", "21", "21"]
    assert more["command"].endswith(f"--recorded {recording}")
    # the new recording holds every seed, so it replays alone to the same tables
    replay = Settings(tmp_path / "replay" / "toy", 3, False, reads=RunData.load(out / "toy" / DATA))
    assert exp.analyze(replay, exp.plan(replay)).tables == more["tables"]


def test_a_recorded_run_another_run_reads_is_made_again(tmp_path):
    """A run that is made reads its inputs from their folders: a recorded run it reads is made too."""
    run_experiment(_toy_experiment(tmp_path), tmp_path / "a", seeds=2, quick=False, show_progress=False)
    exp = _toy_experiment(tmp_path, first_reads_seed0=True)
    res = run_experiment(exp, tmp_path / "b", 2, False, False, recorded=tmp_path / "a" / "toy" / DATA)
    assert sorted(_calls(tmp_path / "b")) == ["after0", "data", "seed0"]
    assert {r["run"]: r["status"] for r in res["run_log"]}["x/seed1"] == RECORDED
    with pytest.raises(UserError, match="is not run data written by `opd experiment`"):
        (tmp_path / "bad.json").write_text("[]")
        run_experiment(exp, tmp_path / "c", 2, False, False, recorded=tmp_path / "bad.json")


def test_mixed_reads_take_kept_runs_from_the_recording_and_others_from_their_folders(tmp_path):
    s = _runs(tmp_path)
    recorded = {
        "files": {"k/seed0/DONE.json": {"wall_s": 1.0}, "k/seed0/metrics.jsonl": [{"loss": 9.0}]},
        "derived": {"w:k/seed0": 3, "w:a/seed0": 4, "global": 5},
    }
    s.reads = RunData(s.runs, recorded, kept=["k/seed0"])
    assert read_metrics(s, "k/seed0") == [{"loss": 9.0}] and read_done(s, "k/seed0") == {"wall_s": 1.0}
    assert read_done(s, "a/seed0")["wall_s"] == 3.5  # not kept: from its folder
    assert derived(s, "w:k/seed0", lambda runs: 0) == 3  # a kept run's derived value: recorded
    assert derived(s, "w:a/seed0", lambda runs: 7) == 7 and derived(s, "global", lambda runs: 8) == 8  # computed
    with pytest.raises(UserError, match="no k/seed0/probe.json"):
        read_run_file(s, "k/seed0", "probe.json")
    with pytest.raises(UserError, match="no derived value 'v:k/seed0'"):
        derived(s, "v:k/seed0", lambda runs: 0)
    assert set(s.reads.recording()["files"]) == {"k/seed0/metrics.jsonl", "k/seed0/DONE.json", "a/seed0/DONE.json"}
