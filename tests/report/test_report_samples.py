"""The report's view of evaluation records (opd.report.samples): flips between two evaluations, the last
evaluation of each run, and the page's section, on run directories written here."""

from __future__ import annotations

import json

from opd.report import write_report
from opd.report.load import load_runs
from opd.report.samples import MAX_RECORDS, eval_files, flips, samples_data


def _record(item, correct, sample=-1, truncated=False):
    return {
        "item": item,
        "sample": sample,
        "prompt": f"q{item}",
        "response": f"r{item}",
        "answer": "1",
        "reference": "1",
        "correct": correct,
        "tokens": 3,
        "truncated": truncated,
    }


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(root, name, evaluations):
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "train/loss": 1.0}) + "\n")
    (run / "config.json").write_text(json.dumps({"steps": 1}))
    for step, records in evaluations.items():
        _write(run / "eval_samples" / f"step_{step:07d}.jsonl", records)
    return run


def test_flips_compare_each_prompts_greedy_verdict():
    before = [_record(0, True), _record(0, False, sample=0), _record(1, False), _record(2, True)]
    after = [_record(0, True), _record(1, True), _record(2, False), _record(3, True)]
    assert flips(before, after) == [
        {"item": 1, "prompt": "q1", "before": False, "after": True},
        {"item": 2, "prompt": "q2", "before": True, "after": False},
    ]
    # without a greedy response the first sample is the prompt's verdict
    sampled = [_record(0, False, sample=1), _record(0, True, sample=0)]
    assert flips([_record(0, False, sample=0)], sampled) == [
        {"item": 0, "prompt": "q0", "before": False, "after": True}
    ]


def test_samples_data_takes_the_last_evaluation_and_its_flips(tmp_path):
    a = _run(tmp_path, "a", {9: [_record(0, False), _record(1, True)], 19: [_record(0, True), _record(1, True)]})
    b = _run(tmp_path, "b", {19: [_record(0, True), _record(1, False, truncated=True)]})
    assert [s for s, _ in eval_files(a)] == [9, 19]
    data = samples_data(load_runs([a, b]))
    assert data[0]["steps"] == [9, 19] and data[0]["since"] == 9 and data[0]["flipped_since"] == [0]
    assert data[0]["flipped_vs_first"] == []  # the first run is the reference
    assert data[1]["flipped_vs_first"] == [1] and data[1]["flipped_since"] == []
    assert [r["item"] for r in data[1]["records"]] == [0, 1] and data[1]["records"][1]["truncated"]


def test_opd_evals_single_file_and_the_page_bound(tmp_path):
    out = _run(tmp_path, "eval", {})
    _write(out / "eval_samples.jsonl", [_record(i, i % 2 == 0) for i in range(MAX_RECORDS + 5)])
    (data,) = samples_data(load_runs([out]))
    assert data["steps"] == [None] and data["total"] == MAX_RECORDS + 5 and len(data["records"]) == MAX_RECORDS


def test_the_page_carries_the_records(tmp_path):
    a = _run(tmp_path, "a", {4: [_record(0, False), _record(1, True)]})
    page = write_report([a], tmp_path / "report", show_progress=False).read_text()
    assert 'id="sec-samples"' in page and '"flipped_since":[]' in page and '"response":"r1"' in page
