"""A served teacher (``opd serve-teacher``): scores token sequences over HTTP in vLLM's format.

The answers are vLLM's ``prompt_logprobs`` (:mod:`opd.teachers.completions`: a real vLLM server is a
drop-in replacement for this one), or opd's binary format for opd's own trainer
(:mod:`opd.teachers.wire`); the routes and API keys are :mod:`opd.teachers.app`, the batched forward
passes :mod:`opd.teachers.batching`. This module serves them: the socket, uvicorn, start and stop.

HTTP is a Starlette app on uvicorn (vLLM's stack): one event loop holds every connection (backlog
2048; the standard library's server had 5 and reset 1.3% of 64 clients' connections), and a request
waiting for its forward pass holds no thread. A request uvicorn cannot parse is answered in JSON too.

Run: ``opd serve-teacher runs/teacher --port 8000`` (``--port 0`` picks a free port and prints it);
Ctrl-C or SIGTERM stops it after answering the requests in flight. In Python: :func:`start_server`.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
import time

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from opd.errors import UserError
from opd.hub import resolve_model
from opd.models.loading import load_model, load_tokenizer, resolve_device
from opd.models.precision import auto_dtype
from opd.teachers.app import JSON, KeyCheck, TeacherApp, build_asgi_app
from opd.teachers.completions import Limits, RequestError, dumps

BACKLOG = 2048  # uvicorn's default: connections queue while the loop is busy, instead of being reset
GRACE_S = 10  # on shutdown, how long the requests in flight have to be answered before they are cancelled


# uvicorn picks AutoHTTPProtocol's class at import (httptools or h11), so its stubs call it a variable
class _JSONErrorsProtocol(AutoHTTPProtocol):  # type: ignore[valid-type,misc]
    """uvicorn's HTTP/1.1 protocol (httptools, else h11) answering a request it cannot parse in JSON."""

    def send_400_response(self, msg: str) -> None:
        message = f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}); Content-Length must be a byte count"
        body = dumps(RequestError(400, message).payload())
        head = f"HTTP/1.1 400 Bad Request\r\ncontent-type: {JSON}\r\ncontent-length: {len(body)}\r\nconnection: close"
        self.transport.write(head.encode() + b"\r\n\r\n" + body)
        self.transport.close()


class TeacherServer(uvicorn.Server):
    """uvicorn's server, with its ``app``, ``thread`` and ``server_address`` (the real port for port 0)."""

    app: TeacherApp
    server_address: tuple[str, int]
    thread: threading.Thread


def _listen(host: str, port: int) -> socket.socket:
    # Bound here, not by uvicorn: port 0's real port is known before serving, and a port that
    # cannot be bound is the user's error to fix, not a log line and an exit in uvicorn's thread.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server need not wait out TIME_WAIT
        sock.bind((host, port))
        sock.listen(BACKLOG)  # clients queue from now on, even before the loop serves
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc}); pick another --port (0 picks a free one)") from exc
    return sock


def _server(app: TeacherApp, sock: socket.socket, verbose: bool) -> TeacherServer:
    config = uvicorn.Config(
        build_asgi_app(app),
        http=_JSONErrorsProtocol,
        backlog=BACKLOG,
        timeout_graceful_shutdown=GRACE_S,
        log_level="info" if verbose else "warning",  # uvicorn's start-up lines only with --verbose
        access_log=verbose,
    )
    server = TeacherServer(config)
    server.app, server.server_address = app, sock.getsockname()[:2]
    return server


def start_server(app: TeacherApp, host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> TeacherServer:
    """Bind and serve in a background thread; returns once the server accepts requests."""
    sock = _listen(host, port)
    server = _server(app, sock, verbose)
    # Off the main thread uvicorn installs no signal handlers: the caller (a test, a benchmark) owns them.
    server.thread = threading.Thread(target=server.run, args=([sock],), name="opd-teacher-http", daemon=True)
    server.thread.start()
    while not server.started and server.thread.is_alive():
        time.sleep(0.005)
    if not server.started:
        sock.close()
        raise RuntimeError("the teacher server's HTTP thread did not start; see uvicorn's log above")
    return server


def stop_server(server: TeacherServer) -> None:
    """Stop accepting connections, answer the requests in flight (up to ``GRACE_S``), stop the scorer."""
    server.should_exit = True
    server.thread.join(timeout=GRACE_S + 5)
    server.app.scorer.close()


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    served_model_name: str = "",
    limits: Limits | None = None,
    verbose: bool = False,
    device: str = "auto",
    api_keys: list[str] | tuple = (),
    revision: str = "",
) -> None:
    """``opd serve-teacher``: load the model, serve until interrupted (Ctrl-C or SIGTERM). A Hub name is
    served under that name (as vLLM does), its files read from the Hugging Face cache."""
    keys = KeyCheck(api_keys)  # a bad key is refused before the model loads
    if not keys and not is_loopback(host):
        print(
            f"opd serve-teacher: warning: listening on {host} without an API key: anyone who can reach the port "
            "can use this teacher; set OPD_API_KEY (or --api-key) and give trainers OPD_TEACHER_API_KEY",
            file=sys.stderr,
            flush=True,
        )
    if port:  # a taken port fails now, not after the model's load (minutes for a large model)
        _listen(host, port).close()
    where = "the model argument (opd serve-teacher MODEL_DIR)"
    on = resolve_device(device)
    if dtype == "auto":  # on a GPU the checkpoint's own, read from its config (a Hub name's: its snapshot's)
        folder = model_dir if on.type == "cpu" else resolve_model(model_dir, revision, f"teacher model ({where})")
        dtype = auto_dtype(folder, dtype, on)
    model = load_model(model_dir, "teacher", dtype, on, option=where, revision=revision)
    tok = load_tokenizer(model_dir, "teacher", option=where, revision=revision)
    app = TeacherApp(model, tok, served_model_name or str(model_dir), limits, api_keys)
    sock = _listen(host, port)
    server = _server(app, sock, verbose)
    url = "http://{}:{}".format(*server.server_address)
    # On the main thread uvicorn handles SIGINT and SIGTERM: it answers the requests in flight (a second
    # Ctrl-C cuts that short), then raises the signal again, which this handler makes a KeyboardInterrupt.
    # Not a thread and join(): before Python 3.13 a signal interrupting join() marks the thread stopped.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        keyed = f", {len(keys.digests)} API key(s)" if keys else ""
        about = f"model {app.model_name}, vocabulary {app.vocab_rows}, {dtype}, requests up to {app.limits.max_prompt_tokens} tokens{keyed}"
        print(f"opd teacher server: {url} ({about}); train with --teacher-url {url}", flush=True)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.scorer.close()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, localhost), reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
