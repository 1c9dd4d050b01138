"""Runs side by side on one machine: a process each, the CPU threads shared out.

For small models on a CPU, where one process cannot keep the cores busy (an agentic step is mostly
the game engine, single-threaded Python). Used by the demos' objectives and by ``opd experiment
--workers``; a distributed run of one model is torchrun's or accelerate's job, not this."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any


def demo_workers() -> int:
    """How many objectives a demo trains at once: two on a CPU with two cores or more (its small
    models leave a core idle), one on an accelerator (one process keeps it busy)."""
    from opd.models.loading import resolve_device

    return 2 if resolve_device("auto").type == "cpu" and (os.cpu_count() or 1) >= 2 else 1


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """Worker processes started fresh (spawn): no forked torch or engine state."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def with_threads(threads: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with torch limited to ``threads`` CPU threads (what a worker process runs), and
    the run's share of the cores set for an unset ``--env-workers`` (:func:`opd.rollout.games.auto_workers`)."""
    import torch

    from opd.rollout.games import CPU_SHARE_ENV

    torch.set_num_threads(threads)
    os.environ[CPU_SHARE_ENV] = str(threads)
    return fn(*args)
