"""The served teacher's scoring: forward passes over the sequences of concurrent requests.

:func:`score_sequences` scores token sequences with the same code as the in-process teacher
(:func:`opd.losses.topk_and_gather_from_hidden` on :func:`opd.models.loading.final_hidden` and the
model's own head, :func:`opd.models.head.model_head`), so they match it to float rounding.
:class:`BatchScorer` is one worker thread that merges what arrives within ``batch_wait_ms`` (up to
``max_batch_tokens`` padded tokens) into forward passes over chunks of sequences of similar length;
a request waiting for its forward pass holds no thread, and a batch that fails fails only the
requests that fail on their own.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import cast

import torch

from opd.losses import topk_and_gather_from_hidden
from opd.losses.head import logits_no_grad
from opd.models.head import model_head
from opd.models.loading import final_hidden, model_device
from opd.rollout.forward import ROWS_PER_CHUNK
from opd.teachers.completions import Limits, RequestError, SeqScores


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
