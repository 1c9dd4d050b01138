"""The served teacher on loopback: vLLM format, equality with the in-process teacher, batching under
load (64 clients, none refused), bad requests, timeouts, bugs and signals, and the trainer's client
(errors, vocabulary checks, a training run). Both answer formats between opd's ends: vLLM's JSON and
opd's binary one (test_serve_wire.py has more)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import http.client
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import rollouts, send_json

from opd.config import TrainConfig
from opd.errors import UserError
from opd.models.loading import head_weight, load_model, load_tokenizer
from opd.teachers import app as app_mod
from opd.teachers import factory as teacher_factory
from opd.teachers import wire
from opd.teachers.batching import BatchScorer
from opd.teachers.client import HTTPTeacher
from opd.teachers.completions import RequestError
from opd.teachers.factory import make_teacher
from opd.teachers.scoring import HFTeacher
from opd.teachers.server import Limits, TeacherApp, start_server, stop_server
from opd.training import loop as train_mod

real_encode = wire.encode_scores


@pytest.fixture(scope="module")
def served(tiny_models):
    """(url, app, teacher model, tokenizer) of an opd teacher server on 127.0.0.1, a free port."""
    student, teacher = tiny_models
    model, tok = load_model(teacher, "teacher"), load_tokenizer(teacher, "teacher")
    app = TeacherApp(model, tok, "tiny-teacher", Limits(max_k=64, max_prompt_tokens=128, max_prompts=32))
    server = start_server(app, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_address[1]}", app, model, tok
    stop_server(server)


def post(url: str, body, raw: bool = False) -> tuple[int, dict]:
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def run_threads(threads: list[threading.Thread], timeout: float = 60) -> float:
    """Start every client thread, wait for each (bounded), and return the seconds they took."""
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return time.monotonic() - t0


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_scores_equal_in_process_teacher(served, tiny_models, binary):
    url, app, model, tok = served
    batch = rollouts(tok, tiny_models[0])
    client = HTTPTeacher(url, tok, head_weight(model).shape[0], prompts_per_request=2, binary=binary)
    assert client.vocab_verified and client.binary == binary  # opd's server offers the binary answer
    got, want = client.score(batch, 8), HFTeacher(model).score(batch, 8)
    m = batch.response_mask_NT
    assert torch.equal(got.topk_ids_NTK[m], want.topk_ids_NTK[m])
    torch.testing.assert_close(got.topk_logprobs_NTK[m], want.topk_logprobs_NTK[m].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.sampled_logprobs_NT[m], want.sampled_logprobs_NT[m].float(), atol=1e-5, rtol=0)
    assert got.diag_logits_MV is None and got.query_logprobs_NTQ is None


def test_answer_is_vllm_prompt_logprobs_format(served):
    url, app, model, tok = served
    seqs = [tok("Compute 12 + 7.")["input_ids"], tok("Compute 3 * 4 - 5, then add 9.")["input_ids"]]
    status, ans = post(url, {"model": "tiny-teacher", "prompt": seqs, "max_tokens": 1, "prompt_logprobs": 5})
    assert status == 200 and ans["object"] == "text_completion" and ans["model"] == "tiny-teacher"
    assert [c["index"] for c in ans["choices"]] == [0, 1]
    assert ans["usage"]["prompt_tokens"] == sum(len(s) for s in seqs)
    for seq, choice in zip(seqs, ans["choices"]):
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(seq) and plp[0] is None
        # Reference: the model's own full logits, a different code path from the server's.
        ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)
        for j in range(1, len(seq)):
            entry, given = plp[j], seq[j]
            assert str(given) in entry and len(entry) in (5, 6)
            for tid, v in entry.items():
                row = ref[j - 1]
                assert abs(v["logprob"] - float(row[int(tid)])) < 1e-4
                assert v["rank"] == 1 + int((row > row[int(tid)] + 1e-9).sum())
                assert v["decoded_token"] == tok.decode([int(tid)])
            top5 = sorted(int(t) for t in row.topk(5).indices)
            assert sorted(int(t) for t, v in entry.items() if v["rank"] <= 5) == top5
    # opd's extension: only positions from opd_logprobs_from on, the same values as the full answer.
    status, part = post(url, {"prompt": seqs, "max_tokens": 1, "prompt_logprobs": 5, "opd_logprobs_from": [4, 7]})
    assert status == 200
    for start, full, short in zip([4, 7], ans["choices"], part["choices"], strict=True):
        assert short["prompt_logprobs"][:start] == [None] * start
        for a, b in zip(full["prompt_logprobs"][start:], short["prompt_logprobs"][start:], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t]["logprob"] - b[t]["logprob"]) < 1e-5 for t in a)


def test_bad_requests_get_4xx_and_server_keeps_serving(served):
    url, app, model, tok = served
    V = head_weight(model).shape[0]
    good = {"prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 4}
    bad = [
        (b"{not json", True, 400, "not valid JSON"),
        (b"[1, 2]", True, 400, "JSON object"),
        ({"max_tokens": 1, "prompt_logprobs": 4}, False, 400, "missing 'prompt'"),
        ({**good, "prompt_logprobs": 65}, False, 422, "--max-k"),
        ({**good, "prompt_logprobs": 0}, False, 422, "outside [1,"),
        ({**good, "prompt_logprobs": "8"}, False, 400, "integer"),
        ({**good, "prompt": [1, V, 2]}, False, 422, f"[0, {V})"),
        ({**good, "prompt": [1, -3]}, False, 422, "token id -3"),
        ({**good, "prompt": [[1, 2], []]}, False, 400, "prompt 1 has 0 tokens"),
        ({**good, "prompt": list(range(129))}, False, 413, "--max-prompt-tokens"),
        ({**good, "prompt": [[1, 2]] * 33}, False, 413, "--max-prompts"),
        ({**good, "max_tokens": 16}, False, 422, "max_tokens"),
        ({**good, "model": "other"}, False, 404, "does not exist"),
        ({**good, "opd_logprobs_from": 0}, False, 422, "opd_logprobs_from"),
        ({**good, "opd_logprobs_from": [1, 2]}, False, 422, "one integer per prompt"),
    ]
    for body, raw, status, words in bad:
        got, ans = post(url, body, raw)
        assert got == status and words in ans["error"]["message"], (body, got, ans)
        assert ans["error"]["type"] and ans["error"]["code"] == status
    huge = b'{"prompt": [' + b"1," * (app.limits.max_body_bytes // 2) + b"1]}"
    assert post(url, huge, raw=True)[0] == 413
    host, port = url.removeprefix("http://").split(":")
    with contextlib.closing(http.client.HTTPConnection(host, int(port), timeout=30)) as conn:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Length", "lots")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and "Content-Length" in json.loads(resp.read())["error"]["message"]
    with contextlib.closing(http.client.HTTPConnection(host, int(port), timeout=30)) as conn:
        conn.request("POST", "/v2/score", body=json.dumps(good))
        resp = conn.getresponse()
        assert resp.status == 404 and "POST /v1/completions" in json.loads(resp.read())["error"]["message"]
    status, ans = post(url, good)
    assert status == 200 and len(ans["choices"][0]["prompt_logprobs"]) == 3
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200


def test_load_many_concurrent_clients(served):
    url, app, model, tok = served
    seqs = [tok(f"Compute {i} * {i + 3} + {2 * i}.")["input_ids"] for i in range(4)]
    errors, done = [], []
    batches_before = app.scorer.batches
    stop_at = time.monotonic() + 3.0

    def client():
        while time.monotonic() < stop_at:
            try:
                status, ans = post(url, {"prompt": seqs, "max_tokens": 1, "prompt_logprobs": 8})
                ok = status == 200 and len(ans["choices"]) == len(seqs)
                (done if ok else errors).append(status)
            except Exception as exc:  # every failure counts, whatever its kind
                errors.append(repr(exc))

    threads = [threading.Thread(target=client) for _ in range(8)]
    elapsed = run_threads(threads)
    batches = app.scorer.batches - batches_before
    print(
        f"\nload test: {len(done)} requests in {elapsed:.1f} s = {len(done) / elapsed:.1f} requests/s "
        f"({len(done) * len(seqs) / elapsed:.1f} sequences/s), {batches} forward passes, {len(errors)} errors"
    )
    assert errors == [] and len(done) > 0
    assert batches < len(done)  # concurrent requests were merged into shared forward passes


def test_64_clients_are_all_answered(served):
    """The standard library's server (listen backlog 5) reset about 1.3% of 64 clients' connections:
    here every request is answered, with the numbers of a request sent alone, in both formats."""
    url, app, model, tok = served
    seqs = [tok(f"Compute {i} + {5 * i} * 3.")["input_ids"] for i in range(3)]
    data = json.dumps({"prompt": seqs, "max_tokens": 1, "prompt_logprobs": 8}).encode()

    def ask(binary: bool):
        headers = {"Content-Type": "application/json", **({"Accept": wire.MEDIA_TYPE} if binary else {})}
        req = urllib.request.Request(url + "/v1/completions", data=data, headers=headers)
        with urllib.request.urlopen(req, timeout=60) as r:  # a new connection each time, as opd's client does
            body = r.read()
        if binary:
            return wire.decode_scores(body, [len(s) - 1 for s in seqs], 8, app.vocab_rows)
        return [c["prompt_logprobs"] for c in json.loads(body)["choices"]]

    def same(binary: bool, got, want) -> bool:
        if binary:
            return torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], atol=1e-5, rtol=0)
        pairs = [(g, w) for gp, wp in zip(got, want, strict=True) for g, w in zip(gp[1:], wp[1:], strict=True)]
        return all(
            g.keys() == w.keys() and all(abs(g[t]["logprob"] - w[t]["logprob"]) < 1e-5 for t in w) for g, w in pairs
        )

    want = {binary: ask(binary) for binary in (False, True)}  # each request alone
    errors, answers = [], [0] * 64
    stop_at = time.monotonic() + 3.0

    def client(i: int):
        binary = i % 2 == 1
        while time.monotonic() < stop_at:
            try:
                if same(binary, ask(binary), want[binary]):
                    answers[i] += 1
                else:
                    errors.append(f"client {i}: a wrong {'binary' if binary else 'JSON'} answer")
            except Exception as exc:  # refused, reset, an HTTP error: every failure counts
                errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    elapsed = run_threads(threads)
    print(f"\n64 clients: {sum(answers)} answers in {elapsed:.1f} s, {len(errors)} errors {sorted(set(errors))[:3]}")
    assert errors == [] and min(answers) >= 1  # every client answered, every answer right
    assert not any(t.is_alive() for t in threads)


def test_timeouts_bugs_and_oversized_bodies_leave_the_server_serving(served, monkeypatch):
    url, app, model, tok = served
    good = {"prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 4}
    # A forward pass slower than the request timeout: 503, and a request that times out still
    # queued is never scored.
    release, calls, real_run = threading.Event(), [], app.scorer._run

    def stalled(jobs):
        calls.append([s for j in jobs for s in j.seqs])
        release.wait(30)
        real_run(jobs)

    monkeypatch.setattr(app.scorer, "_run", stalled)
    with monkeypatch.context() as m:
        m.setattr(app.limits, "request_timeout", 0.3)
        for prompt in ([5, 6, 7], [8, 9, 10]):  # the first stalls the worker; the second waits in the queue
            status, ans = post(url, {**good, "prompt": prompt})
            assert status == 503 and "retry later" in ans["error"]["message"], ans
            assert ans["error"]["type"] == "ServiceUnavailableError"
    release.set()
    assert post(url, {**good, "prompt": [1, 2, 3]})[0] == 200
    assert calls == [[[5, 6, 7]], [[1, 2, 3]]]  # [8, 9, 10] was dropped unscored
    # A bug in a request's path: a 500 with a JSON error, and the next request is answered.
    with monkeypatch.context() as m:
        m.setattr(app_mod, "completion_response", lambda *a: 1 / 0)
        status, ans = post(url, good)
        assert status == 500 and "ZeroDivisionError" in ans["error"]["message"] and ans["error"]["code"] == 500
    assert post(url, good)[0] == 200
    # A body without Content-Length (chunked) is bounded too; a chunked good one is answered. The
    # oversized body is small (a lowered limit) and crosses the limit only with its last, tiny chunk:
    # the server answers 413 and closes as soon as it is over, and a client still sending a large
    # remainder would get a reset instead of the answer (a race of the test, not of the server).
    host, port = url.removeprefix("http://").split(":")
    with monkeypatch.context() as m:
        m.setattr(app.limits, "max_prompts", 1)
        m.setattr(app.limits, "max_prompt_tokens", 16)
        limit = app.limits.max_body_bytes
        head = b'{"prompt": [' + b"1," * ((limit - 12) // 2)  # exactly at or just under the limit
        for chunks, status, words in (
            ([json.dumps(good).encode()[:9], json.dumps(good).encode()[9:]], 200, "prompt_logprobs"),
            ([head, b"1,1,1,"], 413, f"request body exceeds {limit} bytes"),
        ):
            with contextlib.closing(http.client.HTTPConnection(host, int(port), timeout=30)) as conn:
                conn.request("POST", "/v1/completions", body=iter(chunks), encode_chunked=True)
                resp = conn.getresponse()
                assert resp.status == status and words in resp.read().decode()
    with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port} .*pick another --port"):
        start_server(app, "127.0.0.1", int(port))  # the served one holds it
    with pytest.raises(UserError, match="pick another --port"):
        start_server(app, "127.0.0.1", 70000)
    assert post(url, good)[0] == 200


def test_training_with_served_teacher_matches_in_process(served, tiny_models, tmp_path, monkeypatch):
    url, app, model, tok = served
    student, teacher = tiny_models
    common = dict(
        student=str(student),
        steps=2,
        batch_size=4,
        max_new_tokens=8,
        eval_size=4,
        eval_samples=0,
        k=8,
        warmup_steps=1,
        log_rollouts=2,
        diag_positions=16,
        eval_every=0,
        ckpt_every=0,
        lr=3e-3,
    )
    encoded = []  # binary answers the server wrote, so the test knows which format each run used
    monkeypatch.setattr(wire, "encode_scores", lambda *a: encoded.append(1) or real_encode(*a))
    losses, counts = {}, {}
    for name, extra in (
        ("local", {"teacher": str(teacher)}),
        ("binary", {"teacher_url": url}),
        ("json", {"teacher_url": url}),
    ):
        # make_teacher builds the client; the JSON run gets one that declines the binary answer
        client = functools.partial(HTTPTeacher, binary=False) if name == "json" else HTTPTeacher
        monkeypatch.setattr(teacher_factory, "HTTPTeacher", client)
        out, before = tmp_path / name, len(encoded)
        train_mod.train(TrainConfig.from_flat(out=str(out), **common, **extra), show_progress=False)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name], counts[name] = [r for r in records if "train/loss" in r], len(encoded) - before
    assert counts["local"] == counts["json"] == 0 and counts["binary"] >= 2  # at least one request a step
    for answers in ("binary", "json"):
        for a, b in zip(losses["local"], losses[answers], strict=True):
            assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
            assert a["diag/reward_mean"] == pytest.approx(b["diag/reward_mean"], rel=1e-4, abs=1e-6)
        assert "diag/overlap" in losses["local"][0] and "diag/overlap" not in losses[answers][0]


def test_unreachable_server_is_a_clear_error_quickly(tiny_models):
    tok = load_tokenizer(tiny_models[0])
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"unreachable after 2 attempts.*opd serve-teacher"):
        HTTPTeacher(f"http://127.0.0.1:{port}", tok, 100, timeout=1.0, retries=1, backoff=0.01)
    assert time.monotonic() - t0 < 5
    with pytest.raises(UserError, match="http://"):
        HTTPTeacher("127.0.0.1:8000", tok, 100)


def test_vocabulary_mismatch_is_refused(served):
    url, app, model, tok = served

    class OtherTokenizer:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    with pytest.raises(UserError, match="vocabulary .* differs from the student's"):
        HTTPTeacher(url, OtherTokenizer(), head_weight(model).shape[0], retries=0)


def test_options_a_served_teacher_cannot_do_are_refused(tiny_models):
    student, teacher = tiny_models
    base = dict(student=str(student), teacher_url="http://127.0.0.1:9")
    for kw in ({"objective": "full_kl"}, {"objective": "lsm", "support": "union"}):
        with pytest.raises(UserError, match="does not return; with --teacher-url use --objective sampled"):
            make_teacher(TrainConfig.from_flat(**base, **kw), None, None)
    with pytest.raises(UserError, match="both --teacher and --teacher-url"):
        make_teacher(TrainConfig.from_flat(**base, teacher=str(teacher)), None, None)


class _Foreign(BaseHTTPRequestHandler):
    """A stand-in for a foreign (non-opd) server: no /opd/vocab, and a canned completions answer."""

    answer: dict = {}
    tokenize = None  # None: no /tokenize endpoint (404); else a function of the text, giving its ids
    failures = 0  # answer this many POSTs with a 503 first
    accepts: list = []  # the Accept header of every POST

    def log_message(self, *args):
        pass

    _send = send_json

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "foreign"}]})
        self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/tokenize":  # vLLM's endpoint, outside /v1
            if type(self).tokenize is None:
                return self._send(404, {"detail": "Not Found"})
            return self._send(200, {"tokens": type(self).tokenize(json.loads(body)["prompt"])})
        type(self).accepts.append(self.headers.get("Accept"))
        if type(self).failures > 0:
            type(self).failures -= 1
            return self._send(503, {"error": {"message": "busy, try later"}})
        self._send(200, type(self).answer)


def test_foreign_server_warns_and_malformed_answers_are_errors(served, tiny_models, capsys):
    url, app, model, tok = served
    batch = rollouts(tok, tiny_models[0], n=2, new_tokens=4)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Foreign)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        foreign = f"http://127.0.0.1:{server.server_address[1]}"
        client = HTTPTeacher(foreign, tok, head_weight(model).shape[0], retries=0)
        warned = capsys.readouterr().err.splitlines()
        assert len(warned) == 1 and "its tokenizer could not be checked" in warned[0]  # one line, no source line
        assert not client.binary  # a foreign server is asked in vLLM's JSON, and never sent opd's Accept
        # A real answer from opd's server, relayed: the client must accept it as a vLLM answer.
        seqs = [batch.input_ids_NL[i][batch.attention_mask_NL[i].bool()].tolist() for i in range(2)]
        _, real = post(url, {"prompt": seqs, "max_tokens": 1, "prompt_logprobs": 4})
        _Foreign.answer = real
        relayed, local = client.score(batch, 4), HFTeacher(model).score(batch, 4)
        assert torch.equal(relayed.topk_ids_NTK, local.topk_ids_NTK)
        assert torch.allclose(relayed.sampled_logprobs_NT, local.sampled_logprobs_NT, atol=1e-5)
        patient = HTTPTeacher(foreign, tok, head_weight(model).shape[0], retries=2, backoff=0.01)
        _Foreign.failures = 2  # a 5xx is retried with backoff...
        assert torch.equal(patient.score(batch, 4).topk_ids_NTK, local.topk_ids_NTK)
        assert _Foreign.failures == 0  # both 5xx answers were consumed by retries
        _Foreign.failures = 1  # ...until the retries run out
        with pytest.raises(UserError, match="answered HTTP 503: busy, try later"):
            client.score(batch, 4)
        _Foreign.failures = 0
        small = HTTPTeacher(foreign, tok, 3, retries=0)  # a "student" whose vocabulary has 3 tokens
        with pytest.raises(UserError, match=r"outside the student's vocabulary \[0, 3\)"):
            small.score(batch, 4)
        # A NaN log-prob (JSON allows it) would be masked by the losses as a -inf is: refused instead,
        # for a top-K entry and for the given token's entry (the sampled-token objective reads it).
        P = batch.prompt_len - int((~batch.attention_mask_NL[0, : batch.prompt_len].bool()).sum())
        for which in ("top", "given"):
            nan = copy.deepcopy(real)
            entry, given = nan["choices"][0]["prompt_logprobs"][P], str(seqs[0][P])
            if which == "given":
                entry[given]["logprob"] = math.nan
            else:
                next(v for tid, v in entry.items() if tid != given)["logprob"] = math.nan
            _Foreign.answer = nan
            with pytest.raises(UserError, match="malformed prompt_logprobs answer"):
                client.score(batch, 4)
        _Foreign.answer = post(url, {"prompt": seqs, "max_tokens": 1, "prompt_logprobs": 2})[1]
        with pytest.raises(UserError, match=r"returned [23] top tokens where --k 4"):
            client.score(batch, 4)
        _Foreign.answer = {"choices": [{"index": 0, "text": ""}]}
        with pytest.raises(UserError, match="malformed prompt_logprobs answer"):
            client.score(batch, 4)
        assert _Foreign.accepts and wire.MEDIA_TYPE not in _Foreign.accepts
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_serve_teacher_port_zero_stops_cleanly_on_a_signal(tiny_models, sig):
    """``kill`` or Ctrl-C: the request in flight is answered, then the server exits with 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd", "serve-teacher", str(tiny_models[1]), "--port", "0", "--batch-wait-ms", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # the server prints its address once it listens
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert "float32, requests up to 512 tokens" in line  # --dtype auto on a CPU; the model's context
        with urllib.request.urlopen(f"{match.group(0)}/health", timeout=30) as r:
            assert r.status == 200
        answered = []
        request = {"prompt": [[5, 6, 7, 8]], "max_tokens": 1, "prompt_logprobs": 4}
        in_flight = threading.Thread(target=lambda: answered.append(post(match.group(0), request)))
        in_flight.start()
        time.sleep(1.0)  # accepted by now, and waiting 2 s in the batcher for company
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        in_flight.join(timeout=30)
        assert answered and answered[0][0] == 200 and len(answered[0][1]["choices"]) == 1
        assert proc.returncode == 0 and "Traceback" not in err, (proc.returncode, err)
        # uvicorn's start-up and access lines stay out of the terminal without --verbose
        assert out == "" and "Started server process" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_failing_request_does_not_fail_the_requests_batched_with_it(served):
    _, _, model, _ = served

    calls = []  # the jobs of each _run call, so the test knows the two requests really shared a batch

    class Flaky(BatchScorer):
        def _run(self, jobs):
            calls.append(len(jobs))
            if any(j.seqs == [[7, 7, 7]] for j in jobs):
                raise RuntimeError("poisoned")
            super()._run(jobs)

    scorer = Flaky(model, Limits(batch_wait_ms=500))  # long enough for both requests to share a batch
    try:
        got = {}
        both_ready = threading.Barrier(2)

        def ask(name, seqs):
            both_ready.wait(timeout=30)
            try:
                got[name] = asyncio.run(scorer.score(seqs, 4))
            except RequestError as exc:
                got[name] = exc

        threads = [
            threading.Thread(target=ask, args=("bad", [[7, 7, 7]])),
            threading.Thread(target=ask, args=("good", [[5, 6, 7, 8]])),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert isinstance(got["bad"], RequestError) and "poisoned" in str(got["bad"])
        assert not isinstance(got["good"], RequestError) and len(got["good"]) == 1
        # one batch of both (it fails), then each alone: the bad one fails again, the good one is scored
        assert calls == [2, 1, 1] and scorer.batches == 1
    finally:
        scorer.close()


def test_a_server_with_tokenize_is_probed_id_for_id(tiny_models, tiny_tokenizer):
    """vLLM's ``POST /tokenize``: the probe texts tokenized there must match opd's tokenizer id for id."""
    tok = load_tokenizer(tiny_models[0])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Foreign)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _Foreign.tokenize = lambda text: tok(text, add_special_tokens=False)["input_ids"]
        assert not HTTPTeacher(url, tok, len(tok), retries=0).vocab_verified  # same tokenizer: accepted, silently
        # one special token renumbered: only the probe holding it differs
        eos = tok.eos_token_id
        _Foreign.tokenize = lambda text: [
            t + 1 if t == eos else t for t in tok(text, add_special_tokens=False)["input_ids"]
        ]
        with pytest.raises(
            UserError, match=rf"tokenizes differently.*\(id {eos + 1} there, {eos} here\).*--teacher-tokenizer"
        ):
            HTTPTeacher(url, tok, len(tok), retries=0)
    finally:
        _Foreign.tokenize = None
        server.shutdown()
        server.server_close()


def test_dtype_auto_is_the_checkpoints_on_a_gpu_and_float32_on_a_cpu(tmp_path):
    from opd.models.precision import auto_dtype

    for key, saved in (("dtype", "bfloat16"), ("torch_dtype", "float16")):
        (tmp_path / "config.json").write_text(json.dumps({key: saved}))
        assert auto_dtype(tmp_path, "auto", torch.device("cuda")) == saved
        assert auto_dtype(tmp_path, "auto", torch.device("cpu")) == "float32"
    assert auto_dtype(tmp_path, "bfloat16", torch.device("cpu")) == "bfloat16"  # as given
