"""The embedded default: the model recipe (shortened) and the demo pipeline (quick) run end to end."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_options
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.errors import UserError
from opd.lab.demos.demo import make_demo_models, run_demo


@pytest.mark.slow
def test_make_demo_models_and_quick_demo(tmp_path, capsys):
    assets = tmp_path / "assets"
    made = make_demo_models(assets, quick=True)
    assert set(made) == {"teacher", "student"} and all(m["steps"] == 10 for m in made.values())
    for name in ("teacher", "student"):
        tok = AutoTokenizer.from_pretrained(assets / name)
        model = AutoModelForCausalLM.from_pretrained(assets / name)
        assert model.config.vocab_size == len(tok) >= 1000
        assert "<|im_start|>assistant" in tok.apply_chat_template(
            [{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True
        )
    assert AutoModelForCausalLM.from_pretrained(assets / "teacher").config.num_hidden_layers == 4
    teacher_weights = (assets / "teacher" / "model.safetensors").read_bytes()
    remade = make_demo_models(assets, quick=True, only="student")  # the teacher is left as it was
    assert set(remade) == {"teacher", "student"}
    assert (assets / "teacher" / "model.safetensors").read_bytes() == teacher_weights
    with pytest.raises(UserError, match="--only"):
        make_demo_models(assets, quick=True, only="teachers")

    summary = run_demo(tmp_path / "demo", quick=True, assets=assets)
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert saved == summary
    assert {"teacher_acc", "student_init_acc", "objectives"} <= set(saved)
    # what the figures depend on besides the seeds, printed and kept: torch and the CPU kernels it picked
    capability = torch.backends.cpu.get_cpu_capability()
    assert (saved["torch"], saved["cpu_capability"]) == (torch.__version__, capability)
    assert f"CPU capability {capability}" in " ".join(capsys.readouterr().out.split())
    report = tmp_path / "demo" / "report"
    assert (report / "report.html").is_file()
    assert {p.name for p in (report / "charts").glob("scatter-*.png")} == {"scatter-sampled.png", "scatter-lsm.png"}
    for objective in ("sampled", "lsm"):
        r = saved["objectives"][objective]
        assert set(r) == {"final_acc", "avg_at_k", "steps", "wall_s"} and r["steps"] == 10
        run = tmp_path / "demo" / objective
        evals = [
            json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in line
        ]
        assert r["final_acc"] == evals[-1]["eval/accuracy"] and r["avg_at_k"] == evals[-1]["eval/avg_at_k"]
        assert (run / "final" / "config.json").is_file() and (run / "eval.jsonl").is_file()
        assert run_options(run)["objective"] == objective
