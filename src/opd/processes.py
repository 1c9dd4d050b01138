"""Processes opd starts, and stopping cleanly: SIGTERM turned into an exception, children that die with us.

A service manager, a job scheduler or a user's ``kill`` ends a process with SIGTERM, whose default
action ends it at once: no ``finally`` runs, so the processes it started (the worker processes of
``opd experiment --workers``, an environment's game workers, a vLLM server) would go on alone.
:func:`stop_on_sigterm` makes SIGTERM raise :class:`Stopped` in the main thread instead, so every
``finally`` on the way out stops what it started, as Ctrl-C (KeyboardInterrupt) does. Checkpoints are
written atomically (a temporary folder renamed), so a stop at any point leaves the last one valid.
:func:`die_with_parent` covers the case no handler can: a parent killed by SIGKILL.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator


class Stopped(Exception):  # noqa: N818 -- what happened, not an error: the run was asked to stop
    """SIGTERM arrived (``signum``): raised where the main thread was, so the way out cleans up."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Stopped` while inside (main thread only: elsewhere Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def worker_started() -> None:
    """In a worker process opd started (a pool's initializer): SIGTERM unwinds it (its run's ``finally``
    stops what the run started), and it gets SIGTERM when its parent dies, even by SIGKILL."""
    signal.signal(signal.SIGTERM, _raise_stopped)
    die_with_parent()


def die_with_parent() -> None:
    """In a child process: SIGTERM when the process that started it ends, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def stop_processes(processes: Iterable, grace: float = 20.0) -> None:
    """SIGTERM to each live process (``multiprocessing.Process``), ``grace`` seconds for them to unwind
    (a run closes its games and engines), then SIGKILL to any still there."""
    live = [p for p in processes if p.is_alive()]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.is_alive():
            p.kill()
            p.join(5.0)
