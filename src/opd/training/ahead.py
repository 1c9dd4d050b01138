"""Rollouts generated ahead of the trainer (``opd train --max-staleness S``).

An on-policy step runs its stages one after another: generate, score, update. With S > 0 the
student's rollouts come from a worker process that generates step t + S while the trainer scores
and updates step t, as the async modes of TRL, verl and NeMo-RL do. What that means, and why:

* **Step t's rollouts come from the policy of step max(0, t - S)**: the weights the trainer held
  when that step began. At the start of step u the trainer sends those weights with the request
  for step u + S, then takes step u's rollouts, which the worker made while the trainer worked on
  the steps before. A request carries its own weights and the worker is a function of (weights,
  items, seeds), so a run stays a function of its seeds at any S, and S never depends on timing.
* **One worker process** (a single-process ``ProcessPoolExecutor``, started with ``spawn`` as the
  environment workers are), built from the run's config: the student from ``--student`` and each
  task's training prompts or games with their engine (opd's own sampling loop; games step inside
  the worker, whose results do not depend on where they step). It runs requests in the order sent.
  The cores' torch threads are split between the worker and the trainer: where both sides share
  cores they contend (``benchmarks/bench_async.py`` measures it).
* **A checkpoint holds the rollouts in flight** (waited for): ``--resume`` takes the same rollouts,
  so the older weights that made them need not be kept. A resume must keep the run's S.
* **A worker that dies** is started again and every request in flight sent again (each keeps its
  weights until its rollouts are taken), so nothing is lost; the restarts are counted
  (``rollout/worker_restarts``), and a request that kills :data:`RESTARTS` workers in a row stops the run.
* What staleness does to the objectives: the divergences (LSM, full KL) are computed exactly on
  states an older policy visited, and need no correction; the sampled-token policy gradient is
  corrected with a truncated importance weight (:func:`opd.losses.truncated_importance_weight`).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from opd.errors import UserError

# Workers a single request may take down in a row before the run stops (a request that always kills its
# worker, out of memory say, would otherwise restart it for ever).
RESTARTS = 3

Parts = list[tuple[int, list[int], list[int]]]  # per task of the step: (task index, items, seeds)


@dataclass
class Request:
    """One step's rollouts: asked for with the weights of ``policy_step``, then made and taken."""

    step: int
    policy_step: int
    parts: Parts
    weights: dict[str, torch.Tensor] | None  # dropped once the rollouts are back
    future: Future | None = None
    result: tuple[list, dict[str, float]] | None = None  # per part (batch, rows, records); the worker's metrics

    def made(self) -> tuple[list, dict[str, float]] | None:
        """The rollouts once made, waited for without touching the worker (so another thread may ask
        while the trainer works); None where the worker died making them (:meth:`AheadRollouts.take`
        has them made again)."""
        if self.result is not None:
            return self.result
        try:
            return cast(Future, self.future).result()
        except BrokenProcessPool:
            return None


def split_threads(total: int) -> tuple[int, int]:
    """(trainer, worker) torch threads out of ``total``: the worker half, rounded down, at least one each."""
    worker = max(1, total // 2)
    return max(1, total - worker), worker


class AheadRollouts:
    """The worker and the requests in flight (see the module docstring)."""

    def __init__(self, cfg, threads: int, vllm=None):
        """``vllm``: with --rollout-engine vllm, the trainer's engine (the server it started or was given),
        whose server the worker syncs and samples from; closed with this."""
        self.cfg, self.threads, self.vllm = cfg, threads, vllm
        engine = None if vllm is None else (vllm.url, str(vllm.weights_dir), vllm.max_gap)
        self.pending: dict[int, Request] = {}  # sent, not yet taken
        self.taken: dict[int, Request] = {}  # the last taken: its step may end before a checkpoint covers it
        self.last = -1
        self.restarts = 0
        self.initargs = (cfg, threads, engine)
        self.pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=self.initargs,
        )

    def submit(self, step: int, policy_step: int, parts: Parts, weights: dict[str, torch.Tensor]) -> None:
        req = Request(step, policy_step, parts, weights)
        req.future = self.pool.submit(_generate, weights, parts)
        self.pending[step] = req
        self.last = max(self.last, step)

    def take(self, step: int) -> tuple[list, int, dict[str, float]]:
        """Step ``step``'s rollouts (per part: batch, rows, records), the step of the policy that made
        them and the worker's metrics of them (its seconds; vLLM's policy check); waits for them."""
        req = self.pending[step]
        parts, stats = self._wait(req)
        del self.pending[step]
        req.weights = None
        # a checkpoint covers at least step - 1 from now on (a cut-short step checkpoints its predecessor)
        self.taken = {step: req}
        return parts, req.policy_step, stats

    def _wait(self, req: Request) -> tuple[list, dict[str, float]]:
        for attempt in range(RESTARTS + 1):
            if req.result is not None:
                break
            try:
                req.result = req.future.result()  # type: ignore[union-attr]  # sent: it has a future
            except BrokenProcessPool:
                if attempt == RESTARTS:
                    raise UserError(
                        f"the rollout worker died {RESTARTS + 1} times making step {req.step}'s rollouts (out of "
                        "memory, or it failed to start: its error is printed above); the last checkpoint is kept: "
                        "fix that and --resume, or train with --max-staleness 0"
                    ) from None
                self._restart()
        return req.result  # type: ignore[return-value]  # set by the loop above

    def _restart(self) -> None:
        """A new worker; the requests in flight whose rollouts did not come back are sent to it again."""
        for req in self.pending.values():
            f = req.future
            if req.result is None and f is not None and f.done() and not f.cancelled() and f.exception() is None:
                req.result = f.result()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.restarts += 1
        self.pool = self._start()
        for step in sorted(self.pending):
            req = self.pending[step]
            if req.result is None:  # sent, so it holds its weights (only a loaded request has none, and is made)
                req.future = self.pool.submit(_generate, cast(dict, req.weights), req.parts)

    def in_flight(self, after: int) -> dict[int, tuple[int, tuple[list, dict[str, float]]]]:
        """What a checkpoint of step ``after`` holds: the rollouts of the steps after it that were asked
        for with weights it has seen (up to ``after`` + S), waited for: step -> (policy step, (rollouts,
        the worker's metrics of them))."""
        self.taken = {s: r for s, r in self.taken.items() if s > after}
        out = {}
        for step in sorted({*self.taken, *self.pending}):
            if step > after + self.cfg.max_staleness:
                continue  # asked for with weights newer than the checkpoint's: a resume asks again
            req = self.taken.get(step) or self.pending[step]
            out[step] = (req.policy_step, self._wait(req))
        return out

    def load(self, saved: dict[int, tuple[int, tuple[list, dict[str, float]]]]) -> None:
        """The rollouts a checkpoint held, in flight again (made: the worker need not make them)."""
        for step, (policy_step, result) in saved.items():
            self.pending[step] = Request(step, policy_step, [], None, result=result)
            self.last = max(self.last, step)

    def worker_pids(self) -> list[int]:
        return list(getattr(self.pool, "_processes", None) or {})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.vllm is not None:
            self.vllm.close()


# ----------------------------------------------------------------------------- in the worker

_WORKER: dict[str, Any] = {}


def _init_worker(cfg, threads: int, vllm: tuple[str, str, float] | None) -> None:
    """The student, and each task's training source and engine, built as the trainer builds them; with
    ``vllm`` (the server's URL, the weights folder it reads, the policy check's bound) the engines sample
    from that server, synced with this process's model: the request's weights, so the policy check
    compares the engine with the policy that sampled, not the trainer's newer one."""
    from dataclasses import replace

    from opd.config import resolve_tasks
    from opd.models.loading import load_model, load_tokenizer, resolve_device
    from opd.training.sources import task_data, train_source

    torch.set_num_threads(threads)
    tok = load_tokenizer(cfg.student, "student")
    model = load_model(cfg.student, "student", cfg.dtype, resolve_device(cfg.device))
    model.eval()
    # the games step here, in this process (a game's result does not depend on where it steps)
    cfgs = [replace(s.cfg, env_workers=0) if s.cfg.env else s.cfg for s in resolve_tasks(cfg)]
    sources = [train_source(c, tok, task_data(c)[0]) for c in cfgs]
    engines = [s.engine(model, tok) for s in sources]
    server = None
    if vllm is not None:
        from opd.rollout.vllm_engine import VLLMRollout

        url, weights, max_gap = vllm
        key = os.environ.get("OPD_VLLM_API_KEY", "")
        server = VLLMRollout(model, tok, Path(weights), url=url, api_key=key, max_gap=max_gap)
        server.watched = True  # synced once a request (_generate), not before every task's batch
        engines = [s.on_vllm(server, tok) for s in sources]
    _WORKER.update(model=model, cfgs=cfgs, sources=sources, engines=engines, vllm=server)


def _generate(weights: dict[str, torch.Tensor], parts: Parts) -> tuple[list, dict[str, float]]:
    t0 = time.perf_counter()
    w = _WORKER
    w["model"].load_state_dict(weights)
    if w["vllm"] is not None:
        w["vllm"].stale = True
    out, gaps = [], []
    for task, rows, seeds in parts:
        batch, records = w["sources"][task].rollout(w["engines"][task], rows, seeds, w["cfgs"][task])
        out.append((batch, rows, records))
        if w["vllm"] is not None:
            gaps.append(w["vllm"].last_gap)
    stats = {"time/worker_generate": time.perf_counter() - t0}
    if gaps:  # the policy check against the request's weights (the largest over the step's tasks)
        stats["rollout/engine_logprob_gap"] = max(gaps)
    return out, stats
