"""The vLLM paths' own checks, which need no vLLM: finding its environment, a server that fails to
start, the weights the engine is given (a LoRA adapter merged), and the options that go with it.
tests/test_vllm.py runs the same paths against a real vLLM server."""

from __future__ import annotations

import copy
import stat

import pytest
import torch

from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.models.loading import load_model
from opd.models.lora import apply_lora
from opd.rollout.vllm_engine import merged_weights
from opd.rollout.vllm_server import start_vllm_server, vllm_python


def test_a_missing_vllm_environment_names_the_setup_command(tmp_path, monkeypatch):
    monkeypatch.delenv("OPD_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("OPD_VLLM_ENV", str(tmp_path / "none"))
    with pytest.raises(
        UserError, match=r"vLLM is not set up: no Python at .*none \(OPD_VLLM_ENV\); run `opd vllm-setup`"
    ):
        vllm_python()
    monkeypatch.setenv("OPD_VLLM_PYTHON", str(tmp_path / "python"))
    with pytest.raises(UserError, match=r"OPD_VLLM_PYTHON=.*python; run `opd vllm-setup`"):
        vllm_python()


def test_a_server_that_exits_at_start_is_an_error_with_its_log(tiny_models, tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ValueError: this model needs more memory than VLLM_CPU_KVCACHE_SPACE'\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("OPD_VLLM_PYTHON", str(fake))
    with pytest.raises(
        UserError, match=r"(?s)vLLM server exited \(status 3\).*needs more memory than VLLM_CPU_KVCACHE"
    ):
        start_vllm_server(tiny_models[1], tmp_path / "server.log", timeout=60)
    with pytest.raises(UserError, match="is not a model directory"):
        start_vllm_server(tmp_path, tmp_path / "server.log")


def test_the_api_key_goes_to_the_server_in_its_environment_not_its_command_line(tiny_models, tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "argv: $*"\necho "key: $VLLM_API_KEY"\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("OPD_VLLM_PYTHON", str(fake))
    with pytest.raises(UserError):
        start_vllm_server(tiny_models[1], tmp_path / "server.log", api_key="sk-abc", max_logprobs=32, timeout=60)
    log = (tmp_path / "server.log").read_text()
    assert "key: sk-abc" in log and "--max-logprobs 32" in log and "sk-abc" not in log.split("key:")[0]


def test_lora_weights_reach_the_engine_merged_and_the_adapter_stays(tiny_models):
    model = apply_lora(load_model(tiny_models[0], "student"), 4, 16.0, ["all-linear"], 0.0, tiny_models[0])
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    before = model(input_ids=ids).logits
    sent = merged_weights(model)
    assert torch.equal(model(input_ids=ids).logits, before)  # unmerged again: training goes on as it was
    reference = copy.deepcopy(model).merge_and_unload()
    want = {k: v for k, v in reference.state_dict().items()}
    assert sent.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(sent[k], want[k], rtol=0, atol=1e-6)
    plain = load_model(tiny_models[0], "student")
    assert merged_weights(plain).keys() == plain.state_dict().keys()  # tied head included: vLLM refills it


def test_rollout_engine_options_are_checked(tiny_models):
    base = dict(student=str(tiny_models[0]), teacher=str(tiny_models[1]))
    with pytest.raises(ConfigError, match="rollout_engine='sglang': hf or vllm"):
        TrainConfig(**base, rollout_engine="sglang")
    with pytest.raises(ConfigError, match="add --rollout-engine vllm"):
        TrainConfig(**base, vllm_url="http://127.0.0.1:8000")
    with pytest.raises(ConfigError, match="not with --env, --tasks or --fsdp"):
        TrainConfig(**base, rollout_engine="vllm", fsdp=True)
    assert TrainConfig(**base, rollout_engine="vllm").vllm_max_gap == 1e-3
    assert TrainConfig(**base, rollout_engine="vllm", dtype="bfloat16").vllm_max_gap == 0.05


def test_prompts_and_responses_beyond_the_students_context_are_refused_before_the_engine_starts(tiny_models, tmp_path):
    from opd.models.loading import load_tokenizer
    from opd.rollout.vllm_engine import start_engine

    base = dict(student=str(tiny_models[0]), teacher=str(tiny_models[1]), rollout_engine="vllm")
    cfg = TrainConfig(**base, max_prompt_tokens=500, max_new_tokens=64)
    model = load_model(tiny_models[0], "student")  # max_position_embeddings 512
    with pytest.raises(
        UserError,
        match=r"--max-prompt-tokens 500 \+ --max-new-tokens 64 = 564 tokens exceed the student's context \(512",
    ):
        start_engine(model, load_tokenizer(tiny_models[0]), str(tiny_models[0]), tmp_path, cfg)
