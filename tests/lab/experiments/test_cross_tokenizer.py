"""``opd experiment cross-tokenizer --quick``: its teacher really tokenizes differently, every variant runs
(GOLD included, on CPU from local directories), the cross/* diagnostics and GOLD's refusal are reported."""

from __future__ import annotations

import json

import pytest

from opd.lab.experiments import run
from opd.lab.experiments.cross_tokenizer import VARIANTS
from opd.lab.experiments.stats import INCONCLUSIVE
from opd.models.loading import load_tokenizer


@pytest.mark.slow
def test_cross_tokenizer_quick(tmp_path):
    pytest.importorskip("trl.experimental.gold")
    res = run("cross-tokenizer", tmp_path, seeds=1, quick=True, show_progress=False)
    out = tmp_path / "cross-tokenizer"
    assert res["quick"] and all(c["verdict"] == INCONCLUSIVE for c in res["claims"])  # one seed decides nothing
    assert [c["claim"].split(" (")[-1] for c in res["claims"][1:]] == ["gold-uld)", "gold-hybrid)"]

    # the teacher's tokenizer is its own directory, SentencePiece-style, and reloads as it was made
    tok_dir = out / "runs" / "teacher" / "tokenizer" / "tokenizer"
    teacher_tok = load_tokenizer(tok_dir, "teacher")
    assert len(teacher_tok) == 1024 and teacher_tok.eos_token == "</s>"
    assert teacher_tok.tokenize("The answer is 12")[0] == "▁The"
    model_dir = out / "runs" / "teacher" / "model" / "model"
    assert (model_dir / "config.json").is_file() and not (model_dir / "tokenizer.json").exists()

    table = next(t for t in res["tables"] if t["title"].startswith("Final accuracy"))
    rows = {r[0]: r for r in table["rows"]}
    assert set(VARIANTS) | {"student (before)"} == set(rows)
    for variant in VARIANTS:
        one_to_one, mapped, dropped = (float(x.split()[0]) if x != "n/a" else None for x in rows[variant][3:6])
        if variant.startswith("cross"):
            assert 0.5 < one_to_one < 1 and 0.5 < mapped <= 1 and 0 <= dropped < 1
        else:
            assert one_to_one is None
    # the one_to_one ablation leaves out more positions than pairing at every group start
    assert float(rows["cross-lsm-one-to-one"][5].split()[0]) > float(rows["cross-lsm"][5].split()[0])

    # GOLD ran on CPU and its model was scored by opd eval; its byte-offset alignment's refusal is quoted
    for gold in ("gold-uld", "gold-hybrid"):
        done = json.loads((out / "runs" / gold / "seed0" / "DONE.json").read_text())
        assert done["result"]["s_per_step"] > 0
        assert (out / "runs" / gold / "seed0" / "eval" / "DONE.json").is_file()
    assert any("supports only ByteLevel BPE" in n for n in res["notes"])
    assert "opd train" in (out / "commands.txt").read_text()
