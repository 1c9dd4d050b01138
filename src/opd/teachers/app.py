"""The served teacher as an ASGI app (Starlette): the model behind vLLM's routes, and its API keys.

:class:`TeacherApp` holds the served model, its tokenizer and the batching scorer
(:mod:`opd.teachers.batching`) and answers a completions request's body in the format the client
asked for (:mod:`opd.teachers.completions`); :func:`build_asgi_app` puts it behind vLLM's routes
(``POST /v1/completions``, ``GET /health``, ``GET /v1/models``) and opd's ``GET /opd/vocab``
(vocabulary hash and size, so a trainer can check it scores the student's ids, and the answer media
types, whose binary one is the offer of :mod:`opd.teachers.wire`). Bad requests get a 4xx with an
OpenAI-style JSON error, a bug a 500; the server keeps serving. :class:`KeyCheck` is ``--api-key``.
Serving it over a socket is :mod:`opd.teachers.server`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from opd.errors import UserError
from opd.models.loading import head_weight
from opd.teachers import wire
from opd.teachers.batching import BatchScorer
from opd.teachers.client import vocab_info
from opd.teachers.completions import (
    Limits,
    RequestError,
    binary_response,
    completion_response,
    dumps,
    parse_completion_request,
)

FALLBACK_CONTEXT = 4096  # the request limit for a model whose config states no context length


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
            lambda: dumps(completion_response(seqs, scores, k, self.decoded, self.model_name))
        )

    def models(self) -> dict:
        max_len = getattr(self.model.config, "max_position_embeddings", None)
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "opd", "max_model_len": max_len}],
        }


# ----------------------------------------------------------------------------- HTTP

JSON = "application/json"


async def _error(request: Request, err: RequestError) -> Response:
    # The request's body may be unread (a 413 from its Content-Length): close rather than read it as the next request.
    return Response(dumps(err.payload()), err.status, {"Connection": "close"}, media_type=JSON)


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
                await Response(dumps(UNAUTHORIZED), 401, media_type=JSON)(scope, receive, send)
                return
        await self.inner(scope, receive, send)


UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's body for a missing or wrong key


def build_asgi_app(app: TeacherApp):
    """vLLM's routes (completions, health, models) and opd's ``/opd/vocab`` over ``app``."""
    gets = {"/health": lambda: None, "/v1/models": app.models, "/opd/vocab": lambda: app.vocab}

    async def get(request: Request) -> Response:
        payload = gets[request.url.path]()
        return Response(b"" if payload is None else dumps(payload), media_type=JSON)

    async def completions(request: Request) -> Response:
        body = await _read_body(request, app.limits.max_body_bytes)
        binary = wire.accepts(request.headers.get("accept"))
        return Response(await app.complete(body, binary), media_type=wire.MEDIA_TYPE if binary else JSON)

    routes = [Route(path, get, methods=["GET"]) for path in gets]
    routes.append(Route("/v1/completions", completions, methods=["POST"]))
    handlers: dict[Any, Callable[..., Any]] = {RequestError: _error, HTTPException: _no_route, Exception: _bug}
    asgi = Starlette(routes=routes, exception_handlers=handlers)
    return _RequireKey(asgi, app.keys) if app.keys else asgi
