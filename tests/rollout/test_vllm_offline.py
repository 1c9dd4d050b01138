"""The vLLM paths' own checks, which need no vLLM: finding its environment, a server that fails to
start, the weights the engine is given (a LoRA adapter merged), and the options that go with it.
tests/rollout/test_vllm.py runs the same paths against a real vLLM server."""

from __future__ import annotations

import copy
import dataclasses
import stat
from pathlib import Path

import pytest
import torch

from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.models.loading import load_model
from opd.models.lora import apply_lora
from opd.rollout.vllm_engine import VLLMRollout, merged_weights
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
    with pytest.raises(ConfigError, match="does not run with --fsdp yet"):
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


class _GreedyEngine(VLLMRollout):
    """A stand-in for the vLLM server: each request is answered by the model itself, re-encoding the
    whole prompt at every token (no cache), greedy, stopping at the request's stop tokens."""

    def __init__(self, model, tok):
        self.model, self.eos_id, self.pad_id = model, tok.eos_token_id, tok.pad_token_id
        self.stale, self.watched, self.max_gap, self.last_gap = False, True, 1e-4, float("nan")
        self.model_name = "student"
        self.requests: list[dict] = []

    def _complete(self, payloads):
        self.requests += payloads
        return [self._answer(p) for p in payloads]

    @torch.no_grad()
    def _answer(self, p):
        assert p["temperature"] == 0.0 and p["logprobs"] == 0 and p["return_token_ids"]
        ids, out, lps = list(p["prompt"]), [], []
        while len(out) < p["max_tokens"]:
            logp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0, -1].double(), -1)
            t = int(logp.argmax())
            ids.append(t), out.append(t), lps.append(float(logp[t]))
            if t in p["stop_token_ids"]:
                break
        return {"token_ids": out, "logprobs": {"token_logprobs": lps}}


# turns that end with EOS; turns cut at their cap, the last one cut by the episode's budget
@pytest.mark.parametrize(
    "limits", [dict(max_new_tokens=380, max_action_tokens=60), dict(max_new_tokens=54, max_action_tokens=3)]
)
def test_episodes_through_an_engine_equal_opds_own_loop(limits):
    """Multi-turn episodes whose turns an engine writes (one request per turn, the episode's text so far
    as its prompt) make the batch and records of opd's KV-cache loop, greedy, with or without the budget
    cutting episodes; each turn asks for at most what is left of its cap and the budget."""
    import opd
    from opd.envs import get_env
    from opd.models.loading import load_tokenizer
    from opd.rollout.episodes import EpisodeRollout
    from opd.rollout.vllm_episodes import VLLMEpisodeRollout

    demo = Path(opd.__file__).parent / "assets" / "demo" / "student"
    model, tok = load_model(demo, "student").eval(), load_tokenizer(demo, "student")
    env = get_env("toy", rooms=3, max_turns=5)
    games = env.games("train")[:4]
    ours = EpisodeRollout(model, tok).play(env, games, [0, 1, 2, 3], greedy=True, **limits)
    engine = _GreedyEngine(model, tok)
    theirs = VLLMEpisodeRollout(engine, tok).play(env, games, [0, 1, 2, 3], greedy=True, **limits)
    a, b = ours.batch, theirs.batch
    for field in (
        "input_ids_NL",
        "attention_mask_NL",
        "response_ids_NT",
        "response_mask_NT",
        "action_mask_NT",
        "finished_N",
    ):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    torch.testing.assert_close(b.logprobs_NT, a.logprobs_NT, rtol=0, atol=1e-4)
    assert [dataclasses.asdict(r) for r in theirs.records] == [dataclasses.asdict(r) for r in ours.records]
    assert engine.last_gap < 1e-4  # the policy check ran on every turn's tokens
    ends = {r.end for r in ours.records}
    assert ends == ({"budget"} if limits["max_action_tokens"] == 3 else {"max_turns"})
    assert bool((a.response_ids_NT.eq(tok.eos_token_id) & a.action_mask_NT).any()) == (
        limits["max_action_tokens"] == 60
    )
    assert len(engine.requests) == sum(e > s for r in ours.records for s, e in r.spans)  # a request per written turn
    assert all(0 < q["max_tokens"] <= limits["max_action_tokens"] for q in engine.requests)
    assert len({q["seed"] for q in engine.requests}) == len(engine.requests)
