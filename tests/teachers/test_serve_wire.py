"""opd's binary answer (``opd.teachers.wire``) between its own client and server: the codec's checks, the same
numbers as the JSON answer, the negotiation (foreign and older servers keep JSON), and the
guarantees of the JSON path on the binary one (retries, clear errors, a failing request failing
alone)."""

from __future__ import annotations

import json
import math
import struct
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import rollouts

from opd.errors import UserError
from opd.models.loading import head_weight, load_model, load_tokenizer
from opd.teachers import wire
from opd.teachers.batching import BatchScorer
from opd.teachers.client import HTTPTeacher
from opd.teachers.scoring import HFTeacher
from opd.teachers.server import Limits, TeacherApp, start_server, stop_server


@pytest.fixture(scope="module")
def served(tiny_models):
    """(url, app, teacher model, tokenizer) of an opd teacher server on 127.0.0.1, a free port."""
    model, tok = load_model(tiny_models[1], "teacher"), load_tokenizer(tiny_models[1], "teacher")
    server = start_server(TeacherApp(model, tok, "tiny-teacher", Limits(max_k=64)), "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_address[1]}", server.app, model, tok
    stop_server(server)


def post(url: str, payload: dict, accept: str | None = wire.MEDIA_TYPE) -> tuple[int, str, bytes]:
    """(status, media type, body) of one completions request."""
    headers = {"Content-Type": "application/json", **({"Accept": accept} if accept else {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(payload).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get_content_type(), r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get_content_type(), err.read()


def encoded(rows_S, k, seed=0):
    """A valid answer of random numbers: (body, ids, log-probs, given log-probs)."""
    g = torch.Generator().manual_seed(seed)
    R = sum(rows_S)
    ids = torch.randint(0, 100, (R, k), generator=g)
    lps = -torch.rand(R, k, generator=g).mul(20).sort(-1).values
    given = -torch.rand(R, generator=g).mul(20)
    if R:
        lps[0, -1], given[0] = -math.inf, -math.inf  # a float32 softmax can underflow: allowed
    return wire.encode_scores(rows_S, ids, lps, given), ids, lps, given


def test_codec_round_trip_is_exact_and_bad_bodies_are_refused():
    body, ids, lps, given = encoded([3, 0, 5], 4)
    got = wire.decode_scores(body, [3, 0, 5], 4, vocab_rows=100)
    assert got[0].dtype == torch.int64 and torch.equal(got[0], ids)
    assert torch.equal(got[1], lps) and torch.equal(got[2], given)
    assert len(body) == 20 + 4 * 3 + 8 * (8 * 4) + 4 * 8  # header, rows, ids + log-probs, given: nothing else
    empty = wire.encode_scores([0], torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), torch.zeros(0))
    assert [t.shape for t in wire.decode_scores(empty, [0], 2, 100)] == [(0, 2), (0, 2), (0,)]

    def patched(offset, fmt, value):
        return body[:offset] + struct.pack(fmt, value) + body[offset + struct.calcsize(fmt) :]

    ids_at, lps_at = 20 + 4 * 3, 20 + 4 * 3 + 8 * 4 * 4
    bad = [
        (body[:10], [3, 0, 5], 4, "shorter than the 20-byte header"),
        (b"JSON" + body[4:], [3, 0, 5], 4, "magic b'JSON'"),
        (patched(4, "<I", 2), [3, 0, 5], 4, "version 2"),
        (body, [3, 0, 5], 8, "K=4, where 3 with K=8"),
        (body, [3, 5], 4, "3 sequences"),
        (body, [5, 0, 3], 4, "rows per sequence"),
        (body[:-1], [3, 0, 5], 4, "truncated or padded"),
        (body + b"\0\0\0\0", [3, 0, 5], 4, "truncated or padded"),
        (patched(ids_at, "<i", 100), [3, 0, 5], 4, r"outside the student's vocabulary \[0, 100\)"),
        (patched(ids_at + 4, "<i", -1), [3, 0, 5], 4, "outside the student's vocabulary"),
        (patched(lps_at, "<f", math.nan), [3, 0, 5], 4, "NaN or > 0"),
        (patched(len(body) - 4, "<f", 0.5), [3, 0, 5], 4, "NaN or > 0"),
        (patched(lps_at, "<f", -100.0), [3, 0, 5], 4, "not sorted"),
    ]
    for data, rows, k, words in bad:
        with pytest.raises(wire.WireError, match=words):
            wire.decode_scores(data, rows, k, vocab_rows=100)


def test_accept_header_names_the_binary_answer_explicitly():
    assert wire.accepts(wire.MEDIA_TYPE) and wire.accepts(f"application/json;q=0.5, {wire.MEDIA_TYPE.upper()}; q=1")
    for header in (None, "", "*/*", "application/*", "application/json", "application/x-opd-scores-v2"):
        assert not wire.accepts(header), header


def json_rows(plp: list, seq: list[int], start: int, k: int):
    """The rows a binary answer holds, read from a JSON answer's prompt_logprobs (an independent path)."""
    ids, lps, given = [], [], []
    for j in range(start, len(seq)):
        entry = plp[j]
        pairs = sorted(((v["logprob"], int(t)) for t, v in entry.items()), key=lambda x: -x[0])
        top = [x for x in pairs if x[1] != seq[j]] if len(entry) == k + 1 else pairs
        ids.append([t for _, t in top])
        lps.append([lp for lp, _ in top])
        given.append(entry[str(seq[j])]["logprob"])
    return torch.tensor(ids).view(-1, k), torch.tensor(lps).view(-1, k), torch.tensor(given)


def test_binary_answer_holds_the_json_answers_numbers(served):
    url, app, model, tok = served
    seqs = [tok(f"Compute {i} * {7 * i + 2} - {i}." + " x" * i)["input_ids"] for i in range(3)]
    starts, k = [2, 5, 1], 6
    with urllib.request.urlopen(url + "/opd/vocab", timeout=10) as r:
        assert wire.MEDIA_TYPE in json.loads(r.read())["answer_media_types"]  # the offer
    request = {"prompt": seqs, "max_tokens": 1, "prompt_logprobs": k, "opd_logprobs_from": starts}
    status, media, body = post(url, request, accept=None)  # a non-opd client: vLLM's JSON, as before
    assert status == 200 and media == "application/json"
    plps = [c["prompt_logprobs"] for c in json.loads(body)["choices"]]
    for accept in ("*/*", "application/json"):
        assert post(url, request, accept=accept)[1] == "application/json"
    status, media, body = post(url, request)
    assert status == 200 and media == wire.MEDIA_TYPE
    ids, lps, given = wire.decode_scores(body, [len(s) - st for s, st in zip(seqs, starts)], k, app.vocab_rows)
    want = [torch.cat(t) for t in zip(*(json_rows(p, s, st, k) for p, s, st in zip(plps, seqs, starts)))]
    assert torch.equal(ids, want[0])  # the same ids in the same order
    assert torch.equal(lps, want[1].float()) and torch.equal(given, want[2].float())  # float32 both ways
    # Without opd_logprobs_from, a binary answer holds every position but the first, as JSON does.
    status, _, body = post(url, {"prompt": seqs, "max_tokens": 1, "prompt_logprobs": k})
    assert status == 200 and wire.decode_scores(body, [len(s) - 1 for s in seqs], k, app.vocab_rows)[0].shape[1] == k
    # Errors stay JSON whatever was accepted.
    status, media, body = post(url, {**request, "prompt_logprobs": 65})
    assert status == 422 and media == "application/json" and "--max-k" in json.loads(body)["error"]["message"]


def test_older_opd_server_without_the_offer_is_asked_in_json(served, tiny_models, monkeypatch):
    url, app, model, tok = served
    monkeypatch.setattr(app, "vocab", {k: v for k, v in app.vocab.items() if k != "answer_media_types"})
    client = HTTPTeacher(url, tok, head_weight(model).shape[0])
    assert client.vocab_verified and not client.binary
    batch = rollouts(tok, tiny_models[0], n=3, new_tokens=5)
    got, want = client.score(batch, 4), HFTeacher(model).score(batch, 4)
    m = batch.response_mask_NT
    assert torch.equal(got.topk_ids_NTK[m], want.topk_ids_NTK[m])


class _Relay(BaseHTTPRequestHandler):
    """Passes requests on to opd's server (so the binary answer is offered), with faults on demand."""

    upstream = ""
    failures = 0  # answer this many POSTs with a 503 first
    cut = 0  # then cut this many answers short: the connection closes mid-body
    mangle = staticmethod(lambda body: body)  # what the relay does to a good answer's body

    def log_message(self, *args):
        pass

    def _forward(self, data=None) -> tuple[str, bytes]:
        headers = {k: v for k, v in self.headers.items() if k in ("Content-Type", "Accept")}
        req = urllib.request.Request(self.upstream + self.path, data=data, method=self.command, headers=headers)
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.headers.get_content_type(), r.read()

    def _send(self, status: int, media: str, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, *self._forward())

    def do_POST(self):
        data, cls = self.rfile.read(int(self.headers["Content-Length"])), type(self)
        if cls.failures > 0:
            cls.failures -= 1
            return self._send(503, "application/json", b'{"error": {"message": "busy, try later"}}')
        media, body = self._forward(data)
        if cls.cut > 0:
            cls.cut -= 1
            return self._send(200, media, body[: len(body) // 2], length=len(body))
        self._send(200, media, cls.mangle(body))


def test_binary_answers_are_retried_and_checked(served, tiny_models):
    url, app, model, tok = served
    V = head_weight(model).shape[0]
    batch = rollouts(tok, tiny_models[0], n=3, new_tokens=5)
    want = HFTeacher(model).score(batch, 4)
    m = batch.response_mask_NT
    _Relay.upstream = url
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Relay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        patient = HTTPTeacher(relay, tok, V, retries=2, backoff=0.01)
        assert patient.binary
        _Relay.failures, _Relay.cut = 1, 1  # a 5xx and an answer cut short are both retried...
        got = patient.score(batch, 4)
        assert _Relay.failures == _Relay.cut == 0 and torch.equal(got.topk_ids_NTK[m], want.topk_ids_NTK[m])
        torch.testing.assert_close(got.sampled_logprobs_NT[m], want.sampled_logprobs_NT[m], atol=1e-5, rtol=0)
        impatient = HTTPTeacher(relay, tok, V, retries=0)
        _Relay.failures = 1  # ...until the retries run out
        with pytest.raises(UserError, match="answered HTTP 503: busy, try later"):
            impatient.score(batch, 4)
        _Relay.failures, _Relay.cut = 0, 1
        with pytest.raises(UserError, match="unreachable after 1 attempts"):
            impatient.score(batch, 4)

        def ids_at(body):  # the ids start after the 20-byte header and the rows
            return 20 + 4 * int.from_bytes(body[8:12], "little")

        for mangle, words in [
            (lambda b: b[:-6], "bytes where its header announces"),
            (lambda b: b[: ids_at(b)] + struct.pack("<i", V) + b[ids_at(b) + 4 :], rf"vocabulary \[0, {V}\)"),
            (lambda b: b[:-4] + struct.pack("<f", math.nan), "NaN or > 0"),
            (lambda b: b"not an answer", "shorter than the 20-byte header"),
        ]:
            _Relay.mangle = staticmethod(mangle)
            with pytest.raises(UserError, match=f"sent a malformed binary answer .*{words}"):
                impatient.score(batch, 4)
    finally:
        _Relay.mangle, _Relay.failures, _Relay.cut = staticmethod(lambda body: body), 0, 0
        server.shutdown()
        server.server_close()


def test_a_failing_request_fails_alone_on_the_binary_path(tiny_models):
    model, tok = load_model(tiny_models[1], "teacher"), load_tokenizer(tiny_models[1], "teacher")
    calls = []

    class Flaky(BatchScorer):
        def _run(self, jobs):
            calls.append(len(jobs))
            if any(j.seqs == [[7, 7, 7]] for j in jobs):
                raise RuntimeError("poisoned")
            super()._run(jobs)

    app = TeacherApp(model, tok, "t", Limits(batch_wait_ms=500))  # both requests share a batch
    app.scorer.close()
    app.scorer = Flaky(model, app.limits)
    server = start_server(app)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        got, both_ready = {}, threading.Barrier(2)

        def ask(name, seqs):
            both_ready.wait(timeout=30)
            got[name] = post(url, {"prompt": seqs, "max_tokens": 1, "prompt_logprobs": 4})

        threads = [
            threading.Thread(target=ask, args=("bad", [[7, 7, 7]])),
            threading.Thread(target=ask, args=("good", [[5, 6, 7, 8]])),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        status, media, body = got["bad"]
        assert status == 500 and media == "application/json" and "poisoned" in json.loads(body)["error"]["message"]
        status, media, body = got["good"]
        assert status == 200 and media == wire.MEDIA_TYPE
        ids, _, _ = wire.decode_scores(body, [3], 4, head_weight(model).shape[0])
        assert ids.shape == (3, 4)
        assert calls == [2, 1, 1]  # one batch of both (it fails), then each alone
    finally:
        stop_server(server)
