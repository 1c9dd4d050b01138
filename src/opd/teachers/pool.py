"""The servers behind a served teacher (``--teacher-url URL[,URL...]``): which one gets each request, and
what happens when one stops answering.

:class:`TeacherPool` holds one :class:`Server` per URL. Each request goes to the server with the least
outstanding work (the tokens of the requests it holds and has not answered; ties go to the one picked
least recently; each rank of a multi-process run starts its turns at another server, as each balances
only its own requests), so a slow or busy server gets fewer. A request that gets no answer (refused or reset
connection, timeout, an answer cut short, 5xx, 408, 429) marks its server down and is sent again at
once to another one: a server lost mid-step costs that step nothing but the resend. A down server is
asked again (the checks a new server gets, through :meth:`TeacherPool.start`'s ``admit``) after a
backoff that doubles up to ``--teacher-wait``'s cap, in a thread of its own while others serve, and
takes requests again once it answers. When every server is down a request waits as a single server's
always did (:class:`~opd.service.Patience`: ``--teacher-wait``, ``--teacher-retries``, one line when the
teacher goes, one when it is back), then the trainer checkpoints and stops
(:class:`~opd.teachers.scoring.TeacherUnavailable`). A 4xx answer is the request's fault: an error at
once, wherever it was sent.

Every server is checked when it joins: at start, those that answer (the trainer waits for the first),
and later ones when they come up. A pool serves one teacher: servers naming different models or
reporting different vocabularies are refused, naming both (:meth:`TeacherPool.settle`); one that comes
back serving another teacher is left out for the rest of the run, with one line.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from opd.errors import UserError
from opd.service import TEACHER_KEY_ENV, Client, Patience
from opd.teachers.scoring import TeacherUnavailable

T = TypeVar("T")
KEY_HINT = f"set the server's key in the environment variable {TEACHER_KEY_ENV} (or --teacher-api-key)"


class NoAnswer(Exception):
    """A server did not answer ``path`` (``reason`` in words): the request may go to another one."""

    def __init__(self, path: str, reason: str):
        super().__init__(reason)
        self.path, self.reason = path, reason


class TeacherClient(Client):
    """One teacher server's requests, tried once each (the pool retries, on any server), with errors
    that say how to fix what is known to cause them."""

    def __init__(self, url: str, *, key: str, timeout: float):
        # wait=0: the first failure is final here (no sleep, no line); TeacherPool decides what follows
        super().__init__(
            url,
            "--teacher-url",
            key=key,
            timeout=timeout,
            timeout_option="--teacher-timeout",
            patience=Patience(url, 0),
        )

    def refused(self, path: str, code: int, message: str) -> UserError:
        said = f"teacher server {self.url}{path} answered HTTP {code}: {message}"
        if code == 401:
            sent = "the API key sent was refused" if self.auth else "no API key was sent"
            return UserError(f"{said}; {sent}: {KEY_HINT}")
        lowered = message.lower()
        if "logprobs" in lowered and "max" in lowered:  # vLLM: "... greater than max allowed: 20"
            return UserError(
                f"{said}; start the server with a larger --max-logprobs (at least --k; vLLM's default is 20) or lower --k"
            )
        if "max_model_len" in lowered or "context length" in lowered:
            return UserError(
                f"{said}; a prompt and its response must fit the server's context: start it with a larger "
                "--max-model-len, or lower --max-new-tokens"
            )
        return UserError(said)

    def gave_up(self, path: str, attempts: int, seconds: float, reason: str) -> NoAnswer:
        return NoAnswer(path, reason)


@dataclass(frozen=True)
class Identity:
    """What a server says it serves: the model's name (``GET /v1/models``) and, from opd's servers, the
    vocabulary (``GET /opd/vocab``: size, output rows, hash); None from a vLLM-format server."""

    model: str
    vocab: dict | None

    def same(self, other: Identity) -> bool:
        if self.model != other.model:
            return False
        if self.vocab is None or other.vocab is None:  # a vLLM server's tokenizer is probed against opd's instead
            return True
        return all(self.vocab.get(k) == other.vocab.get(k) for k in ("sha256", "head_rows"))

    def __str__(self) -> str:
        if self.vocab is None:
            return f"model {self.model!r}, vocabulary not reported"
        sha = str(self.vocab.get("sha256"))[:12]
        return (
            f"model {self.model!r}, vocabulary of {self.vocab.get('tokens')} tokens, {self.vocab.get('head_rows')} "
            f"output rows, sha256 {sha}"
        )


@dataclass(eq=False)
class Server:
    """One server of the pool and what the pool knows of it (read and written under the pool's lock)."""

    client: TeacherClient
    up: bool = False
    identity: Identity | None = None
    info: dict = field(default_factory=dict)  # what the pool's owner learnt when it was admitted
    outstanding: int = 0  # tokens of the requests it holds
    picked: int = 0  # the pool's pick counter when it was last picked: ties go to the oldest
    answered: int = 0  # requests it answered
    failures: int = 0  # failed checks in a row since it went down: its backoff
    retry_at: float = 0.0  # when it is asked again
    probing: bool = False  # a thread is checking it
    excluded: bool = False  # it came back serving another teacher: never asked again
    reason: str = "not asked yet"  # why it is down, and the request that found it
    path: str = ""

    @property
    def url(self) -> str:
        return self.client.url


class TeacherPool:
    """The servers of ``urls`` (one or more) behind one :meth:`send`; ``patience`` waits when none answers.

    A server that answers for the first time, or again, is admitted by ``identify(server)`` (what it
    serves), :meth:`settle` (the pool's teacher?) and ``verify(server)`` (the caller's own checks:
    vocabulary, K). Those raise :class:`NoAnswer` when the server stops answering meanwhile, and
    :class:`UserError` for the wrong server. Call :meth:`start` once, before :meth:`send`. ``rank``: this
    process's (torchrun's ``RANK`` by default); each rank breaks its first ties at another server, so
    the ranks' first requests of a step do not all go to the first one."""

    def __init__(
        self,
        urls: Sequence[str],
        patience: Patience,
        identify: Callable[[Server], Identity],
        verify: Callable[[Server], None],
        *,
        key: str = "",
        timeout: float = 120.0,
        rank: int | None = None,
    ):
        self.servers = [Server(TeacherClient(u, key=key, timeout=timeout)) for u in urls]
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        for i, server in enumerate(self.servers):  # "picked" before any pick, this rank's server the longest ago
            server.picked = (i - rank) % len(self.servers) - len(self.servers)
        self.patience, self.identify, self.verify = patience, identify, verify
        self.identity: Identity | None = None
        self.vocab: Identity | None = None  # the first identity with a vocabulary (an opd server's), if any
        self._first: Server | None = None
        self._first_vocab: Server | None = None
        self.started = False
        self._lock = threading.Lock()
        self._picks = 0

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    # ------------------------------------------------------------------ joining

    def start(self) -> None:
        """Check every server (in parallel); wait under the pool's patience until one of them is up. A
        wrong server (another model or vocabulary, a refused key, too small a K) is an error at once."""
        found = self._each(self._identify, self.servers)
        for server, identity in zip(self.servers, found):  # in --teacher-url's order: the first names the teacher
            if identity is not None:
                self.settle(server, identity)
        self._each(self._verify, [s for s, identity in zip(self.servers, found) if identity is not None])
        failures, first = 0, self.patience.clock()
        while not any(s.up for s in self.servers):
            failures += 1
            if not self.patience.retry(failures - 1, first, self._reason()):
                raise self.gave_up(self._path(), failures, self.patience.clock() - first, self._reason())
            self.revive()
        self.started = True
        self.patience.answered()

    def _each(self, fn: Callable[[Server], T], servers: list[Server]) -> list[T]:
        """``fn`` of each server, in parallel (a server that does not answer holds up none of the others);
        the first error in ``servers``' order is raised."""
        if len(servers) <= 1:
            return [fn(s) for s in servers]
        with ThreadPoolExecutor(max_workers=len(servers)) as ex:
            return list(ex.map(fn, servers))

    def _identify(self, server: Server) -> Identity | None:
        try:
            server.identity = self.identify(server)
        except NoAnswer as exc:
            self._down(server, exc)
        return server.identity

    def _verify(self, server: Server) -> None:
        try:
            self.verify(server)
        except NoAnswer as exc:
            self._down(server, exc)
            return
        with self._lock:
            server.up, server.failures = True, 0

    def settle(self, server: Server, identity: Identity) -> None:
        """``identity`` is the pool's: the model the first server names, the vocabulary the first one that
        reports one reports (:attr:`vocab`; at start both in --teacher-url's order, before any other check);
        or the error naming both servers."""
        with self._lock:
            if self.identity is None or self._first is None:
                self.identity, self._first = identity, server
            first, ours = self._first, self.identity
            if identity.model == ours.model and identity.vocab is not None:  # the vocabulary's first, then
                if self.vocab is None or self._first_vocab is None:
                    self.vocab, self._first_vocab = identity, server
                first, ours = self._first_vocab, self.vocab
        if identity is not ours and not identity.same(ours):
            raise UserError(
                f"teacher servers {first.url} and {server.url} serve different teachers ({first.url}: {ours}; "
                f"{server.url}: {identity}); every server of --teacher-url must serve the same model with the "
                "same tokenizer: start each from the same model, with the same --served-model-name"
            )

    def revive(self) -> bool:
        """Check every down server now (none is up: there is nothing else to do); whether one came back."""
        self._each(self._probe, [s for s in self.servers if not s.up])
        return any(s.up for s in self.servers)

    def _probe(self, server: Server) -> None:
        with self._lock:
            if server.probing or server.up or server.excluded:
                return
            server.probing = True
        self._admit_again(server)

    def _admit_again(self, server: Server) -> None:
        """Admit a down server again (its ``probing`` claimed): up if it passes, down for longer if not."""
        try:
            server.identity = None
            server.identity = self.identify(server)
            self.settle(server, server.identity)
            self.verify(server)
        except NoAnswer as exc:
            self._down(server, exc)
        except UserError as exc:
            if not self.started:  # a wrong server at start is the user's to fix now
                raise
            # restarted with another model, say: it must not score for this run, which goes on without it
            self._down(server, NoAnswer("", "it is not this run's teacher"))
            server.excluded = True  # asked no more: one line, not one per backoff
            self.patience.log(f"teacher server {server.url} answers but is left out of the pool: {exc}")
        else:
            with self._lock:
                server.up, server.failures = True, 0
            self._say(f"teacher server {server.url} is back; it takes requests again")
        finally:
            server.probing = False

    # ------------------------------------------------------------------ requests

    def send(self, cost: int, request: Callable[[Server], T]) -> T:
        """``request(server)`` on the least busy server; on another one while servers fail; waiting under
        the patience while none answers. ``cost``: the request's tokens (its share of a server's work)."""
        failures, waits, first, reason, path = 0, 0, 0.0, "", ""
        while True:
            server = self._pick(cost)
            if server is not None:
                try:
                    out = request(server)
                except NoAnswer as exc:
                    self._done(server, cost, exc)
                    first = first if failures else self.patience.clock()
                    failures, reason, path = failures + 1, exc.reason, exc.path
                    # straight to another server: each once, whatever --teacher-wait/--teacher-retries (not a wait)
                    if any(s.up for s in self.servers) and (
                        failures < len(self.servers) or self._within(failures, first)
                    ):
                        continue
                except BaseException:
                    self._done(server, cost)
                    raise
                else:
                    self._done(server, cost)
                    self.patience.answered()
                    return out
            elif not failures:  # every server went down under earlier requests: ask them again before this one counts
                if self.revive():
                    continue
                failures, first, reason, path = 1, self.patience.clock(), self._reason(), self._path()
            # nobody is up: wait as for a single server (the backoff counts the waits), then ask them all again
            if not (self._within(failures, first) and self.patience.retry(waits, first, reason)):
                raise self.gave_up(path, failures, self.patience.clock() - first, reason)
            waits += 1
            if not self.revive():
                failures, reason, path = failures + 1, self._reason(), self._path()

    def _pick(self, cost: int) -> Server | None:
        now = self.patience.clock()
        with self._lock:
            up = [s for s in self.servers if s.up]
            if not up:
                return None
            due = [s for s in self.servers if not (s.up or s.probing or s.excluded) and s.retry_at <= now]
            for s in due:
                s.probing = True
            server = min(up, key=lambda s: (s.outstanding, s.picked))
            self._picks += 1
            server.picked, server.outstanding = self._picks, server.outstanding + cost
        for s in due:  # asked again beside the requests: none of them waits for it
            threading.Thread(target=self._admit_again, args=(s,), daemon=True).start()
        return server

    def _done(self, server: Server, cost: int, failed: NoAnswer | None = None) -> None:
        with self._lock:
            server.outstanding -= cost
            if failed is None:
                server.answered += 1
                return
            if not server.up:  # another request found it down first
                return
        self._down(server, failed)

    def _down(self, server: Server, exc: NoAnswer) -> None:
        with self._lock:
            was_up, server.up, server.reason, server.path = server.up, False, exc.reason, exc.path
            server.failures = 1 if was_up else server.failures + 1
            wait = min(self.patience.backoff * 2 ** (server.failures - 1), self.patience.max_backoff)
            server.retry_at = self.patience.clock() + wait
            others = sum(s.up for s in self.servers)
        if was_up and others:
            self._say(
                f"teacher server {server.url} failed ({exc.reason}); its requests go to the other {others} "
                f"server(s) while it is asked again, every {self.patience.max_backoff:g} s at most"
            )

    def _within(self, failures: int, first: float) -> bool:
        p = self.patience
        return p.clock() - first < p.wait and (p.retries is None or failures <= p.retries)

    def _say(self, line: str) -> None:
        if len(self.servers) > 1:  # a single server's story is the patience's
            self.patience.log(line)

    def _reason(self) -> str:
        return "; ".join(dict.fromkeys(s.reason for s in self.servers if not s.up)) or "no server up"

    def _path(self) -> str:
        return next((s.path for s in self.servers if not s.up), "")

    def gave_up(self, path: str, attempts: int, seconds: float, reason: str) -> TeacherUnavailable:
        spent = self.patience.spent(attempts)
        many = len(self.servers) > 1
        what = f"teacher servers {', '.join(s.url for s in self.servers)}" if many else f"teacher server {self.url}"
        if reason.startswith("HTTP ") and not many:  # the server runs but fails: its own log says why
            return TeacherUnavailable(
                f"{what}{path} answered {reason}; still failing after {attempts} attempts "
                f"over {seconds:.0f} s ({spent}); check the server's log, or raise {spent.split()[0]}"
            )
        them = "them" if many else "it"
        return TeacherUnavailable(
            f"{what} {'are' if many else 'is'} unreachable after {attempts} attempts over {seconds:.0f} s ({reason}, "
            f"{spent}); start {them} (opd serve-teacher TEACHER_DIR --port PORT) or fix --teacher-url {self.url}"
        )
