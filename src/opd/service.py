"""Talking to a server over HTTP: the one client under the served teacher (:mod:`opd.teachers.client`) and
the vLLM rollout engine (:mod:`opd.rollout.vllm_engine`).

* :func:`check_url` -- every URL option checked the same way, by the config and by the clients.
* :func:`api_key` -- the one place that reads an API key from the environment.
* :class:`Patience` -- how a server that stops answering is waited for: capped exponential backoff up to
  a configurable wait (``--teacher-wait``, ``--vllm-wait``), one line when it goes down, one now and
  then while it stays down, one when it is back, whichever thread asked.
* :class:`Client` -- JSON over HTTP with a bearer key. A request that gets no answer (refused, reset,
  timed out, cut short), a 5xx, a 408 or a 429 may get one later: it is tried again under the client's
  :class:`Patience`, then :meth:`Client.gave_up` says what to raise. Any other 4xx is the request's
  fault: :meth:`Client.refused` at once, never retried. Keys go in the ``Authorization`` header and
  never into a message.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from opd.errors import ServiceUnavailable, UserError

TEACHER_KEY_ENV = "OPD_TEACHER_API_KEY"  # --teacher-url's key (or --teacher-api-key)
VLLM_KEY_ENV = "OPD_VLLM_API_KEY"  # --vllm-url's key


def url_problem(url: str, option: str) -> str:
    """What is wrong with ``url`` as the value of ``option`` ("" when nothing): anything but an http(s) URL
    with a host and, if given, a numeric port. The config checks every URL option with it, the clients too."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{option} {url!r} must start with http:// or https:// and name a host (e.g. http://127.0.0.1:8000)"
    try:
        parts.port  # noqa: B018 -- parsing the port is the check ("host:abc" and "host:99999" raise here)
    except ValueError:
        port = parts.netloc.rpartition(":")[2]
        return (
            f"{option} {url!r} has the port {port!r}; a port is a number from 0 to 65535 (e.g. http://127.0.0.1:8000)"
        )
    return ""


def check_url(url: str, option: str) -> str:
    """``url`` without its trailing ``/`` and ``/v1`` (the clients add the paths); a UserError naming
    ``option`` when :func:`url_problem` finds one."""
    problem = url_problem(url, option)
    if problem:
        raise UserError(problem)
    return url.rstrip("/").removesuffix("/v1")


def api_key(env_var: str, given: str = "") -> str:
    """The key to send: ``given`` (an option's value), else the environment variable ``env_var``, else none."""
    return given or os.environ.get(env_var, "")


def stderr_line(line: str) -> None:
    # every rank of a torchrun/accelerate launch waits on its own: say which one speaks
    rank = f"rank {os.environ.get('RANK')}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(rank + line, file=sys.stderr, flush=True)


class Patience:
    """How a client waits for a server that stopped answering.

    A failed request is tried again after ``backoff`` seconds, doubling up to ``max_backoff``, until
    ``wait`` seconds have passed since its first failure (or after ``retries`` retries, when given);
    the last try lands on the deadline. ``abandon()`` returning True ends the wait at once (the server's
    process has exited: waiting cannot bring it back). One line goes to ``log`` when the server goes
    down, one every ``log_every`` seconds while it stays down, one when it is back: the client's request
    threads share them, so an outage reads as one story, not one per thread. ``what`` names the server
    in them and ``wait_option``/``retries_option`` the options that set the limits. ``clock`` and
    ``sleep`` are injectable so that tests need not wait.
    """

    def __init__(
        self,
        url: str,
        wait: float = 600.0,
        retries: int | None = None,
        *,
        backoff: float = 0.5,
        max_backoff: float = 15.0,
        log_every: float = 30.0,
        what: str = "teacher server",
        wait_option: str = "--teacher-wait",
        retries_option: str = "--teacher-retries",
        abandon: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        log: Callable[[str], None] = stderr_line,
    ):
        self.url, self.wait, self.retries = url, wait, retries
        self.backoff, self.max_backoff, self.log_every = backoff, max_backoff, log_every
        self.what, self.wait_option, self.retries_option, self.abandon = what, wait_option, retries_option, abandon
        self.clock, self.sleep, self.log = clock, sleep, log
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_log = 0.0

    def retry(self, attempt: int, first_failure: float, reason: str) -> bool:
        """After failed try ``attempt`` (0: the first) of a request that first failed at ``first_failure``
        (a ``clock()`` time): sleep and say True to try again, or say False once patience is spent."""
        now = self.clock()
        left = self.wait - (now - first_failure)
        if left <= 0 or (self.retries is not None and attempt >= self.retries):
            return False
        if self.abandon is not None and self.abandon():
            return False
        with self._lock:
            if self._down_since is None:
                self._down_since, self._next_log = now, now + self.log_every
                self.log(
                    f"{self.what} {self.url} unreachable ({reason}); waiting up to {self.wait:g} s ({self.wait_option})"
                )
            elif now >= self._next_log:
                self._next_log = now + self.log_every
                self.log(
                    f"{self.what} {self.url} unreachable ({reason}); waiting, "
                    f"{now - self._down_since:.0f} s of {self.wait:g} s"
                )
        self.sleep(min(self.backoff * 2**attempt, self.max_backoff, left))
        return True

    def answered(self) -> None:
        """The server answered a request: back, if it was down."""
        with self._lock:
            if self._down_since is not None:
                self.log(f"{self.what} {self.url} is back after {self.clock() - self._down_since:.0f} s")
                self._down_since = None

    def spent(self, attempts: int) -> str:
        """The option that ran out after ``attempts`` tries, to name in the error."""
        capped = self.retries is not None and attempts > self.retries
        return f"{self.retries_option} {self.retries}" if capped else f"{self.wait_option} {self.wait:g}"


class Client:
    """One server's requests: ``url`` (checked with :func:`check_url` as ``option``), the bearer
    ``key``, a per-request ``timeout`` (set by ``timeout_option``, named when it runs out) and the :class:`Patience` that retries what may succeed later.
    Subclasses or callers set :meth:`refused` and :meth:`gave_up` to word the errors for their server."""

    def __init__(
        self,
        url: str,
        option: str,
        *,
        key: str = "",
        timeout: float = 120.0,
        timeout_option: str = "",
        patience: Patience | None = None,
    ):
        self.url, self.option = check_url(url, option), option
        self.timeout, self.timeout_option = timeout, timeout_option
        self.patience = patience or Patience(self.url)
        self.patience.url = self.url
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}

    def fetch(
        self,
        method: str,
        path: str,
        data: bytes | None = None,
        accept: str | None = None,
        missing_ok: bool = False,
        retry_5xx: bool = True,
    ) -> tuple[str, bytes] | None:
        """One request, tried again while the server does not answer: the answer's media type and body;
        None for a 404 when ``missing_ok``. ``retry_5xx=False``: a 5xx is the request's fault too (a
        request the server fails the same way each time)."""
        headers = {"Content-Type": "application/json", **self.auth, **({"Accept": accept} if accept else {})}
        first_failure = None
        for attempt in itertools.count():
            req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    got = resp.headers.get_content_type(), resp.read()
                self.patience.answered()
                return got
            except urllib.error.HTTPError as err:
                # the request's fault, so asking again gets the same answer; 408 and 429 ask for later
                message = error_message(err)
                if (err.code < 500 or not retry_5xx) and err.code not in (408, 429):
                    self.patience.answered()
                    if err.code == 404 and missing_ok:
                        return None
                    raise self.refused(path, err.code, message) from None
                reason = f"HTTP {err.code}: {message}"
            # refused, reset, timed out, or a body cut short: the server may be restarting
            except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
                reason = self.reason(err)
            first_failure = self.patience.clock() if first_failure is None else first_failure
            if not self.patience.retry(attempt, first_failure, reason):
                raise self.gave_up(path, attempt + 1, self.patience.clock() - first_failure, reason)
        raise AssertionError("unreachable: the loop returns or raises")

    def request(
        self, method: str, path: str, payload: dict | None = None, missing_ok: bool = False, retry_5xx: bool = True
    ) -> Any:
        """One JSON request with retries: the decoded answer (None for an empty body, or a 404 when ``missing_ok``)."""
        data = None if payload is None else json.dumps(payload).encode()
        got = self.fetch(method, path, data, missing_ok=missing_ok, retry_5xx=retry_5xx)
        if got is None or not got[1].strip():
            return None
        return self.decode(got[1], path)

    def decode(self, body: bytes, path: str) -> Any:
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(
                f"{self.patience.what} {self.url}{path} answered something that is not JSON; is {self.option} an "
                "OpenAI-compatible (vLLM-format) server?"
            ) from None

    def model_name(self) -> str:
        """The served model's name, the first of ``GET /v1/models`` (vLLM answers 404 to any other)."""
        models = self.request("GET", "/v1/models")
        try:
            return str(models["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise UserError(
                f"{self.url}/v1/models did not list a model; is {self.option} an OpenAI-compatible server?"
            ) from None

    def reason(self, err: BaseException) -> str:
        """Why a request got no answer, in words (urllib wraps the socket's error in a URLError)."""
        cause = getattr(err, "reason", err)
        for kind, words in (
            (ConnectionRefusedError, "connection refused"),
            (http.client.RemoteDisconnected, "connection closed without an answer"),
            (ConnectionResetError, "connection reset"),
            (TimeoutError, f"no answer within {self.timeout_option or f'{self.timeout:g} s'}"),
            (http.client.IncompleteRead, "answer cut short"),
        ):
            if isinstance(cause, kind):
                return words
        return str(cause) or type(cause).__name__

    def refused(self, path: str, code: int, message: str) -> UserError:
        """The error for a 4xx answer (a 5xx with ``retry_5xx=False``)."""
        return UserError(f"{self.patience.what} {self.url}{path} answered HTTP {code}: {message}")

    def gave_up(self, path: str, attempts: int, seconds: float, reason: str) -> Exception:
        """The error once patience is spent."""
        return ServiceUnavailable(
            f"{self.patience.what} {self.url}{path} got no answer after {attempts} attempts over {seconds:.0f} s "
            f"({reason}, {self.patience.spent(attempts)})"
        )


def error_message(err: urllib.error.HTTPError) -> str:
    """The server's own message: OpenAI's {"error": {"message"}} or older vLLM's {"message"}."""
    try:
        body = json.loads(err.read())
        return body["error"]["message"] if isinstance(body.get("error"), dict) else body["message"]
    except Exception:  # a foreign server's error page: report its status line only
        return str(err.reason)
