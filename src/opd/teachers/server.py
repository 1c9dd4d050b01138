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
is answered in that format (:mod:`opd.teachers.wire`). Any other request, and every error, gets JSON.

HTTP is a Starlette app on uvicorn (vLLM's stack): one event loop holds every connection (backlog
2048; the standard library's server had 5 and reset 1.3% of 64 clients' connections), and a request
waiting for its forward pass holds no thread. Concurrent requests are batched: one worker thread
merges what arrives within ``batch_wait_ms`` (up to ``max_batch_tokens`` padded tokens) into
forward passes over chunks of sequences of similar length. The scores come from the same code as
the in-process teacher (:func:`opd.losses.topk_and_gather_from_hidden` on
:func:`opd.models.loading.final_hidden` and the model's own head, :func:`opd.models.head.model_head`), so they match it to float rounding. Bad requests get a 4xx with an
OpenAI-style JSON error, a bug a 500; the server keeps serving.

Run: ``opd serve-teacher runs/teacher --port 8000`` (``--port 0`` picks a free port and prints it);
Ctrl-C or SIGTERM stops it after answering the requests in flight. In Python: :func:`start_server`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from opd.errors import UserError
from opd.hub import resolve_model
from opd.losses import topk_and_gather_from_hidden
from opd.losses.head import logits_no_grad
from opd.models.head import model_head
from opd.models.loading import final_hidden, head_weight, load_model, load_tokenizer, model_device, resolve_device
from opd.models.precision import auto_dtype
from opd.rollout.forward import ROWS_PER_CHUNK
from opd.teachers import wire
from opd.teachers.client import vocab_info


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, and an OpenAI-style error type."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}


FALLBACK_CONTEXT = 4096  # the request limit for a model whose config states no context length


@dataclass
class Limits:
    """Bounds on one request and on one forward pass (``max_prompt_tokens`` 0, as ``opd serve-teacher``'s
    default: :class:`TeacherApp` sets the model's context length)."""

    max_k: int = 128
    max_prompt_tokens: int = 0
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
    head = model_head(model)
    # Each sequence's last row predicts the next token (its query, the first token, is a dummy).
    h_MD = torch.cat(cast(list[torch.Tensor], h_rows))  # every row filled above
    query_M = torch.tensor([t for s, st in zip(seqs, starts) for t in (*s[st:], s[0])], dtype=torch.long, device=dev)
    ids_MK, lps_MK, q_M1 = topk_and_gather_from_hidden(h_MD[None], head, k, query_M.view(1, -1, 1), chunk_size)
    ids_MK, lps_MK, given_M = ids_MK[0], lps_MK[0], q_M1[0, :, 0]
    rank_M = 1 + (lps_MK > given_M[:, None]).sum(-1)
    # Every token with a larger logit than a top-K member is itself in the top-K, so the count above
    # is exact there; a given token outside the top-K needs its row of logits again.
    outside = (~(ids_MK == query_M[:, None]).any(-1)).nonzero().squeeze(-1) if ranks else query_M[:0]
    for rows in outside.split(chunk_size):
        logits = logits_no_grad(head, h_MD[rows])
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
    future: Future = field(default_factory=Future)  # cancelled: its client got a 503, skip the forward pass
    result: list[SeqScores] | None = None


class BatchScorer:
    """One worker thread that merges concurrently queued requests into batched forward passes."""

    def __init__(self, model, limits: Limits, chunk_size: int = 256):
        self.model, self.limits, self.chunk_size = model, limits, chunk_size
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.batches = 0  # forward passes run (the tests read it to see batching happen)
        self.thread = threading.Thread(target=self._loop, name="opd-teacher-scorer", daemon=True)
        self.thread.start()

    async def score(
        self, seqs: list[list[int]], k: int, starts: list[int] | None = None, ranks: bool = True
    ) -> list[SeqScores]:
        """Score, once the worker has run the forward pass. It completes the job's future through the event
        loop (``call_soon_threadsafe``): a waiting request holds no thread, whose number would cap waiters."""
        job = _Job(seqs, k, starts or [1] * len(seqs), ranks)
        self.queue.put(job)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job.future), self.limits.request_timeout)
        except TimeoutError:
            job.future.cancel()  # if still queued, not worth a forward pass any more
            late = f"scoring took longer than {self.limits.request_timeout:.0f} s; retry later"
            raise RequestError(503, late, "ServiceUnavailableError") from None

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
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]  # from here on, not cancellable
            try:
                if jobs:
                    self._run(jobs)
            except Exception:  # a failed batch fails its requests, not the server...
                for job in jobs:  # ...and only the requests that fail on their own
                    try:
                        self._run([job])
                    except Exception as exc:
                        failed = f"scoring failed: {type(exc).__name__}: {exc}"
                        job.future.set_exception(RequestError(500, failed, "InternalServerError"))
            for job in jobs:
                if not job.future.done():
                    job.future.set_result(job.result)

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
    """opd's binary answer (:mod:`opd.teachers.wire`): whole arrays, no per-token Python object."""
    return wire.encode_scores(
        [len(sc.given_logprob) for sc in scores],
        torch.cat([sc.ids[:, :k] for sc in scores]),
        torch.cat([sc.logprobs[:, :k] for sc in scores]),
        torch.cat([sc.given_logprob for sc in scores]),
    )


class TeacherApp:
    """The served model, its tokenizer and the batching scorer, independent of the HTTP layer."""

    def __init__(
        self, model, tokenizer, model_name: str, limits: Limits | None = None, api_keys: list[str] | tuple = ()
    ):
        self.model = model.eval()
        self.keys = KeyCheck(api_keys)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or Limits()
        if not self.limits.max_prompt_tokens:
            context = getattr(model.config, "max_position_embeddings", None) or FALLBACK_CONTEXT
            self.limits = dataclasses.replace(self.limits, max_prompt_tokens=context)
        self.vocab_rows = head_weight(model).shape[0]
        # opd's clients read the answer formats from here: listing the binary one is the offer
        self.vocab = {
            **vocab_info(tokenizer, self.vocab_rows),
            "answer_media_types": ["application/json", wire.MEDIA_TYPE],
        }
        n = len(tokenizer)
        self.decoded = tokenizer.batch_decode([[i] for i in range(n)]) + [""] * max(self.vocab_rows - n, 0)
        self.scorer = BatchScorer(self.model, self.limits)

    async def complete(self, body: bytes, binary: bool = False) -> bytes:
        """The encoded answer: vLLM's JSON, or opd's binary format (:mod:`opd.teachers.wire`) if the client asked.
        Parsing and encoding hold the GIL (seconds for the largest requests): they run in the loop's few
        default threads, not on it; more would not run faster, and waiting for the forward pass takes none."""
        args = (self.tokenizer, self.vocab_rows, self.model_name, self.limits)
        seqs, k, starts = await asyncio.to_thread(parse_completion_request, body, *args)
        scores = await self.scorer.score(seqs, k, starts, ranks=not binary)
        if binary:
            return await asyncio.to_thread(binary_response, scores, k)
        return await asyncio.to_thread(
            lambda: _dumps(completion_response(seqs, scores, k, self.decoded, self.model_name))
        )

    def models(self) -> dict:
        max_len = getattr(self.model.config, "max_position_embeddings", None)
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "opd", "max_model_len": max_len}],
        }


# ----------------------------------------------------------------------------- the HTTP layer

JSON = "application/json"
BACKLOG = 2048  # uvicorn's default: connections queue while the loop is busy, instead of being reset
GRACE_S = 10  # on shutdown, how long the requests in flight have to be answered before they are cancelled


def _dumps(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()  # compact: ~10% fewer bytes


async def _error(request: Request, err: RequestError) -> Response:
    # The request's body may be unread (a 413 from its Content-Length): close rather than read it as the next request.
    return Response(_dumps(err.payload()), err.status, {"Connection": "close"}, media_type=JSON)


async def _bug(request: Request, exc: Exception) -> Response:
    # A bug costs one request, not the server; Starlette then re-raises it for uvicorn to log.
    err = RequestError(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")
    return await _error(request, err)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 past ``limit`` bytes: from Content-Length before reading, or while reading a chunked one."""
    size, fix = int(request.headers.get("content-length", 0)), "send fewer or shorter prompts per request"
    if size > limit:
        raise RequestError(413, f"request body of {size} bytes exceeds {limit}; {fix}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"request body exceeds {limit} bytes; {fix}")
    return bytes(body)


async def _no_route(request: Request, exc: HTTPException) -> Response:  # Starlette's 404 and 405
    method, path = request.method, request.url.path
    hint = "; use POST /v1/completions" if method == "POST" or path == "/v1/completions" else ""
    kind = "NotFoundError" if exc.status_code == 404 else "MethodNotAllowedError"
    return await _error(request, RequestError(exc.status_code, f"no route {method} {path}{hint}", kind))


class KeyCheck:
    """The server's API keys (``--api-key``), checked as vLLM checks its own: every request to a path under
    ``/v1`` (and opd's ``/opd``) needs ``Authorization: Bearer KEY`` with one of them; ``/health`` stays
    open. Keys are kept as SHA-256 digests and every one is compared in constant time
    (:func:`hmac.compare_digest`, no early exit), so an answer's timing says nothing of a key."""

    PROTECTED = ("/v1", "/opd")

    def __init__(self, keys: list[str] | tuple = ()):
        if any(not k or k != k.strip() for k in keys):
            raise UserError("an --api-key is empty or has spaces around it; give keys without surrounding spaces")
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self.digests)

    def allows(self, path: str, authorization: str | None) -> bool:
        if not self.digests or not path.startswith(self.PROTECTED):
            return True
        scheme, _, token = (authorization or "").partition(" ")
        given = hashlib.sha256(token.encode()).digest()
        matches = [hmac.compare_digest(given, d) for d in self.digests]  # all of them: no early exit
        return scheme.lower() == "bearer" and any(matches)


class _RequireKey:
    """ASGI middleware: a request without a right bearer key gets vLLM's 401 answer before any route runs."""

    def __init__(self, inner, keys: KeyCheck):
        self.inner, self.keys = inner, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not self.keys.allows(scope["path"], auth):
                await Response(_dumps(UNAUTHORIZED), 401, media_type=JSON)(scope, receive, send)
                return
        await self.inner(scope, receive, send)


UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's body for a missing or wrong key


def build_asgi_app(app: TeacherApp):
    """vLLM's routes (completions, health, models) and opd's ``/opd/vocab`` over ``app``."""
    gets = {"/health": lambda: None, "/v1/models": app.models, "/opd/vocab": lambda: app.vocab}

    async def get(request: Request) -> Response:
        payload = gets[request.url.path]()
        return Response(b"" if payload is None else _dumps(payload), media_type=JSON)

    async def completions(request: Request) -> Response:
        body = await _read_body(request, app.limits.max_body_bytes)
        binary = wire.accepts(request.headers.get("accept"))
        return Response(await app.complete(body, binary), media_type=wire.MEDIA_TYPE if binary else JSON)

    routes = [Route(path, get, methods=["GET"]) for path in gets]
    routes.append(Route("/v1/completions", completions, methods=["POST"]))
    handlers: dict[Any, Callable[..., Any]] = {RequestError: _error, HTTPException: _no_route, Exception: _bug}
    asgi = Starlette(routes=routes, exception_handlers=handlers)
    return _RequireKey(asgi, app.keys) if app.keys else asgi


# uvicorn picks AutoHTTPProtocol's class at import (httptools or h11), so its stubs call it a variable
class _JSONErrorsProtocol(AutoHTTPProtocol):  # type: ignore[valid-type,misc]
    """uvicorn's HTTP/1.1 protocol (httptools, else h11) answering a request it cannot parse in JSON."""

    def send_400_response(self, msg: str) -> None:
        message = f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}); Content-Length must be a byte count"
        body = _dumps(RequestError(400, message).payload())
        head = f"HTTP/1.1 400 Bad Request\r\ncontent-type: {JSON}\r\ncontent-length: {len(body)}\r\nconnection: close"
        self.transport.write(head.encode() + b"\r\n\r\n" + body)
        self.transport.close()


class TeacherServer(uvicorn.Server):
    """uvicorn's server, with its ``app``, ``thread`` and ``server_address`` (the real port for port 0)."""

    app: TeacherApp
    server_address: tuple[str, int]
    thread: threading.Thread


def _listen(host: str, port: int) -> socket.socket:
    # Bound here, not by uvicorn: port 0's real port is known before serving, and a port that
    # cannot be bound is the user's error to fix, not a log line and an exit in uvicorn's thread.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server need not wait out TIME_WAIT
        sock.bind((host, port))
        sock.listen(BACKLOG)  # clients queue from now on, even before the loop serves
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc}); pick another --port (0 picks a free one)") from exc
    return sock


def _server(app: TeacherApp, sock: socket.socket, verbose: bool) -> TeacherServer:
    config = uvicorn.Config(
        build_asgi_app(app),
        http=_JSONErrorsProtocol,
        backlog=BACKLOG,
        timeout_graceful_shutdown=GRACE_S,
        log_level="info" if verbose else "warning",  # uvicorn's start-up lines only with --verbose
        access_log=verbose,
    )
    server = TeacherServer(config)
    server.app, server.server_address = app, sock.getsockname()[:2]
    return server


def start_server(app: TeacherApp, host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> TeacherServer:
    """Bind and serve in a background thread; returns once the server accepts requests."""
    sock = _listen(host, port)
    server = _server(app, sock, verbose)
    # Off the main thread uvicorn installs no signal handlers: the caller (a test, a benchmark) owns them.
    server.thread = threading.Thread(target=server.run, args=([sock],), name="opd-teacher-http", daemon=True)
    server.thread.start()
    while not server.started and server.thread.is_alive():
        time.sleep(0.005)
    if not server.started:
        sock.close()
        raise RuntimeError("the teacher server's HTTP thread did not start; see uvicorn's log above")
    return server


def stop_server(server: TeacherServer) -> None:
    """Stop accepting connections, answer the requests in flight (up to ``GRACE_S``), stop the scorer."""
    server.should_exit = True
    server.thread.join(timeout=GRACE_S + 5)
    server.app.scorer.close()


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    served_model_name: str = "",
    limits: Limits | None = None,
    verbose: bool = False,
    device: str = "auto",
    api_keys: list[str] | tuple = (),
    revision: str = "",
) -> None:
    """``opd serve-teacher``: load the model, serve until interrupted (Ctrl-C or SIGTERM). A Hub name is
    served under that name (as vLLM does), its files read from the Hugging Face cache."""
    keys = KeyCheck(api_keys)  # a bad key is refused before the model loads
    if not keys and not is_loopback(host):
        print(
            f"opd serve-teacher: warning: listening on {host} without an API key: anyone who can reach the port "
            "can use this teacher; set OPD_API_KEY (or --api-key) and give trainers OPD_TEACHER_API_KEY",
            file=sys.stderr,
            flush=True,
        )
    if port:  # a taken port fails now, not after the model's load (minutes for a large model)
        _listen(host, port).close()
    where = "the model argument (opd serve-teacher MODEL_DIR)"
    on = resolve_device(device)
    if dtype == "auto":  # on a GPU the checkpoint's own, read from its config (a Hub name's: its snapshot's)
        folder = model_dir if on.type == "cpu" else resolve_model(model_dir, revision, f"teacher model ({where})")
        dtype = auto_dtype(folder, dtype, on)
    model = load_model(model_dir, "teacher", dtype, on, option=where, revision=revision)
    tok = load_tokenizer(model_dir, "teacher", option=where, revision=revision)
    app = TeacherApp(model, tok, served_model_name or str(model_dir), limits, api_keys)
    sock = _listen(host, port)
    server = _server(app, sock, verbose)
    url = "http://{}:{}".format(*server.server_address)
    # On the main thread uvicorn handles SIGINT and SIGTERM: it answers the requests in flight (a second
    # Ctrl-C cuts that short), then raises the signal again, which this handler makes a KeyboardInterrupt.
    # Not a thread and join(): before Python 3.13 a signal interrupting join() marks the thread stopped.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        keyed = f", {len(keys.digests)} API key(s)" if keys else ""
        about = f"model {app.model_name}, vocabulary {app.vocab_rows}, {dtype}, requests up to {app.limits.max_prompt_tokens} tokens{keyed}"
        print(f"opd teacher server: {url} ({about}); train with --teacher-url {url}", flush=True)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.scorer.close()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, localhost), reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
