"""LoRA training (``--lora-r``): only the adapter moves, checkpoints resume, merge-lora exports a plain model."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_close_weights, assert_same_trajectory, cli_args, launch, step_records
from typer.testing import CliRunner

from opd.cli import app
from opd.config import TrainConfig
from opd.errors import UserError
from opd.training import loop as train_mod

SMALL = dict(
    max_new_tokens=8,
    eval_size=4,
    eval_samples=0,
    k=8,
    warmup_steps=1,
    log_rollouts=2,
    diag_positions=16,
    eval_every=0,
    batch_size=4,
    lr=3e-3,
    lora_r=4,
    lora_alpha=8.0,
)


def cfg_for(models, out, **kw) -> TrainConfig:
    return TrainConfig.from_flat(student=str(models[0]), teacher=str(models[1]), out=str(out), **{**SMALL, **kw})


@pytest.fixture(scope="module")
def lora_run(tiny_models, tmp_path_factory):
    """3 LoRA steps with a checkpoint each step; the student's weights before and after."""
    out = tmp_path_factory.mktemp("lora") / "run"
    captured = {}
    real_setup = train_mod.setup

    def setup_and_snapshot(cfg):
        run = real_setup(cfg)
        captured["run"] = run
        captured["before"] = {k: v.detach().clone() for k, v in run.student.state_dict().items()}
        return run

    mp = pytest.MonkeyPatch()
    mp.setattr(train_mod, "setup", setup_and_snapshot)
    try:
        train_mod.train(cfg_for(tiny_models, out, steps=3, ckpt_every=1), show_progress=False)
    finally:
        mp.undo()
    after = {k: v.detach().clone() for k, v in captured["run"].student.state_dict().items()}
    return out, captured["before"], after


def test_only_adapter_weights_change(lora_run):
    out, before, after = lora_run
    lora_keys = [k for k in before if "lora_" in k]
    base_keys = [k for k in before if "lora_" not in k]
    assert lora_keys and base_keys
    assert all(torch.equal(before[k], after[k]) for k in base_keys)  # bit-identical
    assert all(not torch.equal(before[k], after[k]) for k in lora_keys if "lora_B" in k)
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert not (out / "final" / "model.safetensors").exists()
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"].startswith("/")


def test_lora_resume_equals_uninterrupted(tiny_models, lora_run, tmp_path):
    out = tmp_path / "run"
    train_mod.train(cfg_for(tiny_models, out, steps=2, ckpt_every=1), show_progress=False)
    train_mod.train(cfg_for(tiny_models, out, steps=3, ckpt_every=1, resume=True), show_progress=False)
    got, want = step_records(out), step_records(lora_run[0])
    assert [r["step"] for r in got] == [0, 1, 2]
    for g, w in zip(got, want):
        for key in w:
            if not key.startswith("time/"):
                assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), (w["step"], key)
    from safetensors.torch import load_file

    a = load_file(str(out / "final" / "adapter_model.safetensors"))
    b = load_file(str(lora_run[0] / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merge_lora_gives_a_plain_model_with_the_adapted_outputs(tiny_models, lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = lora_run[0] / "final"
    merged_dir = tmp_path / "merged"
    result = CliRunner().invoke(app, ["merge-lora", str(final), "--out", str(merged_dir)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert not (merged_dir / "adapter_config.json").exists()
    adapter_card, card = (final / "README.md").read_text(), (merged_dir / "README.md").read_text()
    assert "library_name: peft" in adapter_card and "- lora" in adapter_card  # the run's card of its adapter
    assert "library_name: transformers" in card and "- merged-lora" in card and "## Method and options" in card
    assert "base_model" not in card  # a local base: no Hub link to a model that is not there
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_models[0]).eval()
    tok = AutoTokenizer.from_pretrained(merged_dir)
    ids = torch.tensor([tok("Tom has 3 apples and buys 4 more.")["input_ids"]])
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, final).eval()
        adapted_logits = adapted(input_ids=ids).logits
        merged_logits = merged(input_ids=ids).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-3  # the adapter does something
    assert torch.allclose(merged_logits, adapted_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_lora_on_two_ranks_matches_one_process(tiny_models, lora_run, tmp_path, fsdp):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    launch(
        "torchrun", cli_args(tiny_models, out, batch_size=2, steps=3, lora_r=4, lora_alpha=8.0, ckpt_every=0, fsdp=fsdp)
    )
    assert_same_trajectory(step_records(out), step_records(lora_run[0]))
    a = load_file(str(out / "final" / "adapter_model.safetensors"))
    b = load_file(str(lora_run[0] / "final" / "adapter_model.safetensors"))
    assert_close_weights(a, b)


def test_bad_lora_target_is_refused_before_training(tiny_models, tmp_path):
    with pytest.raises(UserError, match="'nope' is not a linear layer of the student; choose among: .*q_proj"):
        train_mod.setup(cfg_for(tiny_models, tmp_path / "run", lora_targets=["q_proj,nope"]))


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_head_and_embedding_cannot_be_lora_targets(tiny_models, target):
    from opd.models.loading import load_model
    from opd.models.lora import apply_lora

    with pytest.raises(UserError, match="output head or input embedding"):
        apply_lora(load_model(tiny_models[0]), 4, 8.0, [target], 0.0, tiny_models[0])


def test_merge_lora_refuses_a_plain_model(tiny_models, tmp_path):
    result = CliRunner().invoke(app, ["merge-lora", str(tiny_models[0]), "--out", str(tmp_path / "m")])
    assert isinstance(result.exception, UserError) and "not a LoRA adapter" in str(result.exception)


def test_an_adapter_directory_given_as_a_model_points_to_merge_lora(lora_run):
    from opd.models.loading import load_model

    with pytest.raises(UserError, match="holds a LoRA adapter.*opd merge-lora"):
        load_model(lora_run[0] / "final", "student")


def test_merge_lora_writes_only_into_a_new_or_empty_folder(tiny_models, lora_run):
    import hashlib

    base = tiny_models[0]
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in base.rglob("*") if p.is_file()}
    final = lora_run[0] / "final"
    result = CliRunner().invoke(app, ["merge-lora", str(final), "--out", str(base)])
    assert isinstance(result.exception, UserError)
    assert f"--out {base} is a folder that is not empty; opd merge-lora writes the merged model" in str(
        result.exception
    )
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in base.rglob("*") if p.is_file()} == before


def test_an_adapter_names_its_base_as_a_folder_or_a_hub_name_with_its_revision(tiny_models):
    from opd.models.loading import load_model
    from opd.models.lora import apply_lora

    local = apply_lora(load_model(tiny_models[0]), 4, 8.0, [], 0.0, tiny_models[0], "")
    cfg = local.peft_config["default"]
    assert (cfg.base_model_name_or_path, cfg.revision) == (str(tiny_models[0].resolve()), None)
    # a Hub name stays a name (resolved against the working directory it would be a folder that is not there)
    hub = apply_lora(load_model(tiny_models[0]), 4, 8.0, [], 0.0, "acme/tiny-student", "v2")
    cfg = hub.peft_config["default"]
    assert (cfg.base_model_name_or_path, cfg.revision) == ("acme/tiny-student", "v2")
