"""Mixed precision (--dtype bfloat16): float32 masters, the body under bfloat16 autocast (opd.models.precision)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import cfg_for, step_records, train_killed_at
from safetensors.torch import load_file

from opd.config import ConfigError, EvalConfig, SFTConfig, TrainConfig
from opd.errors import UserError
from opd.lab.replay import BF16_EPS, replay
from opd.models.loading import final_hidden, load_model
from opd.models.precision import compute_in, configure_device_math
from opd.training import loop as train_mod
from opd.training.setup import setup

DEMO = "src/opd/assets/demo"


def test_compute_in_runs_the_blocks_in_bfloat16_and_the_rest_in_float32(tiny_models):
    model = compute_in(load_model(tiny_models[0]), "bfloat16")
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids = torch.tensor([[3, 4, 5, 6]])
    h = final_hidden(model, ids, torch.ones_like(ids))
    logits = model(input_ids=ids).logits
    assert seen == [torch.bfloat16, torch.bfloat16]  # a block's matmuls ran under autocast, both calls
    assert h.dtype == logits.dtype == torch.float32  # the head and what opd computes from h: float32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
    reference = load_model(tiny_models[0])(input_ids=ids).logits
    assert 0 < float((logits - reference).abs().max().detach()) < 0.05  # bfloat16 rounding, not another model


def test_mixed_precision_moves_weights_that_pure_bfloat16_rounds_away(tiny_models, tmp_path):
    """At lr 1e-6 an AdamW step moves each weight by about 1e-6: kept (float32 masters), where a bfloat16
    weight of the same value, given the same update, stays put (its spacing is far wider)."""
    cfg = cfg_for(tiny_models, tmp_path, dtype="bfloat16", lr=1e-6, steps=1, ckpt_every=1, eval_samples=0)
    before = load_model(tiny_models[0]).state_dict()
    train_mod.train(cfg, show_progress=False)
    after = load_file(str(tmp_path / "run" / "checkpoints" / "step_0000000" / "model" / "model.safetensors"))
    moved = pure_moved = total = 0
    for name, w0 in before.items():
        if "embed" in name or name not in after:  # a token neither read nor in a support has no gradient
            continue
        w1 = after[name]
        assert w1.dtype == torch.float32, name  # the checkpoint holds the masters
        step = w1 - w0
        moved += int((step != 0).sum())
        # the same update applied to the weights in bfloat16 (pure bfloat16 training)
        pure = w0.to(torch.bfloat16) + step.to(torch.bfloat16)
        kept = pure != w0.to(torch.bfloat16)
        pure_moved += int(kept.sum())
        # only a weight near 0, whose bfloat16 spacing (2^-8 of its size) is below the step, moves in bfloat16
        assert not kept.any() or float(w0[kept].abs().max()) < 2 * 1e-6 / BF16_EPS, name
        total += w0.numel()
        assert float(step.abs().max()) < 3e-6, name  # an Adam step of lr 1e-6, no more
    assert moved > 0.99 * total, (moved, total)
    assert pure_moved < 0.05 * total, (pure_moved, total)
    final = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert final["dtype"] == "bfloat16"
    assert all(
        t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "run" / "final" / "model.safetensors")).values()
    )


@pytest.mark.parametrize("objective", ["lsm", "sampled", "full_kl"])
def test_bfloat16_follows_float32_on_replayed_batches(objective, tmp_path):
    """20 steps at lr 1e-4 on the float32 run's batches: each step's loss within the tolerance
    Replayed.within_bf16_bound derives, 2^-8 (t + 1) relative at step t. Replayed, as on-policy runs part at
    their first differing sample. The sampled-token loss's value reads the batch alone (equal by construction):
    for it, and for all, the runs must compute differently, stay finite and move their weights alike."""
    base = dict(
        student=f"{DEMO}/student",
        teacher=f"{DEMO}/teacher",
        teacher_dtype="float32",
        device="cpu",
        steps=20,
        batch_size=8,
        max_new_tokens=24,
        eval_size=4,
        eval_samples=0,
        k=8,
        warmup_steps=1,
        log_rollouts=0,
        diag_positions=16,
        eval_every=0,
        ckpt_every=0,
        objective=objective,
        lr=1e-4,
    )
    reference = TrainConfig.from_flat(**base, out=str(tmp_path / "float32"))
    got = replay(reference, TrainConfig.from_flat(**base, out=str(tmp_path / "bfloat16"), dtype="bfloat16"), steps=20)
    if objective == "sampled":
        assert all(a == b for a, b in got.losses)
    else:
        assert got.within_bf16_bound(), got.losses
    assert all(math.isfinite(x) for pair in got.grad_norms for x in pair)
    moved, gap = got.weight_gap()
    start, (w32, w16) = got.start, got.ends
    cosine = float(torch.nn.functional.cosine_similarity(w32 - start, w16 - start, dim=0))
    assert gap > 0 and cosine > 0.9, (gap, moved, cosine)  # different rounding; the same direction of travel


def test_resume_equals_uninterrupted_in_mixed_precision(tiny_models, tmp_path, monkeypatch):
    full = cfg_for(tiny_models, tmp_path / "a", steps=4, ckpt_every=2, eval_samples=0, dtype="bfloat16")
    train_mod.train(full, show_progress=False)
    expected = step_records(tmp_path / "a" / "run")
    killed = cfg_for(tiny_models, tmp_path / "b", steps=4, ckpt_every=2, eval_samples=0, dtype="bfloat16")
    train_killed_at(killed, 3, monkeypatch)
    train_mod.train(killed.replace(resume=True), show_progress=False)
    got = step_records(tmp_path / "b" / "run")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for e, g in zip(expected, got, strict=True):
        assert {k: v for k, v in g.items() if not k.startswith("time/")} == {
            k: v for k, v in e.items() if not k.startswith("time/")
        }


def test_resume_with_other_precision_names_both(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, steps=1, ckpt_every=1, eval_samples=0, dtype="bfloat16")
    train_mod.train(cfg, show_progress=False)
    again = cfg.replace(resume=True, steps=2, dtype="float32")
    with pytest.raises(UserError, match="bfloat16 compute with float32 weights.*float32 compute.*--dtype bfloat16"):
        train_mod.train(again, show_progress=False)


def test_lora_keeps_its_base_in_bfloat16_and_trains_a_float32_adapter(tiny_models, tmp_path):
    run = setup(cfg_for(tiny_models, tmp_path, dtype="bfloat16", lora_r=4))
    trained = {n: p.dtype for n, p in run.student.named_parameters() if p.requires_grad}
    frozen = {n: p.dtype for n, p in run.student.named_parameters() if not p.requires_grad}
    assert trained and set(trained.values()) == {torch.float32}
    assert set(frozen.values()) == {torch.bfloat16}


@pytest.mark.parametrize("cls", [TrainConfig, SFTConfig])
def test_float16_training_is_refused(cls):
    with pytest.raises(ConfigError, match="float16 needs loss scaling.*bfloat16"):
        cls.from_flat(dtype="float16")


def test_float16_still_evaluates():
    assert EvalConfig.from_flat(dtype="float16").model.dtype == "float16"


@pytest.fixture
def cuda_flags():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.cudnn_sdp_enabled(),
    )
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.backends.cuda.enable_cudnn_sdp(saved[2])


@pytest.mark.parametrize("tf32", [None, True, False])
def test_cuda_runs_get_tf32_and_no_cudnn_attention(cuda_flags, tf32):
    """The step-0 NaN's fix (cuDNN's SDPA backward, pytorch/pytorch#196678) and TF32, set for a CUDA run;
    the flags can be set without a GPU, so this runs here (the GPU check measures the NaN itself)."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    configure_device_math(torch.device("cuda", 0), "bfloat16", tf32, "opd train")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.matmul.allow_tf32 is (tf32 is not False)


def test_tf32_on_a_cpu_is_ignored_with_a_note(cuda_flags, capsys):
    torch.backends.cuda.matmul.allow_tf32 = False
    configure_device_math(torch.device("cpu"), "float32", True, "opd train")
    assert "--tf32 ignored" in capsys.readouterr().err
    assert torch.backends.cuda.matmul.allow_tf32 is False
    configure_device_math(torch.device("cpu"), "float32", None, "opd train")
    assert capsys.readouterr().err == ""


def test_bfloat16_on_a_cpu_without_bfloat16_instructions_names_the_cost(monkeypatch, capsys):
    monkeypatch.setattr("opd.models.precision.cpu_has_bfloat16", lambda: False)
    configure_device_math(torch.device("cpu"), "bfloat16", None, "opd sft")
    assert "no bfloat16 matrix instructions" in capsys.readouterr().err


def test_an_engine_gets_the_compute_dtype_not_the_masters(tiny_models, tmp_path):
    from opd.models.export import merged_weights
    from opd.models.precision import engine_dtype

    run = setup(cfg_for(tiny_models, tmp_path, dtype="bfloat16", lora_r=4))
    masters = merged_weights(run.student)
    sent = merged_weights(run.student, engine_dtype("bfloat16"))
    assert sent.keys() == masters.keys() and all(v.dtype == torch.bfloat16 for v in sent.values())
    assert all(torch.equal(sent[k], masters[k].to(torch.bfloat16)) for k in sent)
    assert engine_dtype("float32") is None
