"""API keys on the served teacher: ``opd serve-teacher --api-key`` (or ``OPD_API_KEY``) answers 401 in
vLLM's shape to requests under /v1 and /opd without a right bearer key, /health stays open, keys are
compared in constant time; the trainer sends its key from ``OPD_TEACHER_API_KEY`` or
``--teacher-api-key`` and never writes it anywhere. rollout/test_vllm.py runs the client against vLLM's own
``--api-key``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from helpers import files_holding, rollouts, run_options

from opd.config import TrainConfig, config_record
from opd.errors import UserError
from opd.models.loading import head_weight, load_model, load_tokenizer
from opd.teachers import app as app_mod
from opd.teachers.app import KeyCheck
from opd.teachers.client import HTTPTeacher
from opd.teachers.scoring import HFTeacher
from opd.teachers.server import Limits, TeacherApp, is_loopback, start_server, stop_server
from opd.training import loop as train_mod

KEYS = ["k-one-4d2a", "k-two-9be1"]


@pytest.fixture(scope="module")
def keyed(tiny_models):
    model, tok = load_model(tiny_models[1], "teacher"), load_tokenizer(tiny_models[1], "teacher")
    server = start_server(TeacherApp(model, tok, "t", Limits(max_k=16), api_keys=KEYS), "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_address[1]}", model, tok
    stop_server(server)


def ask(url: str, path: str, auth: str | None = None, body: dict | None = None) -> tuple[int, dict | None]:
    headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth is not None else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_only_a_right_bearer_key_is_let_in(keyed):
    url, _, _ = keyed
    assert ask(url, "/health")[0] == 200  # open, as vLLM's is
    refused = [
        None,
        "",
        "Bearer",
        "Bearer ",
        f"Basic {KEYS[0]}",
        f"Bearer {KEYS[0]}x",
        f"Bearer {KEYS[0]} ",
        "Bearer k",
    ]
    for path in ("/v1/models", "/opd/vocab", "/v1/no-such-route"):  # checked before routing, as vLLM does
        for auth in refused:
            assert ask(url, path, auth) == (401, {"error": "Unauthorized"}), (path, auth)
    for key in KEYS:
        for auth in (f"Bearer {key}", f"bearer {key}"):
            assert ask(url, "/v1/models", auth)[0] == 200
            assert ask(url, "/opd/vocab", auth)[0] == 200
    body = {"prompt": [[5, 6, 7]], "max_tokens": 1, "prompt_logprobs": 4}
    assert ask(url, "/v1/completions", None, body)[0] == 401
    status, answer = ask(url, "/v1/completions", f"Bearer {KEYS[1]}", body)
    assert status == 200 and len(answer["choices"][0]["prompt_logprobs"]) == 3


def test_every_key_is_compared_without_an_early_exit(monkeypatch):
    calls = []
    real = app_mod.hmac.compare_digest
    monkeypatch.setattr(app_mod.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    check = KeyCheck(["a1", "b2", "c3"])
    assert check.allows("/v1/models", "Bearer a1") and len(calls) == 3  # the first matched; all three compared
    assert not check.allows("/v1/models", "Bearer zz") and len(calls) == 6
    assert check.allows("/health", None) and KeyCheck().allows("/v1/models", None)
    for bad in ([""], [" padded "]):
        with pytest.raises(UserError, match="empty or has spaces around it"):
            KeyCheck(bad)


def test_the_client_sends_its_key_and_a_401_names_the_variable(keyed, tiny_models):
    url, model, tok = keyed
    rows = head_weight(model).shape[0]
    client = HTTPTeacher(url, tok, rows, api_key=KEYS[1], retries=0)
    assert client.vocab_verified  # /opd/vocab answered with the key
    batch = rollouts(tok, tiny_models[0], n=3, new_tokens=5)
    got, want = client.score(batch, 8), HFTeacher(model).score(batch, 8)
    m = batch.response_mask_NT
    assert (got.topk_ids_NTK[m] == want.topk_ids_NTK[m]).all()
    with pytest.raises(UserError, match=r"HTTP 401: Unauthorized; no API key was sent: .*OPD_TEACHER_API_KEY"):
        HTTPTeacher(url, tok, rows, retries=0)
    with pytest.raises(UserError, match="the API key sent was refused") as err:
        HTTPTeacher(url, tok, rows, api_key="wrong-key-55", retries=0)
    assert "wrong-key-55" not in str(err.value)


@pytest.mark.parametrize("given", ["config", "environment"])
def test_the_key_is_written_nowhere(tiny_models, tmp_path, monkeypatch, given):
    """config.json, metrics, rollouts, checkpoints: no byte of the key, however it was given."""
    secret = "sk-opd-never-on-disk-31a7"
    server = start_server(
        TeacherApp(load_model(tiny_models[1]), load_tokenizer(tiny_models[1]), "t", Limits(max_k=16), [secret])
    )
    keyed_url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        if given == "environment":
            monkeypatch.setenv("OPD_TEACHER_API_KEY", secret)
        cfg = TrainConfig.from_flat(
            student=str(tiny_models[0]),
            teacher_url=keyed_url,
            out=str(tmp_path / "run"),
            steps=2,
            batch_size=4,
            max_new_tokens=6,
            k=8,
            eval_every=0,
            eval_size=4,
            eval_samples=0,
            ckpt_every=1,
            **({"teacher_api_key": secret} if given == "config" else {}),
        )
        assert secret not in repr(cfg) and "teacher_api_key" not in config_record(cfg)
        train_mod.train(cfg, show_progress=False)
    finally:
        stop_server(server)
    files, holding = files_holding(tmp_path / "run", secret)
    assert (tmp_path / "run" / "config.json").is_file() and any("checkpoints" in str(p) for p in files)
    assert not holding
    assert "teacher_api_key" not in run_options(tmp_path / "run")


def test_cli_takes_several_keys_from_the_environment(tiny_models):
    env = {**os.environ, "OPD_API_KEY": " ".join(KEYS)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd", "serve-teacher", str(tiny_models[1]), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match and "2 API key(s)" in line and KEYS[0] not in line, line
        assert ask(match.group(0), "/v1/models")[0] == 401
        assert all(ask(match.group(0), "/v1/models", f"Bearer {k}")[0] == 200 for k in KEYS)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "without an API key" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_listening_beyond_loopback_without_a_key_warns():
    # A missing model stops the command right after the warning, before anything listens.
    env = {k: v for k, v in os.environ.items() if k != "OPD_API_KEY"}
    cmd = [sys.executable, "-m", "opd", "serve-teacher", "/no/such/teacher", "--host", "0.0.0.0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "warning: listening on 0.0.0.0 without an API key" in done.stderr and "OPD_API_KEY" in done.stderr
    keyed = subprocess.run(cmd, capture_output=True, text=True, env={**env, "OPD_API_KEY": "k"}, timeout=120)
    assert keyed.returncode == 2 and "without an API key" not in keyed.stderr
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "teacher.example")] == [False] * 4
