"""The served teacher's request and answer format: vLLM's completions endpoint with ``prompt_logprobs``.

The format is vLLM's OpenAI-compatible completions endpoint, so a real vLLM server is a drop-in
replacement for opd's (any server answering in this format is)::

    POST /v1/completions  {"prompt": [[ids...], ...], "max_tokens": 1, "prompt_logprobs": K}
    -> {"choices": [{"index": i, "prompt_logprobs": [null, {"<id>": {"logprob", "rank",
        "decoded_token"}, ...}, ...], ...}], ...}

Position j >= 1 of a prompt holds the teacher's top-K tokens of the distribution that predicts
token j, plus token j itself (so K or K+1 entries); ``rank`` is 1 + the number of tokens with a
strictly larger logit. One opd-only request field, ``opd_logprobs_from`` (per prompt, the first
position to score; earlier ones answer null), lets opd's trainer skip the prompt positions it never
reads. opd's own trainer gets the same numbers as arrays instead (:func:`binary_response`,
:mod:`opd.teachers.wire`). Here: a request parsed and checked against the server's :class:`Limits`
(a bad one is a :class:`RequestError`, answered as OpenAI's JSON error), and the scores
(:class:`SeqScores`) encoded as either answer; no HTTP, no model.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import torch

from opd.teachers import wire


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, and an OpenAI-style error type."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}


@dataclass
class Limits:
    """Bounds on one request and on one forward pass (``max_prompt_tokens`` 0, as ``opd serve-teacher``'s
    default: :class:`opd.teachers.app.TeacherApp` sets the model's context length)."""

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


def dumps(payload: dict) -> bytes:
    """A JSON answer's bytes."""
    return json.dumps(payload, separators=(",", ":")).encode()  # compact: ~10% fewer bytes
