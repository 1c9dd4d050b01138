"""The trainer's client for a served teacher (``opd train --teacher-url URL[,URL...]``).

:class:`HTTPTeacher` implements :class:`opd.teachers.scoring.TeacherScorer` over vLLM's OpenAI-compatible
completions endpoint with ``prompt_logprobs`` (``opd serve-teacher``, ``vllm serve``, or any
server answering in that format): each rollout is sent as its prompt (without left padding)
followed by its response, and the answer's entry at position ``p + t`` (p = that prompt's
length) gives response token t's teacher top-K and the teacher's log-prob of the sampled token.
Rollouts go in several requests at once, so the server can batch them. Several servers of one teacher
share the requests (:mod:`opd.teachers.pool`: the least busy gets the next, a request a server fails is
sent to another). When no server answers (refused or reset connections, timeouts, answers cut short,
5xx) the teacher is waited for, with capped exponential backoff, for up to ``--teacher-wait`` seconds
(:class:`~opd.service.Patience`): a restart is waited out, at startup too (a trainer launched before
its server), and a teacher that stays down raises :class:`~opd.teachers.scoring.TeacherUnavailable`, on
which the trainer checkpoints the last completed step before it stops. A 4xx answer (408 and 429 aside)
is the request's fault: an error at once. Each server is asked for K once when it joins, so a server
started with too small a ``--max-k`` (vLLM: ``--max-logprobs``) fails at start. To opd's own server the client also sends ``opd_logprobs_from``, so only response
positions are scored and sent back, and asks for them as arrays (:mod:`opd.teachers.wire`) when the
server offers that (vLLM's JSON spends a dict per returned token, built and parsed token by
token in Python on both ends).

What a vLLM-format server cannot give: log-probs of arbitrary query tokens (student-side
supports), full-vocabulary logits (``full_kl``) and the full-logit diagnostics (skipped: their
metrics are absent from ``metrics.jsonl``). :func:`opd.teachers.factory.make_teacher` refuses the options that need them.

Vocabulary: opd's server answers ``GET /opd/vocab`` with a hash of its tokenizer's vocabulary,
which must equal the student's. A vLLM server is asked to tokenize probe texts instead
(``POST /tokenize``: the tokenizer's special and added tokens, its chat template, and a spread of
its vocabulary decoded to text), compared id for id with opd's tokenizer (:func:`probe_texts`): a
probe cannot prove two tokenizers equal, but it catches a model of another family or a changed
special token. A server with neither endpoint gets a one-line warning; every returned token id is
still checked against the student's vocabulary size.

API keys: ``api_key`` (``--teacher-api-key``, better the ``OPD_TEACHER_API_KEY`` environment
variable) goes in every request as ``Authorization: Bearer KEY``, as vLLM's ``--api-key`` and
``opd serve-teacher --api-key`` expect; a 401 is an error naming the variable, never the key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch

from opd.chat import render_chat
from opd.errors import UserError
from opd.losses import Head
from opd.objectives import SERVED_GIVES, usable_with
from opd.rollout.engine import RolloutBatch
from opd.service import Patience, check_url, stderr_line
from opd.teachers import wire
from opd.teachers.pool import Identity, Server, TeacherPool
from opd.teachers.scoring import TeacherScores, filler_scores

__all__ = ["HTTPTeacher", "Patience", "probe_texts", "vocab_info"]

SERVED_OBJECTIVES = usable_with(SERVED_GIVES)


def vocab_info(tokenizer, head_rows: int) -> dict:
    """What ``GET /opd/vocab`` answers: the tokenizer's size and a hash of its token -> id map."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()
    return {"tokens": len(items), "head_rows": int(head_rows), "sha256": digest}


class HTTPTeacher:
    """A served teacher behind :class:`~opd.teachers.scoring.TeacherScorer` (top-K and sampled log-probs).

    ``url``: one server, or several (a list, or comma-separated) serving the same teacher, which share
    the requests (:class:`~opd.teachers.pool.TeacherPool`). ``tokenizer`` is the one whose ids are sent
    (the student's; a cross-tokenizer teacher's own). ``vocab_rows``: the output rows the ids must fall in;
    None takes the head size an opd server reports (the tokenizer's size from a foreign server). ``k``:
    the K each server is asked for once when it joins, so a server that cannot give it fails at start.
    ``binary=False`` keeps vLLM's JSON answers even from an opd server that offers the binary ones.
    ``concurrency``: requests in flight per server. ``patience``: how long the teacher is waited for when
    no server answers, :class:`Patience`'s options (``wait``, ``retries``, ``backoff``, ...)."""

    def __init__(
        self,
        url: str | Sequence[str],
        tokenizer,
        vocab_rows: int | None,
        *,
        timeout: float = 120.0,
        prompts_per_request: int = 16,
        concurrency: int = 4,
        binary: bool = True,
        api_key: str = "",
        k: int | None = None,
        **patience,
    ):
        urls = [u.strip() for u in url.split(",")] if isinstance(url, str) else list(url)
        self.tokenizer, self.vocab_rows, self.k, self.want_binary = tokenizer, vocab_rows, k, binary
        named = ", ".join(urls) if len(urls) > 1 else check_url(urls[0], "--teacher-url")
        self.patience = Patience(
            named, **{"what": "teacher servers" if len(urls) > 1 else "teacher server", **patience}
        )
        self.pool = TeacherPool(urls, self.patience, self._identify, self._verify, key=api_key, timeout=timeout)
        self.url = self.pool.url
        self.prompts_per_request, self.concurrency = prompts_per_request, concurrency * len(urls)
        self._warned: set[str] = set()
        self.pool.start()
        self.vocab_rows = self._rows()  # settled once the servers up at start are checked, never by a thread
        self.model_name = cast(Identity, self.pool.identity).model

    @property
    def vocab_verified(self) -> bool:
        """Whether every server that joined reported its vocabulary (opd's servers), checked against ours."""
        return all(s.info.get("opd") for s in self.pool.servers if s.info)

    @property
    def binary(self) -> bool:
        """Whether every server that joined answers in opd's binary format."""
        return all(s.info.get("binary") for s in self.pool.servers if s.info)

    def _identify(self, server: Server) -> Identity:
        """What ``server`` serves: its model's name and, from opd's server, its vocabulary (``/opd/vocab``)."""
        name = server.client.model_name()
        theirs = server.client.request("GET", "/opd/vocab", missing_ok=True)
        return Identity(name, (theirs if isinstance(theirs, dict) else {}) if theirs is not None else None)

    def _verify(self, server: Server) -> None:
        """``server``'s vocabulary (or its tokenization of probe texts) against ours; then K, asked once."""
        vocab = cast(Identity, server.identity).vocab
        if vocab is None:
            if not self._probe_tokenizer(server) and server.url not in self._warned:
                self._warned.add(server.url)
                stderr_line(
                    f"opd train: warning: teacher server {server.url} reports no vocabulary (/opd/vocab) and has no "
                    "/tokenize endpoint, so its tokenizer could not be checked; make sure it serves a model with "
                    "the student's tokenizer"
                )
        else:
            self._check_vocab(vocab)
        offered = vocab.get("answer_media_types") if vocab is not None else None
        # opd's binary answers (opd.teachers.wire) only from a server that offers them; vLLM's JSON otherwise
        binary = self.want_binary and isinstance(offered, list) and wire.MEDIA_TYPE in offered
        server.info = {"opd": vocab is not None, "binary": binary}
        if self.k is not None:  # one short sequence: a server whose --max-k/--max-logprobs is below K says so now
            seq = (self.tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"] * 2)[:4]
            ids, lps, given = filler_scores(1, len(seq) - 1, self.k, 1)
            self._complete(
                server, [seq], self.k, [1], ids, lps, given.squeeze(-1), torch.ones_like(given[..., 0]).bool()
            )

    def _rows(self) -> int:
        """The output rows the ids must fall in: the student's (``vocab_rows``); for a cross-tokenizer
        teacher (None), the pool's vocabulary's (:attr:`TeacherPool.vocab`: the first opd server's, in
        --teacher-url's order, settled before any server is checked), else the tokenizer's length (vLLM's
        servers report none). Read only, so the servers' checks in parallel threads agree whatever their order."""
        if self.vocab_rows is not None:
            return self.vocab_rows
        vocab = self.pool.vocab.vocab if self.pool.vocab is not None else None
        rows = vocab.get("head_rows") if vocab is not None else None
        return rows if isinstance(rows, int) else len(self.tokenizer)

    def _check_vocab(self, theirs: dict) -> None:
        """opd's server's ``/opd/vocab`` answer against the student's vocabulary."""
        ours = vocab_info(self.tokenizer, self._rows())
        if theirs.get("sha256") != ours["sha256"] or theirs.get("head_rows") != ours["head_rows"]:
            raise UserError(
                f"the served teacher's vocabulary ({theirs.get('tokens')} tokens, {theirs.get('head_rows')} "
                f"output rows) differs from the student's ({ours['tokens']} tokens, {ours['head_rows']} "
                "rows); serve a teacher with the student's tokenizer, or give --teacher-tokenizer DIR (the served "
                "model's tokenizer) for cross-tokenizer OPD"
            )

    def _probe_tokenizer(self, server: Server) -> bool:
        """Tokenize :func:`probe_texts` on the server (vLLM's ``POST /tokenize``) and compare id for id;
        False when the server has no such endpoint. A difference is an error naming both sides."""
        tokenizer = self.tokenizer
        for text in probe_texts(tokenizer):
            payload = {"model": cast(Identity, server.identity).model, "prompt": text, "add_special_tokens": False}
            answer = server.client.request("POST", "/tokenize", payload, missing_ok=True)
            if answer is None:
                return False
            theirs = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(theirs, list):  # some other endpoint of that name: not one to check against
                return False
            ours = tokenizer(text, add_special_tokens=False)["input_ids"]
            if theirs != ours:
                raise UserError(self._tokenizes_differently(server, text, ours, theirs))
        return True

    def _tokenizes_differently(self, server: Server, text: str, ours: list[int], theirs: list) -> str:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        tokenizer = self.tokenizer
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        return (
            f"the served teacher {cast(Identity, server.identity).model!r} at {server.url} tokenizes differently "
            f"from opd's tokenizer ({name}, {len(tokenizer)} tokens): the probe {text[:40]!r} is {len(theirs)} ids "
            f"there and {len(ours)} here, first differing at token {at} (id {theirs[at] if at < len(theirs) else 'none'} "
            f"there, {ours[at] if at < len(ours) else 'none'} here); serve a teacher with the student's tokenizer, "
            "or give --teacher-tokenizer for cross-tokenizer OPD"
        )

    # ------------------------------------------------------------------ scoring

    def score(self, batch: RolloutBatch, k: int, query_ids_NTQ=None, diag_index_M=None) -> TeacherScores:
        """Top-K and sampled-token log-probs at every response position; no diagnostic logits."""
        if query_ids_NTQ is not None:
            raise UserError(f"a served teacher cannot score student-side supports; use {SERVED_OBJECTIVES}")
        N, T = batch.response_ids_NT.shape
        P, step = batch.prompt_len, self.prompts_per_request
        input_NL, attn_NL = batch.input_ids_NL.cpu(), batch.attention_mask_NL[:, :P].cpu().bool()
        response_NT, lens_N = batch.response_ids_NT.cpu(), batch.response_mask_NT.sum(-1).cpu()
        lens = lens_N.tolist()
        ids, lps, sampled = filler_scores(N, T, k, 1)  # positions past a rollout's end keep the filler
        sampled = sampled.squeeze(-1)
        answered_NT = torch.arange(T, device="cpu") < lens_N[:, None]  # the positions an answer holds, in its order

        def one(s: int) -> None:
            # A worker thread builds its request while earlier ones are scored, then writes the answer
            # straight into its rows of the outputs (disjoint rows: the threads never share an element).
            rows = slice(s, min(s + step, N))
            prompts = [input_NL[i, :P][attn_NL[i]].tolist() for i in range(rows.start, rows.stop)]
            seqs = [p + response_NT[i, : lens[i]].tolist() for i, p in zip(range(rows.start, rows.stop), prompts)]
            starts = [len(p) for p in prompts]
            outputs = ids[rows], lps[rows], sampled[rows], answered_NT[rows]
            # the request's tokens: a server's outstanding work (opd's server scores the responses only)
            cost = sum(len(q) - p for q, p in zip(seqs, starts))
            self.pool.send(cost, lambda server: self._complete(server, seqs, k, starts, *outputs))

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = [pool.submit(one, s) for s in range(0, N, step)]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                # requests still queued would each wait out --teacher-wait again before the error shows
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        dev = batch.response_ids_NT.device
        return TeacherScores(
            topk_ids_NTK=ids.to(dev), topk_logprobs_NTK=lps.to(dev), sampled_logprobs_NT=sampled.to(dev)
        )

    def hidden_and_head(self, batch: RolloutBatch) -> tuple[torch.Tensor, Head]:
        raise UserError(f"a served teacher does not return full-vocabulary scores; use {SERVED_OBJECTIVES}")

    def _complete(
        self,
        server: Server,
        seqs: list[list[int]],
        k: int,
        starts: list[int],
        ids_NTK,
        lps_NTK,
        sampled_NT,
        answered_NT,
    ) -> None:
        """POST the sequences to ``server``; write each one's response positions into its row of the outputs
        (only once the whole answer is in: one cut short leaves them for the server the pool asks next)."""
        payload = {
            "model": cast(Identity, server.identity).model,
            "prompt": seqs,
            "max_tokens": 1,
            "prompt_logprobs": k,
            "temperature": 1.0,
        }
        if server.info["opd"]:  # opd's server: score only the responses (see opd.teachers.completions)
            payload["opd_logprobs_from"] = starts
        binary = server.info["binary"]
        accept = wire.MEDIA_TYPE if binary else None
        data = json.dumps(payload).encode()
        # None only for a 404 with missing_ok
        media, body = cast(tuple[str, bytes], server.client.fetch("POST", "/v1/completions", data, accept=accept))
        if binary and media == wire.MEDIA_TYPE:
            try:
                top_ids, top_lps, given = wire.decode_scores(
                    body,
                    [len(s) - p for s, p in zip(seqs, starts)],
                    k,
                    self._rows(),  # see _fill
                )
            except wire.WireError as exc:
                raise UserError(
                    f"teacher server {server.url} sent a malformed binary answer ({exc}); is it an opd "
                    "server of this version? (--teacher-url)"
                ) from None
            ids_NTK[answered_NT], lps_NTK[answered_NT], sampled_NT[answered_NT] = top_ids, top_lps, given
            return
        answer = server.client.decode(body, "/v1/completions")
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            out = [c["prompt_logprobs"] for c in choices]
        except (KeyError, TypeError):
            raise _malformed(server, "no choices[].index / prompt_logprobs in the answer") from None
        if len(out) != len(seqs) or any(not isinstance(p, list) or len(p) != len(s) for p, s in zip(out, seqs)):
            raise _malformed(server, f"expected {len(seqs)} choices with one prompt_logprobs entry per token")
        for n, (plp, p, seq) in enumerate(zip(out, starts, seqs)):
            self._fill(server, plp, p, seq, k, ids_NTK[n], lps_NTK[n], sampled_NT[n])

    def _fill(self, server: Server, plp: list, p: int, seq: list[int], k: int, ids_TK, lps_TK, sampled_T) -> None:
        """Response token t is entry p + t: its top-K (the K largest) and the given token's log-prob."""
        rows = self._rows()  # vocab_rows once settled; before, at the K check of a server joining
        top_ids, top_lps, given_lps = [], [], []
        for t in range(len(seq) - p):
            entry, given = plp[p + t], seq[p + t]
            try:
                pairs = sorted(((float(v["logprob"]), int(tid)) for tid, v in entry.items()), key=lambda x: -x[0])
                given_lps.append(float(entry[str(given)]["logprob"]))
                if not given_lps[-1] <= 1e-4:
                    raise ValueError
            except (AttributeError, KeyError, TypeError, ValueError):
                raise _malformed(
                    server, f"position {p + t} lacks the given token {given} or a log-prob <= 0 for it"
                ) from None
            if len(pairs) < k:
                raise UserError(
                    f"teacher server {server.url} returned {len(pairs)} top tokens where --k {k} were asked; "
                    "raise the server's limit (vllm serve --max-logprobs) or lower --k"
                )
            if len(pairs) > k + 1:
                raise _malformed(server, f"position {p + t} has {len(pairs)} entries for prompt_logprobs={k}")
            # K + 1 entries: the given token is the extra one, outside the top-K.
            top = [x for x in pairs if x[1] != given] if len(pairs) == k + 1 else pairs
            # "not lp <= 0" also refuses NaN, which the losses would mask as they mask -inf: silently
            if any(not 0 <= tid < rows for _, tid in top) or any(not lp <= 1e-4 for lp, _ in top):
                raise _malformed(
                    server,
                    f"position {p + t} holds a token id outside the student's vocabulary "
                    f"[0, {self._rows()}) or a log-prob that is not <= 0",
                )
            top_lps.append([lp for lp, _ in top])
            top_ids.append([tid for _, tid in top])
        n = len(given_lps)
        ids_TK[:n], lps_TK[:n], sampled_T[:n] = (torch.tensor(x, device="cpu") for x in (top_ids, top_lps, given_lps))


def _malformed(server: Server, what: str) -> UserError:
    return UserError(
        f"teacher server {server.url} sent a malformed prompt_logprobs answer ({what}); "
        "--teacher-url must be a vLLM-compatible completions server"
    )


def probe_texts(tokenizer, spread: int = 256) -> list[str]:
    """Texts whose tokenization tells tokenizers apart: each special and added token inside text (EOS,
    ``<think>``, template markers), the chat template applied to a short exchange where there is one, and
    ``spread`` ids spaced evenly over the vocabulary, decoded to text (another vocabulary splits it apart)."""
    specials = list(dict.fromkeys([*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()]))
    texts = ["The answer is 42. Ünïcödé, tabs\tand  spaces; x = 3 * (7 + 5)\n"]
    texts += [f"a{tok} b {tok}\n" for tok in specials]
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
        try:
            texts.append(render_chat(tokenizer, chat, add_generation_prompt=False))
        except Exception:  # a template that needs other roles or fields: the other probes still run
            pass
    step = max(len(tokenizer) // spread, 1)
    texts.append(tokenizer.decode(list(range(0, len(tokenizer), step)), skip_special_tokens=True))
    return texts
