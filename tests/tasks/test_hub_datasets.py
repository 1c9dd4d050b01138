"""Data by name: Hub datasets and benchmark presets read from huggingface_hub's cache (laid out by the tests,
offline), in the one order every --task name goes through, and the errors when they are absent."""

from __future__ import annotations

import io
import json
import re

import pytest
from hub_cache import cache_repo

from opd.errors import UserError
from opd.rollout.prompt_set import load_task
from opd.tasks.presets import PRESETS, STEP_BY_STEP_BOXED, Preset, register_preset


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _cache_dataset(hub, repo_id: str, splits: dict[str, list[dict]], config: str = "", revision: str = "main"):
    """A dataset repository as the Hub holds it: parquet files per split (under CONFIG/ with a README that
    declares the configuration, as openai/gsm8k's does)."""
    prefix = f"{config}/" if config else "data/"
    snap = cache_repo(hub, repo_id, {"README.md": "---\nlicense: mit\n---\n"}, "dataset", revision)
    for split, rows in splits.items():
        (snap / prefix).mkdir(parents=True, exist_ok=True)
        (snap / prefix / f"{split}-00000-of-00001.parquet").write_bytes(_parquet(rows))
    if config:
        files = "".join(f"  - split: {s}\n    path: {config}/{s}-*.parquet\n" for s in splits)
        (snap / "README.md").write_text(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{files}---\n")
    return snap


def _cache_preset(hub, name: str, splits: dict[str, list[dict]]):
    """A preset's dataset at the commit the preset pins, as ``hf download REPO --revision HASH`` leaves it."""
    preset = PRESETS[name]
    snap = _cache_dataset(hub, preset.repo, splits, config=preset.config, revision=name)
    (snap.parents[1] / "refs" / name).unlink()
    return snap.rename(snap.parent / preset.revision)


ROWS = [{"question": f"What is {i} + {i}?", "answer": f"Add them.\n#### {2 * i}"} for i in range(12)]


def test_a_hub_dataset_by_name_and_config_reads_the_cached_revision(hub):
    _cache_dataset(hub, "acme/sums", {"train": ROWS[:10], "test": ROWS[10:]}, config="main")
    _cache_dataset(hub, "acme/sums", {"train": ROWS[:4], "test": ROWS[4:6]}, config="main", revision="small")
    opts = dict(prompt_field="question", answer_format="gsm8k")
    task = load_task("acme/sums:main", **opts)
    assert [len(task.examples(s)) for s in ("train", "test")] == [10, 2]
    assert task.examples("test")[0].prompt == "What is 10 + 10?" and task.examples("test")[0].answer == "20"
    small = load_task("acme/sums:main", revision="small", **opts)
    assert [len(small.examples(s)) for s in ("train", "test")] == [4, 2]


def test_a_dataset_not_cached_offline_names_it_and_the_download_command(hub):
    with pytest.raises(UserError) as e:
        load_task("acme/absent", flag_prefix="eval-", evaluation=True)
    msg = str(e.value)
    assert "--eval-task 'acme/absent' is no local path, 'arithmetic' or a preset (gsm8k, math500" in msg
    assert "`hf download acme/absent --repo-type dataset`" in msg and str(hub) in msg
    _cache_dataset(hub, "acme/sums", {"train": ROWS})
    with pytest.raises(UserError, match=r"acme/sums at revision 'v3' is not in the cache .*--revision v3"):
        load_task("acme/sums", revision="v3", prompt_field="question")


def test_a_local_path_comes_first_and_a_name_neither_path_nor_hub_id_lists_every_reading(hub, tmp_path, monkeypatch):
    _cache_dataset(hub, "acme/sums", {"train": ROWS})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "sums").mkdir(parents=True)
    (tmp_path / "acme" / "sums" / "train.jsonl").write_text(json.dumps({"prompt": "local?", "answer": "1"}) + "\n")
    local = load_task("acme/sums", split="0.0")
    assert [e.prompt for e in local.examples("train")] == ["local?"]
    with pytest.raises(UserError, match=r"nor 'arithmetic', a preset \(gsm8k, math500, aime24, aime25.*Hub dataset"):
        load_task("./no/such/file.jsonl")
    with pytest.raises(UserError, match=r"a revision \('v1'\) applies to a Hub dataset name only"):
        load_task("acme/sums", revision="v1")


def test_presets_read_their_dataset_columns_format_and_template(hub):
    gsm = [{"question": f"Q{i}?", "answer": f"Because.\n#### {i}"} for i in range(5)]
    _cache_preset(hub, "gsm8k", {"train": gsm[:3], "test": gsm[3:]})
    task = load_task("gsm8k")
    first = task.examples("test")[0]
    assert first.prompt == PRESETS["gsm8k"].template.replace("{prompt}", "Q3?") and first.answer == "3"
    assert task.reward("so #### 3", first) == 1.0 and task.reward("\\boxed{4}", first) == 0.0
    math = [{"problem": "Half of 1?", "answer": "\\frac{1}{2}", "solution": "..."}]
    _cache_preset(hub, "math500", {"test": math})
    evaluation = load_task("math500", evaluation=True, flag_prefix="eval-")
    (e,) = evaluation.examples("test")
    assert e.prompt == STEP_BY_STEP_BOXED.replace("{prompt}", "Half of 1?") and e.answer == "\\frac{1}{2}"
    assert evaluation.reward("so \\boxed{0.5}", e) == 1.0
    _cache_preset(hub, "aime25", {"train": [{"problem": "AIME?", "answer": 204}]})
    (aime,) = load_task("aime25", evaluation=True).examples("test")
    assert aime.answer == "204" and evaluation.reward("\\boxed{204}", aime) == 1.0


def test_presets_read_their_pinned_commit_and_a_revision_given_replaces_it(hub):
    assert [
        n for n, p in PRESETS.items() if not re.fullmatch(r"[0-9a-f]{40}", p.revision)
    ] == []  # commits, not branches
    latest = [{"problem": "Newer?", "answer": 1}]
    _cache_dataset(hub, "HuggingFaceH4/aime_2024", {"train": latest})  # main only: not the commit the preset reads
    pinned = PRESETS["aime24"].revision
    with pytest.raises(UserError, match=rf"HuggingFaceH4/aime_2024 at revision '{pinned}' is not in the cache"):
        load_task("aime24", evaluation=True)
    assert [e.prompt for e in load_task("aime24", evaluation=True, revision="main").examples("test")] == [
        STEP_BY_STEP_BOXED.replace("{prompt}", "Newer?")
    ]
    _cache_preset(hub, "aime24", {"train": [{"problem": "Pinned?", "answer": 2}]})
    (e,) = load_task("aime24", evaluation=True).examples("test")
    assert e.prompt == STEP_BY_STEP_BOXED.replace("{prompt}", "Pinned?") and e.answer == "2"


def test_a_registered_preset_is_read_by_name(hub, monkeypatch):
    monkeypatch.setitem(PRESETS, "sums", PRESETS["gsm8k"])
    register_preset("sums", Preset("acme/sums", prompt_field="question", answer_format="gsm8k", template="{prompt}!"))
    _cache_dataset(hub, "acme/sums", {"test": ROWS[:2]})
    assert [e.prompt for e in load_task("sums", evaluation=True).examples("test")] == [
        "What is 0 + 0?!",
        "What is 1 + 1?!",
    ]
    with pytest.raises(UserError, match="has no '/'"):
        register_preset("a/b", PRESETS["gsm8k"])
