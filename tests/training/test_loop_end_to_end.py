"""The OPD trainer end to end on tiny random models: CLI smoke runs, learning, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QUICK_RUN, cfg_for, first_rollout, read_metrics, run_options, step_records, train_killed_at
from typer.testing import CliRunner

from opd.cli import app
from opd.config import ConfigError
from opd.errors import UserError
from opd.training import loop as train_mod
from opd.training import producer

OBJECTIVES = [
    ["--objective", "lsm"],
    ["--objective", "lsm", "--no-renormalize"],
    ["--objective", "lsm", "--support", "student_topk"],
    ["--objective", "lsm", "--support", "union"],
    ["--objective", "lsm", "--support", "intersection"],
    ["--objective", "lsm", "--support", "symmetric_difference"],
    ["--objective", "lsm", "--support", "teacher_topk_plus_sampled"],
    ["--objective", "sampled"],
    ["--objective", "sampled", "--gamma", "0.9", "--updates-per-batch", "2", "--grad-accum", "2"],
    ["--objective", "full_kl"],
    ["--objective", "full_kl", "--kl-direction", "forward"],
]


@pytest.mark.parametrize("args", OBJECTIVES, ids=lambda a: "-".join(x.strip("-") for x in a[1:]))
def test_cli_smoke_every_objective(tiny_models, tmp_path, args):
    student, teacher = tiny_models
    out = tmp_path / "run"
    cli = ["train", "--student", str(student), "--teacher", str(teacher), "--out", str(out)]
    for key, value in {**QUICK_RUN, "log_rollouts": QUICK_RUN["batch_size"]}.items():  # every rollout logged
        cli += [f"--{key.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(app, cli + args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    steps = step_records(out)
    assert [r["step"] for r in steps] == [0, 1]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8 and len(rollouts[0]["teacher_topk_ids"][0]) == 8
    for r in steps:
        # The step's figures must agree with its per-token records (the first update's loss, token mean).
        mine = [x for x in rollouts if x["step"] == r["step"]]
        masks = [m for x in mine for m in x["loss_mask"]]
        losses = [v for x in mine for v, m in zip(x["token_loss"], x["loss_mask"], strict=True) if m]
        assert r["train/loss_tokens"] == sum(masks)
        assert r["train/loss"] == pytest.approx(sum(losses) / max(sum(masks), 1), rel=1e-4, abs=1e-5)
        assert r["rollout/accuracy"] == sum(x["correct"] for x in mine) / len(mine)
        assert torch.isfinite(torch.tensor(float(r["train/grad_norm"])))
        if args[1] != "sampled" and "--no-renormalize" not in args:  # a divergence is never negative
            assert r["train/loss"] >= 0.0
        assert 0.0 <= r["diag/overlap"] <= 1.0 and len(r["depth/reward"]) == 8
    evals = [r for r in read_metrics(out) if "eval/accuracy" in r]
    assert len(evals) == 1 and evals[0]["step"] == 1
    assert len((out / "eval.jsonl").read_text().splitlines()) == QUICK_RUN["eval_size"]
    cfg = run_options(out)
    assert cfg["objective"] == args[1]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "final")
    assert AutoTokenizer.from_pretrained(out / "final").chat_template


def test_config_file_and_cli_precedence(tiny_models, tmp_path):
    student, teacher = tiny_models
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        f"student: {student}\nteacher: {teacher}\nsteps: 1\nbatch_size: 2\nk: 4\nlr: 0.01\n"
        "max_new_tokens: 4\neval_size: 2\neval_samples: 0\n"
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--config", str(cfg_file), "--lr", "0.002", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = run_options(out)
    assert saved["lr"] == 0.002 and saved["k"] == 4 and saved["batch_size"] == 2


def test_lsm_loss_decreases_on_a_fixed_batch(tiny_models, tmp_path):
    from opd.training.loss import LossTotals, loss_mask, objective_loss, reduce_loss

    run = train_mod.setup(cfg_for(tiny_models, tmp_path, lr=3e-3, warmup_steps=0, batch_size=8))
    batch, _, _ = first_rollout(run)
    mask = loss_mask(batch, run.special_ids, True)
    scores = run.tasks[0].teacher.score(batch, run.cfg.objective.k)
    totals = LossTotals(int(mask.sum()), int((mask.sum(-1) > 0).sum()), *mask.shape)
    losses = []
    for _ in range(30):
        run.optimizer.zero_grad()
        loss_NT, _ = objective_loss(run.cfg, run.student, run.tasks[0].teacher, batch, scores, mask)
        loss = reduce_loss("token_mean", loss_NT, mask, totals)
        loss.backward()
        run.optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_resume_equals_uninterrupted(tiny_models, tmp_path, monkeypatch):
    full = cfg_for(tiny_models, tmp_path / "a", steps=4, ckpt_every=2, eval_samples=0)
    train_mod.train(full, show_progress=False)
    expected = step_records(tmp_path / "a" / "run")

    killed = cfg_for(tiny_models, tmp_path / "b", steps=4, ckpt_every=2, eval_samples=0)
    train_killed_at(killed, 3, monkeypatch)
    assert [r["step"] for r in step_records(tmp_path / "b" / "run")] == [0, 1, 2]
    resumed = killed.replace(resume=True)
    train_mod.train(resumed, show_progress=False)
    got = step_records(tmp_path / "b" / "run")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for e, g in zip(expected, got):
        for key in e:
            if not key.startswith("time/"):
                assert g[key] == pytest.approx(e[key], rel=1e-6, abs=1e-9), (e["step"], key)


def test_nan_loss_stops_and_keeps_last_checkpoint(tiny_models, tmp_path, monkeypatch):
    cfg = cfg_for(tiny_models, tmp_path, steps=4, ckpt_every=1, eval_samples=0)
    real = train_mod.objective_loss
    calls = []

    def nan_at_step_2(*a, **kw):  # one call per step: no accumulation, one update per batch
        calls.append(1)
        loss, h = real(*a, **kw)
        return (loss * float("nan") if len(calls) == 3 else loss), h

    monkeypatch.setattr(train_mod, "objective_loss", nan_at_step_2)
    with pytest.raises(UserError, match="loss became nan at step 2"):
        train_mod.train(cfg, show_progress=False)
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_0000001"


def test_corrupted_checkpoint_is_reported(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, steps=1, ckpt_every=1, eval_samples=0)
    train_mod.train(cfg, show_progress=False)
    state = tmp_path / "run" / "checkpoints" / "step_0000000" / "state.pt"
    state.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="corrupted"):
        train_mod.train(cfg.replace(resume=True, steps=2), show_progress=False)


# ----------------------------------------------------------------------------- bad input


def test_missing_model_path(tiny_models, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        train_mod.setup(cfg_for((tmp_path / "nope", tiny_models[1]), tmp_path))


def test_mismatched_vocabularies(tiny_models, tmp_path):
    from opd.models.loading import tiny_qwen2
    from opd.models.tokenizer import train_tokenizer
    from opd.tasks import ArithmeticTask

    ex = ArithmeticTask(n_train=300, n_test=10, seed=5).examples("train")
    tok = train_tokenizer([e.prompt for e in ex] + [e.solution for e in ex], vocab_size=600)
    other = tmp_path / "other"
    tiny_qwen2(len(tok), 1, 32, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(UserError, match="tokenizers differ .* --cross-tokenizer is off"):
        train_mod.setup(cfg_for((tiny_models[0], other), tmp_path, cross_tokenizer="off"))


def test_empty_and_malformed_prompt_files(tiny_models, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="empty"):
        train_mod.setup(cfg_for(tiny_models, tmp_path, task=str(empty)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1?", "answer": "2"}\n{"answer": "3"}\n')
    with pytest.raises(UserError, match="line 2.*prompt|prompt.*line 2"):
        train_mod.setup(cfg_for(tiny_models, tmp_path, task=str(bad)))


def test_prompt_longer_than_allowed(tiny_models, tmp_path):
    with pytest.raises(UserError, match="longer than max_prompt_tokens"):
        train_mod.setup(cfg_for(tiny_models, tmp_path, max_prompt_tokens=5))


def test_prompt_plus_response_longer_than_context(tiny_models, tmp_path):
    with pytest.raises(UserError, match="exceeds the model's context"):
        run = train_mod.setup(cfg_for(tiny_models, tmp_path, max_new_tokens=600))
        first_rollout(run)


def test_k_larger_than_vocab(tiny_models, tmp_path):
    with pytest.raises(UserError, match="larger than the vocabulary"):
        train_mod.setup(cfg_for(tiny_models, tmp_path, k=5000))


@pytest.mark.parametrize("top_p", [0.0, 1.5, -0.1])
def test_top_p_out_of_range(tiny_models, tmp_path, top_p):
    with pytest.raises(ConfigError, match="top_p"):
        cfg_for(tiny_models, tmp_path, top_p=top_p)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(teacher_dtype="fp8"), "teacher_dtype='fp8'"),
        (dict(teacher_dtype="bfloat16", teacher_url="http://127.0.0.1:1"), "in-process teacher"),
    ],
)
def test_teacher_dtype_is_validated(tiny_models, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for(tiny_models, tmp_path, **kw)


def test_bfloat16_teacher_scores_float32_students_rollouts(tiny_models, tmp_path):
    """The teacher runs in bfloat16 while the student trains in float32; its scores stay float32 and
    close to the float32 teacher's, and a run with it trains."""
    half = train_mod.setup(cfg_for(tiny_models, tmp_path, teacher_dtype="bfloat16"))
    full = train_mod.setup(cfg_for(tiny_models, tmp_path / "f32"))
    assert half.tasks[0].teacher.model.dtype == torch.bfloat16 and half.student.dtype == torch.float32
    batch, _, _ = first_rollout(half)
    got, want = half.tasks[0].teacher.score(batch, 8), full.tasks[0].teacher.score(batch, 8)
    mask = batch.response_mask_NT
    assert got.sampled_logprobs_NT.dtype == torch.float32
    gap = (got.sampled_logprobs_NT - want.sampled_logprobs_NT).abs()[mask]
    assert float(gap.max()) < 0.02, f"bfloat16 teacher log-probs differ by up to {float(gap.max()):.3f} nats"
    assert float((got.topk_ids_NTK[..., 0] == want.topk_ids_NTK[..., 0])[mask].float().mean()) > 0.8
    train_mod.train(cfg_for(tiny_models, tmp_path / "trained", teacher_dtype="bfloat16"), show_progress=False)
    out = tmp_path / "trained" / "run"
    assert run_options(out)["teacher_dtype"] == "bfloat16"
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in step_records(out))


@pytest.mark.parametrize(
    "objective",
    [
        dict(objective="lsm", support="union"),
        dict(objective="sampled"),
        dict(objective="full_kl"),
        dict(objective="lsm", served="yes"),
    ],
    ids=lambda o: "-".join(o.values()),
)
def test_steps_make_no_tensor_on_the_default_device(tiny_models, tmp_path, monkeypatch, objective):
    """On a GPU the default device (the CPU) is the wrong one, so a step must not create tensors on
    the default device. No GPU here: the models stay on the CPU and, from step 1 on, the default
    device is "meta" (tensors without data), so a tensor made without a device lands there and
    the first operation mixing it with a CPU tensor fails. Step 0 runs as usual, because torch
    itself keeps AdamW's step counters on the default device when it creates them. (A tensor
    made on the CPU on purpose and never moved would pass: here the models are on the CPU too.)"""
    from opd.models.loading import load_model, load_tokenizer
    from opd.teachers.server import TeacherApp, start_server, stop_server

    real = producer.rollout_stage

    def on_meta_from_step_1(run, step, *args):
        if step >= 1:
            torch.set_default_device("meta")
        return real(run, step, *args)

    monkeypatch.setattr(producer, "rollout_stage", on_meta_from_step_1)
    served = objective.pop("served", None)
    cfg, server = cfg_for(tiny_models, tmp_path, steps=3, ckpt_every=1, **objective), None
    if served:  # the served teacher's answers become tensors on the trainer's side
        teacher = tiny_models[1]
        server = start_server(TeacherApp(load_model(teacher, "teacher"), load_tokenizer(teacher, "teacher"), "t"))
        cfg = cfg.replace(teacher="", teacher_url=f"http://127.0.0.1:{server.server_address[1]}")
    try:
        train_mod.train(cfg, show_progress=False)
    finally:
        torch.set_default_device(None)
        if server is not None:
            stop_server(server)
    assert [r["step"] for r in step_records(tmp_path / "run")] == [0, 1, 2]


def test_device_option(tiny_models, tmp_path):
    from opd.models.loading import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device='gpu'"):
        cfg_for(tiny_models, tmp_path, device="gpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
        return
    assert resolve_device("auto") == torch.device("cpu")
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(UserError, match=f"--device {spec}: torch sees no CUDA GPU"):
            train_mod.setup(cfg_for(tiny_models, tmp_path, device=spec))


def test_cli_reports_user_errors_without_traceback(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd",
            "train",
            "--student",
            str(tmp_path / "missing"),
            "--teacher",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_new_run_over_an_old_one_is_refused(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, steps=1)
    train_mod.train(cfg, show_progress=False)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="already holds a run.*--resume"):
        train_mod.train(cfg, show_progress=False)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
