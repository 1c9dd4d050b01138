"""The trainer's client for a served teacher (``opd train --teacher-url URL``).

:class:`HTTPTeacher` implements :class:`opd.teacher.TeacherScorer` over vLLM's OpenAI-compatible
completions endpoint with ``prompt_logprobs`` (``opd serve-teacher``, ``vllm serve``, or any
server answering in that format): each rollout is sent as its prompt (without left padding)
followed by its response, and the answer's entry at position ``p + t`` (p = that prompt's
length) gives response token t's teacher top-K and the teacher's log-prob of the sampled token.
Rollouts go in several requests at once, so the server can batch them; connection errors,
timeouts and 5xx answers are retried with exponential backoff. To opd's own server the client
also sends ``opd_logprobs_from``, so only response positions are scored and sent back.

What a vLLM-format server cannot give: log-probs of arbitrary query tokens (student-side
supports), full-vocabulary logits (``full_kl``) and the full-logit diagnostics (skipped: their
metrics are absent from ``metrics.jsonl``). :func:`opd.teacher.make_teacher` refuses the options that need them.

Vocabulary: opd's server answers ``GET /opd/vocab`` with a hash of its tokenizer's vocabulary,
which must equal the student's; a foreign server cannot say, so a warning is given and every
returned token id is still checked against the student's vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from opd.errors import UserError
from opd.rollout import RolloutBatch
from opd.teacher import TeacherScores

SERVED_OBJECTIVES = "--objective sampled, or --objective lsm with --support teacher_topk or teacher_topk_plus_sampled"


def vocab_info(tokenizer, head_rows: int) -> dict:
    """What ``GET /opd/vocab`` answers: the tokenizer's size and a hash of its token -> id map."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()
    return {"tokens": len(items), "head_rows": int(head_rows), "sha256": digest}


class HTTPTeacher:
    """A served teacher behind :class:`~opd.teacher.TeacherScorer` (top-K and sampled log-probs)."""

    def __init__(self, url: str, tokenizer, vocab_rows: int, *, timeout: float = 120.0, retries: int = 3,
                 backoff: float = 0.5, prompts_per_request: int = 16, concurrency: int = 4):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--teacher-url {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.vocab_rows = vocab_rows
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.prompts_per_request, self.concurrency = prompts_per_request, concurrency
        models = self._request("GET", "/v1/models")
        try:
            self.model_name = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{self.url}/v1/models did not list a model; is --teacher-url an OpenAI-compatible server?") from None
        self.vocab_verified = self._check_vocab(tokenizer)

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, payload: dict | None = None, missing_ok: bool = False):
        """One JSON request with retries; ``None`` for a 404 when ``missing_ok``."""
        data = None if payload is None else json.dumps(payload).encode()
        fix = f"start it (opd serve-teacher TEACHER_DIR --port PORT) or fix --teacher-url {self.url}"
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    body = resp.read()
                break
            except urllib.error.HTTPError as err:
                if err.code == 404 and missing_ok:
                    return None
                if err.code < 500 or attempt == self.retries:
                    raise UserError(f"teacher server {self.url}{path} answered HTTP {err.code}: "
                                    f"{_error_message(err)}") from None
                reason = f"HTTP {err.code}"
            except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
                reason = str(getattr(err, "reason", err))
                if attempt == self.retries:
                    raise UserError(f"teacher server {self.url} is unreachable after {attempt + 1} attempts "
                                    f"({reason}); {fix}") from None
            time.sleep(self.backoff * 2**attempt)
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"teacher server {self.url}{path} answered something that is not JSON; "
                            "is --teacher-url a vLLM-compatible server?") from None

    def _check_vocab(self, tokenizer) -> bool:
        theirs = self._request("GET", "/opd/vocab", missing_ok=True)
        if theirs is None:
            warnings.warn(f"teacher server {self.url} does not report its vocabulary (not an opd server), so it "
                          "could not be verified; make sure it serves a model with the student's tokenizer",
                          stacklevel=3)
            return False
        ours = vocab_info(tokenizer, self.vocab_rows)
        if theirs.get("sha256") != ours["sha256"] or theirs.get("head_rows") != ours["head_rows"]:
            raise UserError(f"the served teacher's vocabulary ({theirs.get('tokens')} tokens, {theirs.get('head_rows')} "
                            f"output rows) differs from the student's ({ours['tokens']} tokens, {ours['head_rows']} "
                            "rows); serve a teacher from the student's model family")
        return True

    # ------------------------------------------------------------------ scoring

    def score(self, batch: RolloutBatch, k: int, query_ids_NTQ=None, diag_index_M=None) -> TeacherScores:
        """Top-K and sampled-token log-probs at every response position; no diagnostic logits."""
        if query_ids_NTQ is not None:
            raise UserError(f"a served teacher cannot score student-side supports; use {SERVED_OBJECTIVES}")
        N, T = batch.response_ids_NT.shape
        prompts, lens = [], batch.response_mask_NT.sum(-1).tolist()
        for i in range(N):
            p = batch.input_ids_NL[i, : batch.prompt_len][batch.attention_mask_NL[i, : batch.prompt_len].bool()]
            prompts.append(p.tolist())
        seqs = [p + batch.response_ids_NT[i, : lens[i]].tolist() for i, p in enumerate(prompts)]
        groups = [list(range(s, min(s + self.prompts_per_request, N))) for s in range(0, N, self.prompts_per_request)]
        starts = [len(p) for p in prompts]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            answers = list(pool.map(lambda g: self._complete([seqs[i] for i in g], k, [starts[i] for i in g]), groups))
        # Positions past a rollout's end are masked out of every loss; they get a harmless filler.
        ids = torch.arange(k, device="cpu").expand(N, T, k).clone()
        lps = torch.full((N, T, k), -math.log(k), device="cpu")
        sampled = torch.zeros(N, T, device="cpu")
        for group, choices in zip(groups, answers):
            for i, plp in zip(group, choices):
                self._fill(plp, len(prompts[i]), seqs[i], k, ids[i], lps[i], sampled[i])
        dev = batch.response_ids_NT.device
        return TeacherScores(topk_ids_NTK=ids.to(dev), topk_logprobs_NTK=lps.to(dev), sampled_logprobs_NT=sampled.to(dev))

    def full_logits(self, batch: RolloutBatch) -> torch.Tensor:
        raise UserError(f"a served teacher does not return full-vocabulary logits; use {SERVED_OBJECTIVES}")

    def _complete(self, seqs: list[list[int]], k: int, starts: list[int]) -> list[list]:
        """POST the sequences; each choice's ``prompt_logprobs`` in prompt order."""
        payload = {"model": self.model_name, "prompt": seqs, "max_tokens": 1, "prompt_logprobs": k, "temperature": 1.0}
        if self.vocab_verified:  # opd's server: score only the responses (see opd.serve)
            payload["opd_logprobs_from"] = starts
        answer = self._request("POST", "/v1/completions", payload)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            out = [c["prompt_logprobs"] for c in choices]
        except (KeyError, TypeError):
            raise self._malformed("no choices[].index / prompt_logprobs in the answer") from None
        if len(out) != len(seqs) or any(not isinstance(p, list) or len(p) != len(s) for p, s in zip(out, seqs)):
            raise self._malformed(f"expected {len(seqs)} choices with one prompt_logprobs entry per token")
        return out

    def _fill(self, plp: list, p: int, seq: list[int], k: int, ids_TK, lps_TK, sampled_T) -> None:
        """Response token t is entry p + t: its top-K (the K largest) and the given token's log-prob."""
        top_ids, top_lps, given_lps = [], [], []
        for t in range(len(seq) - p):
            entry, given = plp[p + t], seq[p + t]
            try:
                pairs = sorted(((float(v["logprob"]), int(tid)) for tid, v in entry.items()), key=lambda x: -x[0])
                given_lps.append(float(entry[str(given)]["logprob"]))
            except (AttributeError, KeyError, TypeError, ValueError):
                raise self._malformed(f"position {p + t} lacks the given token {given} or a numeric logprob") from None
            if len(pairs) < k:
                raise UserError(f"teacher server {self.url} returned {len(pairs)} top tokens where --k {k} were asked; "
                                "raise the server's limit (vllm serve --max-logprobs) or lower --k")
            if len(pairs) > k + 1:
                raise self._malformed(f"position {p + t} has {len(pairs)} entries for prompt_logprobs={k}")
            # K + 1 entries: the given token is the extra one, outside the top-K.
            top = [x for x in pairs if x[1] != given] if len(pairs) == k + 1 else pairs
            if any(not 0 <= tid < self.vocab_rows for _, tid in top) or any(not lp <= 1e-4 for lp, _ in top):
                raise self._malformed(f"position {p + t} holds a token id outside the student's vocabulary "
                                      f"[0, {self.vocab_rows}) or a log-prob that is not <= 0")
            top_lps.append([lp for lp, _ in top])
            top_ids.append([tid for _, tid in top])
        n = len(given_lps)
        ids_TK[:n], lps_TK[:n], sampled_T[:n] = (torch.tensor(x, device="cpu") for x in (top_ids, top_lps, given_lps))

    def _malformed(self, what: str) -> UserError:
        return UserError(f"teacher server {self.url} sent a malformed prompt_logprobs answer ({what}); "
                         "--teacher-url must be a vLLM-compatible completions server")


def _error_message(err: urllib.error.HTTPError) -> str:
    """The server's own message: OpenAI's {"error": {"message"}} or older vLLM's {"message"}."""
    try:
        body = json.loads(err.read())
        return body["error"]["message"] if isinstance(body.get("error"), dict) else body["message"]
    except Exception:  # a foreign server's error page: report its status line only
        return str(err.reason)
