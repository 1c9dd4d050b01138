"""A served teacher (``opd serve-teacher``): scores token sequences over HTTP in vLLM's format.

The wire format is vLLM's OpenAI-compatible completions endpoint with ``prompt_logprobs``, so a
real vLLM server is a drop-in replacement for this one (any server answering in this format is)::

    POST /v1/completions  {"prompt": [[ids...], ...], "max_tokens": 1, "prompt_logprobs": K}
    -> {"choices": [{"index": i, "prompt_logprobs": [null, {"<id>": {"logprob", "rank",
        "decoded_token"}, ...}, ...], ...}], ...}

Position j >= 1 of a prompt holds the teacher's top-K tokens of the distribution that predicts
token j, plus token j itself (so K or K+1 entries); ``rank`` is 1 + the number of tokens with a
strictly larger logit. Also ``GET /health``, ``GET /v1/models`` and the opd-only
``GET /opd/vocab`` (vocabulary hash and size, so a trainer can check it scores the student's ids).
One opd-only request field, ``opd_logprobs_from`` (per prompt, the first position to score;
earlier ones answer null), lets opd's trainer skip the prompt positions it never reads.

opd's own trainer gets the same numbers as arrays instead of JSON: ``/opd/vocab`` lists the
binary media type in ``answer_media_types``, and a request with ``Accept: application/x-opd-scores-v1``
is answered in that format (:mod:`opd.wire`). Any other request, and every error, gets JSON.

Concurrent requests are batched: handler threads queue their prompts, and one worker thread
collects what arrives within ``batch_wait_ms`` (up to ``max_batch_tokens`` padded tokens) into
forward passes over chunks of sequences of similar length. The scores come from the same code as
the in-process teacher (:func:`opd.losses.topk_and_gather_from_hidden` on
:func:`opd.models.final_hidden`), so they match it to float rounding. Bad requests get a 4xx
with an OpenAI-style JSON error; the server keeps serving.

Run: ``opd serve-teacher runs/teacher --port 8000`` (``--port 0`` picks a free port and prints it).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from opd import wire
from opd.errors import UserError
from opd.losses import topk_and_gather_from_hidden
from opd.models import final_hidden, head_weight, load_model, load_tokenizer, model_device, resolve_device
from opd.teacher import ROWS_PER_CHUNK
from opd.teacher_http import vocab_info


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, and an OpenAI-style error type."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Limits:
    """Bounds on one request and on one forward pass."""

    max_k: int = 128
    max_prompt_tokens: int = 4096
    max_prompts: int = 256
    max_batch_tokens: int = 16384
    batch_wait_ms: float = 5.0
    request_timeout: float = 300.0

    @property
    def max_body_bytes(self) -> int:
        # Up to ~12 bytes per JSON-encoded token id, plus room for the other fields.
        return self.max_prompts * self.max_prompt_tokens * 12 + 65536


# ----------------------------------------------------------------------------- scoring


@dataclass
class SeqScores:
    """Scores of one sequence of length L from token ``start`` (>= 1): row r describes token start + r.

    Shapes: ids, logprobs: (L-start, K) sorted descending; given_logprob, given_rank: (L-start,).
    ``given_rank`` is exact when scored with ``ranks=True``; otherwise only inside the top-K.
    ``next_id`` is the teacher's argmax after the last token (the one "generated" token).
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    given_logprob: torch.Tensor
    given_rank: torch.Tensor
    next_id: int
    start: int = 1


@torch.no_grad()
def score_sequences(
    model,
    seqs: list[list[int]],
    k: int,
    chunk_size: int = 256,
    starts: list[int] | None = None,
    rows_per_chunk: int = ROWS_PER_CHUNK,
    ranks: bool = True,
) -> list[SeqScores]:
    """Top-K, given-token log-probs and ranks of each sequence's tokens from ``starts[i]`` on
    (default 1: every token but the first). The model runs on chunks of ``rows_per_chunk``
    sequences of similar length, each padded only to its own longest (as the in-process teacher
    does, for the same reason: one forward over a whole padded batch was much slower); the head
    then runs once, on the scored rows only. ``ranks=False`` skips the given tokens' ranks (only
    the JSON answer has them; a given token outside the top-K costs a full row of logits)."""
    starts = starts or [1] * len(seqs)
    lens = [len(s) for s in seqs]
    dev = model_device(model)
    h_rows: list[torch.Tensor | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: lens[i])
    for c in range(0, len(order), rows_per_chunk):
        rows = order[c : c + rows_per_chunk]
        ids_NL = torch.zeros(len(rows), max(lens[i] for i in rows), dtype=torch.long, device="cpu")
        mask_NL = torch.zeros_like(ids_NL)
        for r, i in enumerate(rows):  # right padding: a causal model's real positions never see it
            ids_NL[r, : lens[i]] = torch.as_tensor(seqs[i], device="cpu")
            mask_NL[r, : lens[i]] = 1
        h_NLD = final_hidden(model, ids_NL.to(dev), mask_NL.to(dev))
        for r, i in enumerate(rows):  # hidden row j predicts token j + 1
            h_rows[i] = h_NLD[r, starts[i] - 1 : lens[i]]
    W = head_weight(model)
    # Each sequence's last row predicts the next token (its query, the first token, is a dummy).
    h_MD = torch.cat(h_rows)
    query_M = torch.tensor([t for s, st in zip(seqs, starts) for t in (*s[st:], s[0])], dtype=torch.long, device=dev)
    ids_MK, lps_MK, q_M1 = topk_and_gather_from_hidden(h_MD[None], W, k, query_M.view(1, -1, 1), chunk_size)
    ids_MK, lps_MK, given_M = ids_MK[0], lps_MK[0], q_M1[0, :, 0]
    rank_M = 1 + (lps_MK > given_M[:, None]).sum(-1)
    # Every token with a larger logit than a top-K member is itself in the top-K, so the count above
    # is exact there; a given token outside the top-K needs its row of logits again.
    outside = (~(ids_MK == query_M[:, None]).any(-1)).nonzero().squeeze(-1) if ranks else query_M[:0]
    for rows in outside.split(chunk_size):
        logits = h_MD[rows].float() @ W.float().T
        rank_M[rows] = 1 + (logits > logits.gather(-1, query_M[rows, None])).sum(-1)
    ids_MK, lps_MK, given_M, rank_M = (t.cpu() for t in (ids_MK, lps_MK, given_M, rank_M))  # one copy off a GPU
    out, row = [], 0
    for n, st in zip(lens, starts):
        sl, last = slice(row, row + n - st), row + n - st
        out.append(SeqScores(ids_MK[sl], lps_MK[sl], given_M[sl], rank_M[sl], int(ids_MK[last, 0]), st))
        row = last + 1
    return out


@dataclass
class _Job:
    seqs: list[list[int]]
    k: int
    starts: list[int]
    ranks: bool = True  # a JSON answer reports the given tokens' ranks; a binary one does not
    done: threading.Event = field(default_factory=threading.Event)
    result: list[SeqScores] | None = None
    error: str | None = None
    abandoned: bool = False  # its client got a 503 already: not worth a forward pass


class BatchScorer:
    """One worker thread that merges concurrently queued requests into batched forward passes."""

    def __init__(self, model, limits: Limits, chunk_size: int = 256):
        self.model, self.limits, self.chunk_size = model, limits, chunk_size
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.batches = 0  # forward passes run (the tests read it to see batching happen)
        self.thread = threading.Thread(target=self._loop, name="opd-teacher-scorer", daemon=True)
        self.thread.start()

    def submit(
        self, seqs: list[list[int]], k: int, starts: list[int] | None = None, ranks: bool = True
    ) -> list[SeqScores]:
        job = _Job(seqs, k, starts or [1] * len(seqs), ranks)
        self.queue.put(job)
        if not job.done.wait(self.limits.request_timeout):
            job.abandoned = True
            raise RequestError(
                503,
                f"scoring took longer than {self.limits.request_timeout:.0f} s; retry later",
                "ServiceUnavailableError",
            )
        if job.error is not None:
            raise RequestError(500, f"scoring failed: {job.error}", "InternalServerError")
        return job.result

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10)

    def _collect(self, first: _Job) -> tuple[list[_Job], bool]:
        jobs, tokens = [first], sum(len(s) for s in first.seqs)
        deadline = time.monotonic() + self.limits.batch_wait_ms / 1000
        while tokens < self.limits.max_batch_tokens:
            try:
                job = self.queue.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            tokens += sum(len(s) for s in job.seqs)
        return jobs, False

    def _loop(self) -> None:
        stop = False
        while not stop:
            first = self.queue.get()
            if first is None:
                break
            jobs, stop = self._collect(first)
            jobs = [j for j in jobs if not j.abandoned]
            try:
                if jobs:
                    self._run(jobs)
            except Exception:  # a failed batch fails its requests, not the server...
                for job in jobs:  # ...and only the requests that fail on their own
                    try:
                        self._run([job])
                    except Exception as exc:
                        job.error = f"{type(exc).__name__}: {exc}"
            for job in jobs:
                job.done.set()

    def _run(self, jobs: list[_Job]) -> None:
        k, ranks = max(j.k for j in jobs), any(j.ranks for j in jobs)
        flat = [(len(s), ji, si) for ji, j in enumerate(jobs) for si, s in enumerate(j.seqs)]
        flat.sort(reverse=True)  # similar lengths together: less padding
        results: dict[tuple[int, int], SeqScores] = {}
        start = 0
        while start < len(flat):
            L, end = flat[start][0], start + 1
            while end < len(flat) and (end - start + 1) * L <= self.limits.max_batch_tokens:
                end += 1
            part = flat[start:end]
            scored = score_sequences(
                self.model,
                [jobs[ji].seqs[si] for _, ji, si in part],
                k,
                self.chunk_size,
                [jobs[ji].starts[si] for _, ji, si in part],
                ranks=ranks,
            )
            results.update({(ji, si): sc for (_, ji, si), sc in zip(part, scored)})
            self.batches += 1
            start = end
        for ji, job in enumerate(jobs):
            job.result = [results[(ji, si)] for si in range(len(job.seqs))]


# ----------------------------------------------------------------------------- the HTTP protocol


def parse_completion_request(body: bytes, tokenizer, vocab_rows: int, model_name: str, limits: Limits):
    """Validate a completions request; returns (token-id lists, K, first scored token of each) or raises RequestError."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(req, dict):
        raise RequestError(400, "the request body must be a JSON object with 'prompt' and 'prompt_logprobs'")
    if req.get("model") not in (None, model_name):
        raise RequestError(
            404, f"The model `{req['model']}` does not exist; this server serves `{model_name}`", "NotFoundError"
        )
    k = req.get("prompt_logprobs")
    if isinstance(k, bool) or not isinstance(k, int):
        raise RequestError(400, "'prompt_logprobs' must be an integer K >= 1 (the number of top tokens per position)")
    if not 1 <= k <= limits.max_k:
        raise RequestError(
            422,
            f"prompt_logprobs={k} is outside [1, {limits.max_k}]; ask for 1 to {limits.max_k} "
            "top tokens, or restart the server with a larger --max-k",
        )
    if req.get("max_tokens", 1) not in (1,) or req.get("n", 1) != 1:
        raise RequestError(422, "this teacher server only scores prompts: set max_tokens to 1 and n to 1")
    seqs = _prompt_ids(req.get("prompt"), tokenizer)
    if len(seqs) > limits.max_prompts:
        raise RequestError(
            413,
            f"{len(seqs)} prompts in one request; the limit is {limits.max_prompts} "
            "(split the request or raise --max-prompts)",
        )
    for i, s in enumerate(seqs):
        if not 1 <= len(s) <= limits.max_prompt_tokens:
            raise RequestError(
                413 if s else 400,
                f"prompt {i} has {len(s)} tokens; each prompt needs 1 to "
                f"{limits.max_prompt_tokens} tokens (--max-prompt-tokens)",
            )
        bad = [t for t in s if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_rows]
        if bad:
            raise RequestError(
                422,
                f"prompt {i} holds token id {bad[0]!r}, not an integer in [0, {vocab_rows}); "
                "send ids from the teacher's vocabulary",
            )
    return seqs, k, _starts(req.get("opd_logprobs_from"), seqs)


def _starts(value, seqs: list[list[int]]) -> list[int]:
    """opd's extension ``opd_logprobs_from``: per prompt, the first token whose log-probs are wanted
    (earlier positions answer null). A trainer needs only the response's, and a prompt's positions
    would otherwise be most of the answer. Other servers ignore the field and answer every position."""
    if value is None:
        return [1] * len(seqs)
    value = [value] * len(seqs) if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(value, list)
        or len(value) != len(seqs)
        or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= len(s) for v, s in zip(value, seqs))
    ):
        raise RequestError(
            422,
            "'opd_logprobs_from' must be an integer or one integer per prompt, each between 1 and that prompt's length",
        )
    return value


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """vLLM's four prompt forms: a string, a list of strings, a list of ids, a list of id lists."""
    if prompt is None:
        raise RequestError(400, "missing 'prompt': send a list of token ids or a list of such lists")
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(
            400, "'prompt' must be a non-empty string, list of strings, list of token ids or list of lists"
        )
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer(p)["input_ids"] for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return prompt
    if all(not isinstance(p, (list, str, dict)) for p in prompt):
        return [prompt]
    raise RequestError(400, "'prompt' mixes forms; send a list of token ids or a list of lists of token ids")


def completion_response(
    seqs: list[list[int]], scores: list[SeqScores], k: int, decoded: list[str], model_name: str
) -> dict:
    """The vLLM completions answer for scored prompts (one choice per prompt)."""
    choices = []
    for i, (seq, sc) in enumerate(zip(seqs, scores)):
        ids, lps = sc.ids[:, :k].tolist(), sc.logprobs[:, :k].tolist()
        g_lp, g_rank = sc.given_logprob.tolist(), sc.given_rank.tolist()
        positions: list[dict | None] = [None] * sc.start
        for j in range(len(seq) - sc.start):
            entry, prev, rank = {}, None, 0
            for r, (tid, lp) in enumerate(zip(ids[j], lps[j])):
                rank = rank if lp == prev else r + 1  # ties share a rank, as "1 + strictly larger" says
                prev = lp
                entry[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": decoded[tid]}
            given = seq[sc.start + j]
            entry.setdefault(str(given), {"logprob": g_lp[j], "rank": g_rank[j], "decoded_token": decoded[given]})
            positions.append(entry)
        choices.append(
            {
                "index": i,
                "text": decoded[sc.next_id],
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": positions,
            }
        )
    n_prompt = sum(len(s) for s in seqs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(seqs), "total_tokens": n_prompt + len(seqs)},
    }


def binary_response(scores: list[SeqScores], k: int) -> bytes:
    """opd's binary answer (:mod:`opd.wire`): whole arrays, no per-token Python object."""
    return wire.encode_scores(
        [len(sc.given_logprob) for sc in scores],
        torch.cat([sc.ids[:, :k] for sc in scores]),
        torch.cat([sc.logprobs[:, :k] for sc in scores]),
        torch.cat([sc.given_logprob for sc in scores]),
    )


class TeacherApp:
    """The served model, its tokenizer and the batching scorer, independent of the HTTP layer."""

    def __init__(self, model, tokenizer, model_name: str, limits: Limits | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or Limits()
        self.vocab_rows = head_weight(model).shape[0]
        # opd's clients read the answer formats from here: listing the binary one is the offer
        self.vocab = {
            **vocab_info(tokenizer, self.vocab_rows),
            "answer_media_types": ["application/json", wire.MEDIA_TYPE],
        }
        n = len(tokenizer)
        self.decoded = tokenizer.batch_decode([[i] for i in range(n)]) + [""] * max(self.vocab_rows - n, 0)
        self.scorer = BatchScorer(self.model, self.limits)

    def complete(self, body: bytes, binary: bool = False) -> dict | bytes:
        """The answer to a completions request: vLLM's JSON, or opd's binary format (:mod:`opd.wire`)
        when the client asked for it."""
        seqs, k, starts = parse_completion_request(body, self.tokenizer, self.vocab_rows, self.model_name, self.limits)
        scores = self.scorer.submit(seqs, k, starts, ranks=not binary)
        if binary:
            return binary_response(scores, k)
        return completion_response(seqs, scores, k, self.decoded, self.model_name)

    def models(self) -> dict:
        max_len = getattr(self.model.config, "max_position_embeddings", None)
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "opd", "max_model_len": max_len}],
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client may reuse its connection
    server_version = "opd-serve-teacher"
    timeout = 120  # seconds a client may take to send its request; a stalled one frees its thread

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)

    def _send(self, status: int, payload: dict | bytes | None) -> None:
        binary = isinstance(payload, bytes)
        if binary:
            body = payload
        else:
            body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()  # ~10% fewer bytes
        self.send_response(status)
        self.send_header("Content-Type", wire.MEDIA_TYPE if binary else "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _error(self, err: RequestError) -> None:
        # The request's body may be unread (or unreadable): close rather than parse it as the next request.
        self.close_connection = True
        self._send(err.status, {"error": {"message": err.message, "type": err.kind, "param": None, "code": err.status}})

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        app: TeacherApp = self.server.app
        routes = {"/health": lambda: None, "/v1/models": app.models, "/opd/vocab": lambda: app.vocab}
        if self.path not in routes:
            return self._error(RequestError(404, f"no route GET {self.path}", "NotFoundError"))
        self._send(200, routes[self.path]())

    def do_POST(self) -> None:  # noqa: N802
        app: TeacherApp = self.server.app
        try:
            if self.path != "/v1/completions":
                raise RequestError(404, f"no route POST {self.path}; use POST /v1/completions", "NotFoundError")
            length = self.headers.get("Content-Length", "0").strip()
            if not length.isdigit():
                raise RequestError(400, f"Content-Length {length!r} is not a byte count; send the JSON body with one")
            size = int(length)
            if size > app.limits.max_body_bytes:
                raise RequestError(
                    413,
                    f"request body of {size} bytes exceeds {app.limits.max_body_bytes}; "
                    "send fewer or shorter prompts per request",
                )
            self._send(200, app.complete(self.rfile.read(size), binary=wire.accepts(self.headers.get("Accept"))))
        except RequestError as err:
            self._error(err)
        except Exception as exc:  # a bug must cost one request, not the server
            self._error(RequestError(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError"))


def start_server(app: TeacherApp, host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> ThreadingHTTPServer:
    """Bind and serve in a background thread; ``server.server_address`` has the chosen port."""
    try:
        server = ThreadingHTTPServer((host, port), _Handler)
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        raise UserError(f"cannot listen on {host}:{port} ({exc}); pick another --port (0 picks a free one)") from exc
    server.daemon_threads = True
    server.app, server.verbose = app, verbose
    threading.Thread(target=server.serve_forever, name="opd-teacher-http", daemon=True).start()
    return server


def stop_server(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()
    server.app.scorer.close()


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "float32",
    served_model_name: str = "",
    limits: Limits | None = None,
    verbose: bool = False,
    device: str = "auto",
) -> None:
    """``opd serve-teacher``: load the model, serve until interrupted (Ctrl-C)."""
    model = load_model(model_dir, "teacher", dtype, resolve_device(device))
    app = TeacherApp(model, load_tokenizer(model_dir, "teacher"), served_model_name or str(model_dir), limits)
    server = start_server(app, host, port, verbose)
    host, port = server.server_address[:2]
    print(
        f"opd teacher server: http://{host}:{port} (model {app.model_name}, vocabulary {app.vocab_rows}); "
        f"train with --teacher-url http://{host}:{port}",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop_server(server)
