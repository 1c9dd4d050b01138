"""--vllm-sleep: the vLLM engine sleeps after each rollout and wakes before the next weight sync.

vLLM's sleep mode runs on GPUs only (the gpu test tests/gpu/test_vllm_sleep.py checks it on one), so here the
engine talks to a stand-in server over HTTP that keeps vLLM's rules with a copy of the student: asleep it answers no
completion; level 1 keeps its weights (in "CPU memory") and level 2 drops them (zeros here: uninitialised
memory in vLLM), so a level-2 engine woken without a sync answers from other weights than the student's
and the policy check stops the run (the stand-in's control: a sync skipped shows); a weights reload needs
the weights awake. Every request is recorded, in order."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import torch
from helpers import send_json
from safetensors.torch import load_file

from opd.config import ConfigError, EvalConfig, TrainConfig
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.engine import Sampling
from opd.rollout.served import SleepMode
from opd.rollout.vllm_engine import VLLMRollout, sleep_options
from opd.rollout.vllm_sync import FolderSync


class _StandIn(BaseHTTPRequestHandler):
    """vLLM's dev-mode server with sleep mode, answering greedily from ``model`` (see the module docstring)."""

    model: torch.nn.Module
    calls: list[str] = []
    asleep: set[str] = set()
    kept: dict | None = None  # level 1's copy of the weights

    def log_message(self, *args):
        pass

    _send = send_json

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "student"}]})

    def do_POST(self):
        cls, url = type(self), urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        query = parse_qs(url.query)
        cls.calls.append(url.path + (f"?{url.query}" if url.query else ""))
        if url.path == "/sleep":
            level = int(query.get("level", ["1"])[0])
            params = cls.model.state_dict()
            cls.kept = {k: v.clone() for k, v in params.items()} if level == 1 else None
            for v in params.values():
                v.zero_()  # the GPU memory freed: what a later wake finds there is not the weights
            cls.asleep = {"weights", "kv_cache"}
        elif url.path == "/wake_up":
            tags = set(query.get("tags", [])) or set(cls.asleep)
            if "weights" in tags & cls.asleep and cls.kept is not None:
                cls.model.load_state_dict(cls.kept)
            cls.asleep -= tags
        elif url.path == "/collective_rpc":
            if "weights" in cls.asleep:
                return self._send(500, {"error": {"message": "reload_weights while the weights sleep"}})
            state = load_file(f"{body['kwargs']['weights_path']}/model.safetensors")
            cls.model.load_state_dict(state, strict=False)
        elif url.path == "/v1/completions":
            if cls.asleep:
                return self._send(400, {"error": {"message": "the model is sleeping"}})
            return self._send(200, {"choices": [self._greedy(body)]})
        self._send(200, {})

    @torch.no_grad()
    def _greedy(self, p: dict) -> dict:
        ids, out, lps = list(p["prompt"]), [], []
        while len(out) < p["max_tokens"]:
            logp = torch.log_softmax(type(self).model(torch.tensor([ids])).logits[0, -1].double(), -1)
            t = int(logp.argmax())
            ids.append(t), out.append(t), lps.append(float(logp[t]))
            if t in p["stop_token_ids"]:
                break
        return {"token_ids": out, "logprobs": {"token_logprobs": lps}}


@pytest.fixture
def stand_in(tiny_models):
    """(student, tokenizer, url): the stand-in serving a copy of the student on a free port."""
    student, tok = load_model(tiny_models[0], "student"), load_tokenizer(tiny_models[0], "student")
    _StandIn.model, _StandIn.calls, _StandIn.asleep, _StandIn.kept = copy.deepcopy(student), [], set(), None
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield student, tok, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _engine(stand_in, tmp_path, level: int) -> tuple[VLLMRollout, torch.optim.Optimizer]:
    student, tok, url = stand_in
    engine = VLLMRollout(student, tok, tmp_path, url=url, sync=FolderSync("file", tmp_path / "w"), sleep=level)
    return engine, torch.optim.SGD(student.parameters(), lr=0.5)


def _train_step(student, optimizer, engine: VLLMRollout) -> None:
    """An optimizer step that changes the student's policy, the engine told so (as the trainer's update does)."""
    student(torch.tensor([[3, 4, 5]])).logits.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    engine.weights_changed()


def _rollout(engine: VLLMRollout, tok, gaps: list | None = None) -> list[str]:
    """A rollout of two prompts; the requests the server received for it (``gaps``: its policy check's, added)."""
    before = len(_StandIn.calls)
    prompts = [tok.encode("1+2=")[:6], tok.encode("3+4=")[:6]]
    batch = engine.generate(prompts, [1, 2], max_new_tokens=4, greedy=True)
    if gaps is not None:
        gaps.append(batch.report.policy_gap)
    return _StandIn.calls[before:]


SYNC = ["/collective_rpc", "/reset_prefix_cache"]
COMPLETE = ["/v1/completions"] * 2


def test_level_1_sleeps_after_each_rollout_and_wakes_before_the_sync(stand_in, tmp_path):
    student, tok, _ = stand_in
    engine, optimizer = _engine(stand_in, tmp_path, 1)
    assert _rollout(engine, tok) == [*SYNC, *COMPLETE, "/sleep?level=1"] and _StandIn.asleep
    _train_step(student, optimizer, engine)
    # the policy check passes: the engine serves the updated student
    gaps: list = []
    assert _rollout(engine, tok, gaps) == ["/wake_up", *SYNC, *COMPLETE, "/sleep?level=1"]
    assert gaps[0] is not None and gaps[0] < 1e-4
    # no step since: woken with the weights it kept, no sync
    assert _rollout(engine, tok) == ["/wake_up", *COMPLETE, "/sleep?level=1"]


def test_level_2_wakes_the_weights_syncs_then_wakes_the_cache(stand_in, tmp_path):
    student, tok, _ = stand_in
    engine, optimizer = _engine(stand_in, tmp_path, 2)
    assert _rollout(engine, tok) == [*SYNC, *COMPLETE, "/sleep?level=2"]
    _train_step(student, optimizer, engine)
    woken = ["/wake_up?tags=weights", *SYNC, "/wake_up?tags=kv_cache"]
    assert _rollout(engine, tok) == [*woken, *COMPLETE, "/sleep?level=2"]
    # no step since, but the weights were dropped: synced again
    gaps: list = []
    assert _rollout(engine, tok, gaps) == [*woken, *COMPLETE, "/sleep?level=2"]
    assert gaps[0] is not None and gaps[0] < 1e-4


def test_a_level_2_engine_woken_without_its_weights_fails_the_policy_check(stand_in, tmp_path, monkeypatch):
    """The stand-in's control: were the weights not synced after a level-2 sleep, the run would stop."""
    _, tok, _ = stand_in
    engine, _ = _engine(stand_in, tmp_path, 2)
    _rollout(engine, tok)

    def keeps_weights(self) -> bool:  # its sleep claims to keep the weights: the next wake does not sync
        self.post("/sleep?level=2")
        self.asleep = True
        return False

    monkeypatch.setattr(SleepMode, "sleep", keeps_weights)
    _rollout(engine, tok)
    with pytest.raises(UserError, match="does not serve the policy being trained"):
        _rollout(engine, tok)


def test_an_episode_session_sleeps_when_it_closes(stand_in, tmp_path):
    _, tok, _ = stand_in
    engine, _ = _engine(stand_in, tmp_path, 1)
    session = engine.episodes([tok.encode("1+2=")], [1], budget=8, sampling=Sampling(greedy=True))
    assert _StandIn.calls == SYNC
    session.close()
    assert _StandIn.calls == [*SYNC, "/sleep?level=1"]


def test_a_refused_sleep_names_the_option_and_what_it_needs(stand_in, tmp_path, monkeypatch):
    _, tok, _ = stand_in
    engine, _ = _engine(stand_in, tmp_path, 1)
    real = _StandIn.do_POST

    def no_sleep_mode(self):
        if self.path.startswith("/sleep"):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            return self._send(500, {"error": {"message": "Sleep mode is not enabled"}})
        return real(self)

    monkeypatch.setattr(_StandIn, "do_POST", no_sleep_mode)
    with pytest.raises(UserError, match=r"/sleep\?level=1 failed .*--vllm-sleep needs vLLM's sleep mode"):
        _rollout(engine, tok)


def test_a_failed_rollout_leaves_the_engine_awake_and_its_error_raised(stand_in, tmp_path, monkeypatch):
    """No /sleep after a failed request (its own failure would replace the error; a dead server would be
    restarted only to sleep); the next rollout, woken or not, goes on as usual."""
    _, tok, _ = stand_in
    engine, _ = _engine(stand_in, tmp_path, 1)
    real = _StandIn.do_POST

    def no_completion(self):
        if self.path.startswith("/v1/completions"):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            return self._send(400, {"error": {"message": "the request is refused"}})
        return real(self)

    monkeypatch.setattr(_StandIn, "do_POST", no_completion)
    with pytest.raises(UserError, match="the request is refused"):
        _rollout(engine, tok)
    session = engine.episodes([tok.encode("1+2=")], [1], budget=8, sampling=Sampling(greedy=True))
    with pytest.raises(UserError, match="the request is refused"):
        session.turn({0: 4}, lambda done: None)
    session.close()
    assert not any(c.startswith("/sleep") for c in _StandIn.calls) and not _StandIn.asleep
    monkeypatch.setattr(_StandIn, "do_POST", real)
    assert _rollout(engine, tok) == [*COMPLETE, "/sleep?level=1"]  # awake, with the weights it has


def test_sleep_options_are_checked():
    assert (
        TrainConfig.from_flat(rollout_engine="vllm", vllm_args="--enable-sleep-mode").rollout.vllm_sleep == 1
    )  # vLLM's words
    assert (
        TrainConfig.from_flat(rollout_engine="vllm", vllm_sleep=2, vllm_args="--enable-sleep-mode").rollout.vllm_sleep
        == 2
    )
    assert TrainConfig.from_flat(rollout_engine="vllm").rollout.vllm_sleep == 0
    assert (
        TrainConfig.from_flat(rollout_engine="vllm", vllm_sleep=2, lora_r=4).rollout.vllm_sync == "auto"
    )  # auto picks shm or file
    vllm = dict(rollout_engine="vllm")
    by_args = dict(vllm, vllm_args="--enable-sleep-mode")
    for kw, match in (
        (dict(vllm, vllm_sleep=3), "vllm_sleep=3 must be 0"),
        (dict(vllm_sleep=1), "--vllm-sleep set but rollout_engine is hf"),
        (dict(vllm, vllm_sleep=1, vllm_url="http://127.0.0.1:9"), "drop one of them"),
        # what the config alone shows is refused when it is made, naming the option the user gave
        (dict(vllm, vllm_sleep=1, max_staleness=1), "^--vllm-sleep 1 with --max-staleness: .*never rests"),
        (dict(by_args, max_staleness=1), "^--vllm-args --enable-sleep-mode with --max-staleness"),
        (
            dict(vllm, vllm_sleep=2, lora_r=4, vllm_sync="adapter"),
            "^--vllm-sleep 2 drops the engine's weights and --vllm-sync adapter",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            TrainConfig.from_flat(**kw)
    cfg = TrainConfig.from_flat(rollout_engine="vllm", vllm_sleep=2)
    assert sleep_options(cfg.rollout, True, []) == ["--enable-sleep-mode"]
    assert sleep_options(cfg.rollout, True, ["--enable-sleep-mode"]) == []
    assert sleep_options(TrainConfig.from_flat(rollout_engine="vllm").rollout, False, []) == []
    with pytest.raises(UserError, match="^--vllm-sleep 2: vLLM's sleep mode runs on GPUs only"):
        sleep_options(cfg.rollout, False, [])
    with pytest.raises(UserError, match="^--vllm-args --enable-sleep-mode: vLLM's sleep mode runs on GPUs only"):
        sleep_options(TrainConfig.from_flat(**by_args).rollout, False, ["--enable-sleep-mode"])


def test_opd_eval_refuses_the_sleep_mode():
    """opd eval has no trainer to free the GPU for; vLLM's own flag is passed through, as it always was."""
    with pytest.raises(ConfigError, match="^--vllm-sleep 1: opd eval has no trainer"):
        EvalConfig.from_flat(student="s", rollout_engine="vllm", vllm_sleep=1)
    assert (
        EvalConfig.from_flat(student="s", rollout_engine="vllm", vllm_args="--enable-sleep-mode").rollout.vllm_sleep
        == 0
    )
