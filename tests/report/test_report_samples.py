"""The report's view of evaluation records (opd.report.samples): flips between two evaluations, the last
evaluation of each run, and the page's section, on run directories written here."""

from __future__ import annotations

from report_runs import eval_record, records_run, write_records

from opd.report import write_report
from opd.report.load import load_runs
from opd.report.samples import MAX_RECORDS, eval_files, flips, samples_data


def test_flips_compare_each_prompts_greedy_verdict():
    before = [eval_record(0, True), eval_record(0, False, sample=0), eval_record(1, False), eval_record(2, True)]
    after = [eval_record(0, True), eval_record(1, True), eval_record(2, False), eval_record(3, True)]
    assert flips(before, after) == [
        {"item": 1, "prompt": "q1", "before": False, "after": True},
        {"item": 2, "prompt": "q2", "before": True, "after": False},
    ]
    # without a greedy response the first sample is the prompt's verdict
    sampled = [eval_record(0, False, sample=1), eval_record(0, True, sample=0)]
    assert flips([eval_record(0, False, sample=0)], sampled) == [
        {"item": 0, "prompt": "q0", "before": False, "after": True}
    ]


def test_samples_data_takes_the_last_evaluation_and_its_flips(tmp_path):
    a = records_run(
        tmp_path,
        "a",
        {9: [eval_record(0, False), eval_record(1, True)], 19: [eval_record(0, True), eval_record(1, True)]},
    )
    b = records_run(tmp_path, "b", {19: [eval_record(0, True), eval_record(1, False, truncated=True)]})
    assert [s for s, _ in eval_files(a)] == [9, 19]
    (first,), (second,) = samples_data(load_runs([a, b]))
    assert first["task"] == "" and first["steps"] == [9, 19] and first["since"] == 9
    assert first["flipped_since"] == [0] and first["flipped_vs_first"] == []  # the first run is the reference
    assert second["flipped_vs_first"] == [1] and second["flipped_since"] == []
    assert [r["item"] for r in second["records"]] == [0, 1] and second["records"][1]["truncated"]


def test_a_multi_task_runs_records_are_shown_per_task_and_compared_task_by_task(tmp_path):
    """RUN/tasks/NAME/eval_samples/: one view per task, each with its own flips; against an earlier run the
    same task's last evaluation is the reference (the other task's items mean other prompts)."""
    a = records_run(tmp_path, "a", {})
    write_records(
        a / "tasks" / "math" / "eval_samples" / "step_0000004.jsonl", [eval_record(0, False), eval_record(1, True)]
    )
    write_records(
        a / "tasks" / "math" / "eval_samples" / "step_0000009.jsonl", [eval_record(0, True), eval_record(1, True)]
    )
    write_records(a / "tasks" / "game" / "eval_samples" / "step_0000009.jsonl", [eval_record(0, True, truncated=True)])
    (a / "tasks" / "empty").mkdir()  # a task without records has no view
    b = records_run(tmp_path, "b", {})
    write_records(
        b / "tasks" / "math" / "eval_samples" / "step_0000009.jsonl", [eval_record(0, True), eval_record(1, False)]
    )
    write_records(b / "tasks" / "game" / "eval_samples" / "step_0000009.jsonl", [eval_record(0, False)])
    views_a, views_b = samples_data(load_runs([a, b]))
    assert [v["task"] for v in views_a] == ["game", "math"] and [v["task"] for v in views_b] == ["game", "math"]
    game, math = views_a
    assert math["steps"] == [4, 9] and math["flipped_since"] == [0] and game["steps"] == [9]
    assert game["records"][0]["truncated"] and game["flipped_since"] == [] and math["flipped_vs_first"] == []
    assert views_b[0]["flipped_vs_first"] == [0] and views_b[1]["flipped_vs_first"] == [1]


def test_opd_evals_single_file_and_the_page_bound(tmp_path):
    out = records_run(tmp_path, "eval", {})
    write_records(out / "eval_samples.jsonl", [eval_record(i, i % 2 == 0) for i in range(MAX_RECORDS + 5)])
    ((data,),) = samples_data(load_runs([out]))
    assert data["steps"] == [None] and data["total"] == MAX_RECORDS + 5 and len(data["records"]) == MAX_RECORDS


def test_the_page_carries_the_records(tmp_path):
    a = records_run(tmp_path, "a", {4: [eval_record(0, False), eval_record(1, True)]})
    page = write_report([a], tmp_path / "report", show_progress=False).read_text()
    assert 'id="sec-samples"' in page and '"flipped_since":[]' in page and '"response":"r1"' in page
