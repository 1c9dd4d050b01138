"""Game sessions in worker processes: the trainer generates while the games step, several at once.

An episode batch's games step one after another in the trainer's process unless they are given
to :class:`EnvWorkers`, which wraps an environment and hosts its sessions in ``workers`` processes
(``opd train --env-workers N``)::

    env = EnvWorkers(get_env("alfworld", level=1), workers=2, step_timeout=60)
    EpisodeRollout(model, tok).play(env, env.games("train")[:16], seeds=range(16), ...)
    env.close()

:mod:`opd.rollout.episodes` talks to the games through :class:`Sessions` (open, step, wait for
the answers, close), which it gets from :func:`sessions`: :class:`InProcess` for a plain
environment (what it always did: each call runs at once, in this process) or the workers' for an
:class:`EnvWorkers`.

Design, and why:

* **One single-process ``ProcessPoolExecutor`` per worker** (the standard library's futures, no
  RPC of our own), started with ``spawn`` (the trainer holds torch's threads and the engines'
  state, which a fork would copy half-made). A worker imports only what it needs to play: this
  module (torch-free, as are :mod:`opd`, :mod:`opd.envs` and the engines' modules) and what the
  environment's pickle names, not the trainer's main module (see :func:`_main_left_behind`), so
  it never imports torch or transformers. A session's state lives in one process, so episode
  ``i`` of a batch is pinned to worker ``i mod N`` for its whole life; a worker runs its calls in
  the order they were sent. A session pool in one process with threads (``multiprocessing.managers``)
  would give the same pinning but needs a thread in the trainer per call in flight, and the
  engines' Python code holds the GIL anyway, so it would not step two games at once.
* **The environment is pickled once** and unpickled by each worker as it starts (so the engines
  load there, in parallel); an environment that cannot be pickled, or a worker that cannot load it
  (its engine missing there), is a :class:`~opd.errors.UserError` before any episode is played.
* **Results do not depend on the workers.** A game is a function of its actions, and the engine
  keeps every episode's turns and seeds as they are with 0, 1 or N workers; only the wall time
  changes. Each call returns what the in-process call would (the first observation; the
  admissible commands and the step's result), and an :class:`~opd.envs.environment.EnvError` raised in a
  worker comes back as itself.
* **Failures end episodes, never the run.** A worker that dies (killed, or crashed inside an
  engine) ends every episode whose session it held as an ``EnvError`` (counted as environment
  errors, as a game that crashes in-process is), and is replaced before the next batch. A call
  that takes longer than ``step_timeout`` seconds from the moment its worker could start it (its
  earlier calls answered) is a hung game: its worker is killed, which ends that episode and the
  other episodes on the same worker, all counted.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any, Protocol, cast

from opd.envs.environment import EnvError, Environment, Game, GameSession
from opd.errors import UserError

__all__ = ["AUTO_WORKERS", "MAX_WORKERS", "EnvWorkers", "InProcess", "Sessions", "sessions"]

MAX_WORKERS = 256  # more game processes than this on one machine is a typo, not a plan
AUTO_WORKERS = 16  # the most an unset --env-workers starts
START_LIMIT = 300.0  # seconds a worker may take to start and load the environment (engine imports)
_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)
# Workers start fresh (spawn), never as a fork of the trainer: its torch threads and the engines'
# state would be copied half-made. A spawned process would also re-run the trainer's main module
# (the `opd` script's `from opd.cli import main` imports torch: ~250 MB and seconds per worker,
# benchmarks/bench_env_workers.py);
# _WorkerContext leaves it behind when the workers cannot need it.
START_METHOD = "spawn"


_MAIN_SWAP = threading.Lock()


@contextmanager
def _main_left_behind() -> Iterator[None]:
    """While a worker process is being started: hide the main module's file from ``spawn``, so that
    the worker keeps a blank ``__main__`` instead of re-running the trainer's script (``opd``'s
    console script imports the CLI, and with it torch) -- unless the script defines functions or
    classes of its own, which the environment's pickle may name (an environment class written in
    the user's script): then it runs again in the worker, as ``spawn`` always does.

    ``python -m opd`` needs nothing of this (``spawn`` never re-runs a package's ``__main__``); for
    a script, ``sys.modules["__main__"]`` is a copy without ``__file__`` for the few lines that
    start the process (``multiprocessing`` has no option for it), then the script's module again."""
    with _MAIN_SWAP:  # two threads starting workers at once: each puts back the real module
        main = sys.modules.get("__main__")
        if main is None or _defines_own(main):
            yield
            return
        stand_in = types.ModuleType("__main__")
        stand_in.__dict__.update({k: v for k, v in vars(main).items() if k not in ("__file__", "__spec__")})
        stand_in.__spec__ = None  # nor a module name to import again (``python -m`` of a plain module)
        sys.modules["__main__"] = stand_in
        try:
            yield
        finally:
            if sys.modules.get("__main__") is stand_in:
                sys.modules["__main__"] = main


def _defines_own(main: types.ModuleType) -> bool:
    """Whether the main module holds a function or class defined in it (only those can be pickled by
    reference to ``__main__``); unsure counts as yes."""
    for value in list(vars(main).values()):
        try:
            if not isinstance(value, types.ModuleType) and getattr(value, "__module__", None) == "__main__":
                return True
        except Exception:
            return True
    return False


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned process that does not re-run the trainer's main module (see :func:`_main_left_behind`)."""

    @staticmethod
    def _Popen(process_obj):
        with _main_left_behind():
            return multiprocessing.context.SpawnProcess._Popen(process_obj)


class _WorkerContext(multiprocessing.context.SpawnContext):
    """``spawn``, with :class:`_WorkerProcess` for the executors' processes."""

    Process = _WorkerProcess


class Sessions(Protocol):
    """The game sessions of one batch of episodes, keyed by the episode's index in the batch.

    ``open`` and ``step`` ask for a call, :meth:`send` starts those asked for so far (one message
    per worker, not one per game), and :meth:`results` waits for every call since the last and
    returns each episode's answer: the first observation (open), the admissible commands and the
    :class:`~opd.envs.environment.StepResult` (step), or the ``EnvError`` that ended it."""

    def open(self, i: int, game: Game) -> None: ...

    def step(self, i: int, action: str) -> None: ...

    def send(self) -> None: ...

    def results(self) -> dict[int, Any]: ...

    def close(self) -> None: ...


def sessions(env: Environment) -> Sessions:
    """Where a batch's games run: the workers of an :class:`EnvWorkers`, else this process."""
    return env.batch() if isinstance(env, EnvWorkers) else InProcess(env)


class InProcess:
    """Each call runs at once, in this process (no limit on how long a game takes)."""

    def __init__(self, env: Environment):
        self.env = env
        self.open_sessions: dict[int, GameSession] = {}
        self.answers: dict[int, Any] = {}

    def open(self, i: int, game: Game) -> None:
        try:
            self.open_sessions[i] = session = self.env.open(game)
            self.answers[i] = session.reset()
        except EnvError as err:
            self.answers[i] = err

    def step(self, i: int, action: str) -> None:
        session = self.open_sessions[i]
        try:
            self.answers[i] = (session.admissible_commands(), session.step(action))
        except EnvError as err:
            self.answers[i] = err

    def send(self) -> None:
        return None  # every call ran when it was asked for

    def results(self) -> dict[int, Any]:
        out, self.answers = self.answers, {}
        return out

    def close(self) -> None:
        for session in self.open_sessions.values():
            try:
                session.close()
            except EnvError:
                pass  # a crashed engine may fail to close too; its episode is already over
        self.open_sessions = {}


# ----------------------------------------------------------------------------- in a worker process

_ENV: Environment | None = None
_SESSIONS: dict[int, GameSession] = {}
_IDS = count()


def _load(blob: bytes) -> int:
    global _ENV
    _ENV = pickle.loads(blob)
    return os.getpid()


def _opened(game: Game) -> tuple[int, str] | EnvError:
    try:
        session = cast(Environment, _ENV).open(game)  # _load set it when the worker started
    except EnvError as err:
        return err
    try:
        first = session.reset()
    except BaseException as err:
        try:
            session.close()
        except EnvError:
            pass
        if isinstance(err, EnvError):
            return err
        raise
    sid = next(_IDS)
    _SESSIONS[sid] = session
    return sid, first


def _stepped(sid: int, action: str) -> tuple[list[str] | None, Any] | EnvError:
    session = _SESSIONS[sid]
    try:
        return session.admissible_commands(), session.step(action)
    except EnvError as err:
        return err


def _open_all(games: list[Game]) -> list:
    """Each game's (session id, first observation), or the EnvError that stopped it: one game's
    failure is its own episode's, not the others' in the same message."""
    return [_opened(g) for g in games]


def _step_all(steps: list[tuple[int, str]]) -> list:
    return [_stepped(sid, action) for sid, action in steps]


def _close(sids: list[int]) -> None:
    for sid in sids:
        session = _SESSIONS.pop(sid, None)
        try:
            if session is not None:
                session.close()
        except EnvError:
            pass


# ----------------------------------------------------------------------------- in the trainer


class _Worker:
    """One process (a single-worker executor) and the sessions it holds. ``generation`` counts
    its processes: a session opened by an earlier one died with it."""

    def __init__(self, index: int, blob: bytes, context):
        self.index, self.blob, self.context = index, blob, context
        self.generation, self.dead, self.pid, self.hung = 0, True, None, False
        self.pool: ProcessPoolExecutor | None = None

    def start(self) -> Future:
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=self.context)
        self.generation += 1
        self.dead = self.hung = False
        return self.pool.submit(_load, self.blob)

    def started(self, loading: Future, limit: float) -> None:
        """Wait for the process to load the environment; a UserError if it cannot."""
        try:
            self.pid = loading.result(timeout=limit)
        except Exception as err:
            self.stop()
            why = "it exited while starting" if isinstance(err, BrokenProcessPool) else f"{type(err).__name__}: {err}"
            if isinstance(err, TimeoutError):
                why = f"it did not load the environment within {limit:.0f} s"
            raise UserError(
                f"env worker {self.index} could not start ({why}); the games' engines must import in a fresh "
                "process (pip install 'opd[agent]' for alfworld and textworld, an environment class importable "
                "from a module), or pass --env-workers 0 to play the games in this process"
            ) from None

    def submit(self, fn: Callable, *args: Any) -> Future:
        try:
            return cast(ProcessPoolExecutor, self.pool).submit(fn, *args)  # set by start()
        except (BrokenProcessPool, RuntimeError) as err:  # died (or shut down) since the batch began
            self.dead = True
            failed: Future = Future()
            failed.set_exception(BrokenProcessPool(str(err)))
            return failed

    def kill(self, hung: bool = False) -> None:
        self.hung = hung
        if self.pid is not None and not self.dead:
            try:
                os.kill(self.pid, _KILL)
            except ProcessLookupError:
                pass
        self.dead = True

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool, self.dead = None, True


@dataclass
class _Call:
    """One message to a worker: the calls of ``episodes`` (opens or steps), answered together."""

    worker: _Worker
    kind: str
    episodes: list[int]
    future: Future
    sent: float
    answered: float = 0.0

    def mark_answered(self, _future: Future) -> None:
        self.answered = time.monotonic()


class EnvWorkers:
    """``env`` with its episodes' sessions in ``workers`` processes: an Environment itself.

    Its games, system prompt and turn budget are ``env``'s; a session opened by hand
    (:meth:`open`, e.g. for expert episodes) runs in this process: only the episodes that
    :class:`~opd.rollout.episodes.EpisodeRollout` plays go to the workers. ``step_timeout``
    (seconds, 0 for none) bounds each call to a game. Call :meth:`close` when done (it is also
    closed when garbage-collected)."""

    def __init__(self, env: Environment, workers: int, step_timeout: float = 60.0):
        if not 1 <= workers <= MAX_WORKERS:
            raise UserError(f"env workers={workers}: use 1 to {MAX_WORKERS} (or play in this process: 0 workers)")
        if step_timeout < 0:
            raise UserError(f"env step timeout {step_timeout} must be >= 0 seconds (0: no limit)")
        try:
            blob = pickle.dumps(env)
        except Exception as err:
            raise UserError(
                f"environment {env.name!r} cannot be sent to worker processes ({type(err).__name__}: {err}); make it "
                "picklable (no lambdas, open files or locks in its attributes), or pass --env-workers 0"
            ) from None
        self.env, self.step_timeout = env, float(step_timeout)
        context = _WorkerContext()
        self.workers = [_Worker(k, blob, context) for k in range(workers)]
        self._closer = weakref.finalize(self, _stop_all, self.workers)
        self._start([w for w in self.workers])

    name = property(lambda self: self.env.name)
    system_prompt = property(lambda self: self.env.system_prompt)
    max_turns = property(lambda self: self.env.max_turns)

    def games(self, split: str) -> list[Game]:
        return self.env.games(split)

    def open(self, game: Game) -> GameSession:
        return self.env.open(game)

    def batch(self) -> _WorkerSessions:
        """The sessions of one batch of episodes; a worker that died since the last batch is replaced first."""
        self._start([w for w in self.workers if w.dead])
        return _WorkerSessions(self)

    def _start(self, workers: list[_Worker]) -> None:
        for w in workers:
            w.stop()
        loading = [w.start() for w in workers]  # all at once: the engines import in parallel
        for w, f in zip(workers, loading, strict=True):
            w.started(f, max(START_LIMIT, self.step_timeout))

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> EnvWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()


class _WorkerSessions:
    """One batch's sessions in the workers: episode i on worker ``i mod N``."""

    def __init__(self, pool: EnvWorkers):
        self.pool = pool
        self.held: dict[int, tuple[_Worker, int, int]] = {}  # episode -> (worker, its generation, session id)
        self.asked: dict[tuple[_Worker, str], list[tuple[int, Any]]] = {}  # not sent yet: (episode, argument)
        self.calls: list[_Call] = []
        self.answers: dict[int, Any] = {}

    def open(self, i: int, game: Game) -> None:
        worker = self.pool.workers[i % len(self.pool.workers)]
        self.asked.setdefault((worker, "open"), []).append((i, game))

    def step(self, i: int, action: str) -> None:
        worker, generation, sid = self.held[i]
        if worker.generation != generation or worker.dead:
            self.answers[i] = EnvError(f"env worker {worker.index} died; this episode's game was in it")
            return
        self.asked.setdefault((worker, "step"), []).append((i, (sid, action)))

    def send(self) -> None:
        for (worker, kind), asked in self.asked.items():
            fn = _open_all if kind == "open" else _step_all
            call = _Call(
                worker, kind, [i for i, _ in asked], worker.submit(fn, [x for _, x in asked]), time.monotonic()
            )
            call.future.add_done_callback(call.mark_answered)
            self.calls.append(call)
        self.asked = {}

    def results(self) -> dict[int, Any]:
        self.send()
        hung = self._wait()
        for call in self.calls:
            self._answer(call, call in hung)
        self.calls = []
        out, self.answers = self.answers, {}
        return out

    def _wait(self) -> list[_Call]:
        """Wait for every call; kill the worker of a call that runs past the limit (per game in
        it). Returns the calls that hung. A worker answers its calls in order: a call's time starts
        when it was sent or when the worker answered the call before it, whichever is later."""
        limit = self.pool.step_timeout
        hung: list[_Call] = []
        while True:
            pending = [c.future for c in self.calls if not c.future.done()]
            if not pending:
                return hung
            if not limit:
                wait(pending)
                continue
            now, next_deadline = time.monotonic(), float("inf")
            before: dict[_Worker, float] = {}
            for call in self.calls:  # in the order they were sent
                if call.worker.dead or call.worker in before and before[call.worker] < 0:
                    continue  # killed (its calls fail as the executor notices), or behind an unanswered call
                if call.future.done():
                    before[call.worker] = call.answered
                    continue
                deadline = max(call.sent, before.get(call.worker, 0.0)) + limit * len(call.episodes)
                before[call.worker] = -1.0
                if deadline <= now:
                    hung.append(call)
                    call.worker.kill(hung=True)
                else:
                    next_deadline = min(next_deadline, deadline)
            timeout = None if next_deadline == float("inf") else max(0.0, next_deadline - time.monotonic())
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _answer(self, call: _Call, hung: bool) -> None:
        err = call.future.exception()
        if err is not None and not isinstance(err, BrokenProcessPool):
            raise err  # a bug in the game's code stops the run, as it does in-process
        worker = call.worker
        if err is not None:
            worker.dead = True
            if hung:
                why = (
                    f"no answer within env_step_timeout={self.pool.step_timeout:g} s (from this game or another sent "
                    f"to env worker {worker.index} with it); the worker was stopped and is replaced"
                )
            elif worker.hung:
                why = f"env worker {worker.index} was stopped: another game on it did not answer in time"
            else:
                why = f"env worker {worker.index} died (killed, or crashed in the game's engine)"
            self.answers.update({i: EnvError(why) for i in call.episodes})
            return
        for i, answer in zip(call.episodes, call.future.result(), strict=True):
            if call.kind == "open" and not isinstance(answer, EnvError):
                sid, answer = answer
                self.held[i] = (worker, worker.generation, sid)
            self.answers[i] = answer

    def close(self) -> None:
        by_worker: dict[_Worker, list[int]] = {}
        for worker, generation, sid in self.held.values():
            if worker.generation == generation and not worker.dead:
                by_worker.setdefault(worker, []).append(sid)
        closing = [w.submit(_close, sids) for w, sids in by_worker.items()]
        wait(closing, timeout=self.pool.step_timeout or None)
        self.held = {}
