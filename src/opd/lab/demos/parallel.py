"""Runs side by side on one machine: a process each, the CPU threads shared out.

For small models on a CPU, where one process cannot keep the cores busy (an agentic step is mostly
the game engine, single-threaded Python). Used by the demos' objectives and by ``opd experiment
--workers``; a distributed run of one model is torchrun's or accelerate's job, not this."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from opd.processes import stop_processes, worker_started


def demo_workers() -> int:
    """How many objectives a demo trains at once: two on a CPU with two cores or more (its small
    models leave a core idle), one on an accelerator (one process keeps it busy)."""
    from opd.models.loading import resolve_device

    return 2 if resolve_device("auto").type == "cpu" and (os.cpu_count() or 1) >= 2 else 1


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


@contextlib.contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """Worker processes started fresh (spawn): no forked torch or engine state. Leaving by an exception
    (an error, Ctrl-C, SIGTERM: :mod:`opd.processes`) stops them within seconds -- each unwinds its run,
    whose last checkpoint stays valid -- where the executor's own exit would wait for every queued run;
    a worker also ends when this process dies."""
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=worker_started
    )
    try:
        yield pool
    except BaseException:
        workers_now = list((pool._processes or {}).values())  # the executor keeps them in a private dict
        pool.shutdown(wait=False, cancel_futures=True)
        stop_processes(workers_now)
        raise
    pool.shutdown(wait=True)


def with_threads(threads: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with torch limited to ``threads`` CPU threads (what a worker process runs), and
    the run's share of the cores set for an unset ``--env-workers`` (:func:`opd.rollout.game_set.auto_workers`)."""
    import torch

    from opd.rollout.game_set import CPU_SHARE_ENV

    torch.set_num_threads(threads)
    os.environ[CPU_SHARE_ENV] = str(threads)
    return fn(*args)
