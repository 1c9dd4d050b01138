"""Model cards: final/README.md's front matter as the Hub reads it (huggingface_hub parses it back) and a
body with the method, the options, the evaluation figures and the code that made it."""

from __future__ import annotations

import yaml
from huggingface_hub import ModelCard

import opd
from opd.config import SFTConfig, TrainConfig
from opd.runs.card import run_card, sft_card
from opd.runs.provenance import source_commit


def _front(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_a_run_card_names_the_hub_base_model_the_dataset_the_method_and_the_figures(monkeypatch):
    monkeypatch.setenv("OPD_COMMIT", "abc1234")
    cfg = TrainConfig.from_flat(
        student="Qwen/Qwen3-1.7B", teacher="Qwen/Qwen3-8B", task="gsm8k", eval_task="acme/extra:main", k=16
    )
    text = run_card(cfg, "my-run", {"step": 199, "eval/accuracy": 0.625, "eval/pass_at_k": 0.8125, "eval/n": 8})
    front = _front(text)
    assert front == {
        "base_model": "Qwen/Qwen3-1.7B",
        "library_name": "transformers",
        "tags": ["opd", "distillation", "on-policy-distillation"],
        "datasets": ["openai/gsm8k", "acme/extra"],
    }
    assert ModelCard(text).data.base_model == "Qwen/Qwen3-1.7B"  # the Hub's own reader agrees
    assert f"opd {opd.__version__} (commit abc1234)" in text and source_commit() == "abc1234"
    assert "| objective | lsm |" in text and "| k | 16 |" in text and "| teacher | Qwen/Qwen3-8B |" in text
    assert "The evaluation at step 199 (of the weights in this folder):" in text and "| eval/accuracy | 0.625 |" in text
    assert "| eval/pass_at_k | 0.8125 |" in text and "hf upload ORG/NAME PATH" in text


def test_a_local_student_and_no_evaluation_leave_no_hub_link_and_say_so(tmp_path):
    student = tmp_path / "student"
    student.mkdir()
    cfg = TrainConfig.from_flat(student=str(student), teacher=str(student), lora_r=4, eval=False)
    text = run_card(cfg, "local", {})
    front = _front(text)
    assert "base_model" not in front and "datasets" not in front and front["library_name"] == "peft"
    assert "lora" in front["tags"] and "The run did not evaluate" in text
    assert "AutoPeftModelForCausalLM" in text


def test_an_sft_card_names_its_start_its_data_and_what_chose_the_weights(tmp_path):
    cfg = SFTConfig.from_flat(init="Qwen/Qwen3-0.6B", task="gsm8k", steps=7)
    text = sft_card(cfg, "sft-run", {"steps": 7, "best_accuracy": 0.25, "chosen_on": "validation"})
    front = _front(text)
    assert front["base_model"] == "Qwen/Qwen3-0.6B" and front["datasets"] == ["openai/gsm8k"]
    assert "**Qwen/Qwen3-0.6B** fine-tuned (SFT) on the task's own solutions (gsm8k)" in text
    assert "| best_accuracy | 0.25 |" in text and "| chosen_on | validation |" in text and "| steps | 7 |" in text
    new = SFTConfig.from_flat(arch="qwen2:2:32", tokenizer=str(tmp_path), task="arithmetic", eval=False)
    text = sft_card(new, "new", {"steps": 3, "chosen_on": "last step"})
    assert "base_model" not in _front(text) and "a new model (qwen2:2:32)" in text
    assert "The run did not evaluate: the last step's weights are kept." in text
