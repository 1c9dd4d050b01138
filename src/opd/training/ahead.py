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
  so the older weights that made them need not be kept. A resume must keep the run's S. Each rank's
  worker makes that rank's share of a step, so a multi-rank checkpoint holds every rank's, gathered to
  rank 0 (which writes it) and taken back by each rank by its index: a resume keeps the number of ranks.
* **A worker that dies** is started again and every request in flight sent again (each keeps its
  weights until its rollouts are taken), so nothing is lost; the restarts are counted
  (``rollout/worker_restarts``), and a request that kills :data:`RESTARTS` workers in a row stops the run.
* **The engine** is the trainer's (``--rollout-engine``, :mod:`opd.rollout.registry`): the worker reaches
  it through its handle (:mod:`opd.rollout.reach`), sent with each request (opd's own loop runs on the
  worker's copy of the student; a vLLM server is synced with the request's weights and checked against them). An engine the
  worker finds gone is the owner's to bring back, as on-policy: the trainer restarts it (the server opd
  started) or waits for it (``--vllm-wait``) and sends the request again, with the engine's address
  now; one that cannot be brought back stops the run at the step, checkpointing the step before, whose
  checkpoint then holds the requests not yet made (their weights), made again on ``--resume``.
* What staleness does to the objectives: the divergences (LSM, full KL) are computed exactly on
  states an older policy visited, and need no correction; the sampled-token policy gradient is
  corrected with a truncated importance weight (:func:`opd.losses.truncated_importance_weight`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, cast

import torch

from opd.config import TrainConfig
from opd.errors import UserError
from opd.hub import resolve_model
from opd.rollout.engine import EngineContext, EngineUnavailable, RolloutEngine
from opd.rollout.reach import EngineDown, EngineHandle, bring_back, handle_of
from opd.training.distributed import Dist

# Workers a single request may take down in a row before the run stops (a request that always kills its
# worker, out of memory say, would otherwise restart it for ever).
RESTARTS = 3

Parts = list[tuple[int, list[int], list[int]]]  # per task of the step: (task index, items, seeds)
# step -> (policy step, its rollouts made, or the request to make them): a checkpoint's, one rank's
InFlight = dict[int, tuple[int, Any]]


@dataclass
class Request:
    """One step's rollouts: asked for with the weights of ``policy_step``, then made and taken."""

    step: int
    policy_step: int
    parts: Parts
    weights: dict[str, torch.Tensor] | None  # dropped once the rollouts are back
    future: Future | None = None
    result: tuple[list, dict[str, float]] | None = None  # per part (batch, rows, records); the worker's metrics
    handle: EngineHandle | None = None  # the engine it was sent to
    downs: int = 0  # times the worker found the engine gone making it

    def made(self) -> tuple[list, dict[str, float]] | None:
        """The rollouts once made, waited for without touching the worker (so another thread may ask
        while the trainer works); None where the worker died or found the engine gone making them
        (:meth:`AheadRollouts.take` has them made again)."""
        if self.result is not None:
            return self.result
        try:
            return cast(Future, self.future).result()
        except (BrokenProcessPool, EngineDown):
            return None


def split_threads(total: int) -> tuple[int, int]:
    """(trainer, worker) torch threads out of ``total``: the worker half, rounded down, at least one each."""
    worker = max(1, total // 2)
    return max(1, total - worker), worker


class AheadRollouts:
    """The worker and the requests in flight (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, threads: int, engine: RolloutEngine):
        """``engine``: the trainer's, which the worker reaches (its handle) and the trainer brings back."""
        self.cfg, self.threads, self.engine = cfg, threads, engine
        self.pending: dict[int, Request] = {}  # sent, not yet taken
        self.taken: dict[int, Request] = {}  # the last taken: its step may end before a checkpoint covers it
        self.last = -1
        self.restarts = 0
        self.gone = False  # the engine could not be brought back: the run stops (see in_flight)
        self.initargs = (cfg, threads)
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
        self._send(req)
        self.pending[step] = req
        self.last = max(self.last, step)

    def _send(self, req: Request) -> None:
        """To the worker, for the engine as it is now (sent, a request holds its weights until taken)."""
        req.handle = handle_of(self.engine)
        req.future = self.pool.submit(_generate, cast(dict, req.weights), req.parts, req.handle)

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
        deaths = 0
        while req.result is None:
            try:
                req.result = req.future.result()  # type: ignore[union-attr]  # sent: it has a future
            except BrokenProcessPool:
                if deaths == RESTARTS:
                    raise UserError(
                        f"the rollout worker died {RESTARTS + 1} times making step {req.step}'s rollouts (out of "
                        "memory, or it failed to start: its error is printed above); the last checkpoint is kept: "
                        "fix that and --resume, or train with --max-staleness 0"
                    ) from None
                deaths += 1
                self._restart()
            except EngineDown as down:
                self._resend(req, down)
        return req.result

    def _resend(self, req: Request, down: EngineDown) -> None:
        """The worker found the engine gone making ``req``: its owner brings it back (once for all the
        requests sent to that address), then the request goes again, to the engine as it is now."""
        req.downs += 1
        try:
            if req.downs > RESTARTS:  # the engine answers its owner but never the worker
                raise EngineUnavailable(f"{down}; the rollout worker found it gone {req.downs} times in a row")
            if req.handle == handle_of(self.engine):
                bring_back(self.engine, down)
        except EngineUnavailable:
            self.gone = True
            raise
        self._send(req)

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
                self._send(req)

    def in_flight(self, after: int) -> InFlight:
        """What a checkpoint of step ``after`` holds: the rollouts of the steps after it that were asked
        for with weights it has seen (up to ``after`` + S), waited for: step -> (policy step, (rollouts,
        the worker's metrics of them)). Once the engine is gone for good, a request the worker could not
        make is held as it was asked, ``{"parts", "weights"}``, for the resumed run to make."""
        self.taken = {s: r for s, r in self.taken.items() if s > after}
        out: InFlight = {}
        for step in sorted({*self.taken, *self.pending}):
            if step > after + self.cfg.rollout.max_staleness:
                continue  # asked for with weights newer than the checkpoint's: a resume asks again
            req = self.taken.get(step) or self.pending[step]
            made = req.made() if self.gone else self._wait(req)
            out[step] = (req.policy_step, made if made is not None else {"parts": req.parts, "weights": req.weights})
        return out

    def load(self, saved: InFlight) -> None:
        """The rollouts a checkpoint held, in flight again (made: the worker need not make them; the
        requests the engine could not make: sent to the worker again)."""
        for step, (policy_step, result) in saved.items():
            if isinstance(result, dict):
                self.pending[step] = Request(step, policy_step, result["parts"], result["weights"])
                self._send(self.pending[step])
            else:
                self.pending[step] = Request(step, policy_step, [], None, result=result)
            self.last = max(self.last, step)

    def worker_pids(self) -> list[int]:
        return list(getattr(self.pool, "_processes", None) or {})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------- in checkpoints


def saved_in_flight(dist: Dist, mine: InFlight) -> list[InFlight] | InFlight | None:
    """A checkpoint's ``"ahead"``: every rank's rollouts in flight (``mine``: this rank's), as CPU tensors,
    gathered to rank 0, in rank order (one process: its own, as a checkpoint always held them); None on
    the other ranks, which write nothing."""
    ranks = dist.gather_to_main(on_cpu(mine))
    return ranks if ranks is None or dist.active else ranks[0]


def rank_share(saved: list[InFlight] | InFlight, rank: int) -> InFlight:
    """This rank's rollouts in flight out of a checkpoint's ``"ahead"`` (:func:`saved_in_flight`); a
    multi-rank checkpoint written before each rank's were kept is refused before this, by
    :func:`opd.training.resuming.check_same_run`."""
    return saved[rank] if isinstance(saved, list) else saved


def on_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (in lists, tuples, dicts and dataclasses such as a RolloutBatch) on
    the CPU: another rank's device means nothing to rank 0, and a checkpoint is read on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: on_cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


# ----------------------------------------------------------------------------- in the worker

_WORKER: dict[str, Any] = {}


def _init_worker(cfg: TrainConfig, threads: int) -> None:
    """The student and each task's training source, built as the trainer builds them; the engine is
    reached with the first request (:func:`_engine`)."""

    from opd.config import resolve_tasks
    from opd.models.loading import resolve_device
    from opd.training.setup import load_student
    from opd.training.sources import task_data, train_source

    threading.Thread(target=_exit_with_trainer, name="opd-watch-trainer", daemon=True).start()
    torch.set_num_threads(threads)
    model, tok = load_student(cfg, resolve_device(cfg.model.device), check=False)  # the chat options: checked there
    model.eval()
    # the games step here, in this process (a game's result does not depend on where it steps)
    cfgs = [s.cfg.replace(env_workers=0) if s.cfg.env.env else s.cfg for s in resolve_tasks(cfg)]
    sources = [train_source(c, tok, task_data(c)[0]) for c in cfgs]
    _WORKER.update(cfg=cfg, model=model, tok=tok, cfgs=cfgs, sources=sources, engine=None, handle=None)


def _exit_with_trainer() -> None:
    """Leave when the trainer's process ends. A trainer killed outright (kill -9, the OOM killer) never shuts
    its executor down, and this process holds both ends of the executor's call queue, so it would wait for
    work forever, holding a copy of the student (seen after a killed 2-rank run)."""
    trainer = multiprocessing.parent_process()
    if trainer is not None:
        trainer.join()  # returns once the trainer's process has ended
        os._exit(1)


def _engine(handle: EngineHandle) -> RolloutEngine:
    """The trainer's engine as this worker reaches it (made again when its handle changed: a restarted
    server's new address), on this process's model: an engine with weights of its own is synced with
    each request's weights and checked against them, not the trainer's newer ones."""
    from opd.rollout.registry import make_engine

    w = _WORKER
    if w["handle"] != handle:
        if w["engine"] is not None:
            w["engine"].close()
        model_dir = str(
            resolve_model(w["cfg"].model.student, w["cfg"].model.student_revision)
        )  # as the trainer's (setup)
        ctx = EngineContext(w["model"], w["tok"], w["cfg"], model_dir, w["cfgs"], attach=handle.address)
        w["engine"], w["handle"] = make_engine(handle.name, ctx), handle
    return w["engine"]


def _generate(weights: dict[str, torch.Tensor], parts: Parts, handle: EngineHandle) -> tuple[list, dict[str, float]]:
    t0 = time.perf_counter()
    w = _WORKER
    w["model"].load_state_dict(weights)
    engine = _engine(handle)
    engine.weights_changed()  # synced once a request, as its first task's rollout begins
    out, gaps = [], []
    for task, rows, seeds in parts:
        batch, records = w["sources"][task].rollout(engine, rows, seeds, w["cfgs"][task])
        out.append((batch, rows, records))
        if batch.report.policy_gap is not None:
            gaps.append(batch.report.policy_gap)
    stats = {"time/worker_generate": time.perf_counter() - t0}
    if gaps:  # the policy check against the request's weights (the largest over the step's tasks)
        stats["rollout/engine_logprob_gap"] = max(gaps)
    return out, stats
