#!/usr/bin/env python
"""Load on ``opd serve-teacher``: many clients posting vLLM prompt_logprobs requests at once.

Starts ``python -m opd serve-teacher TEACHER --port 0 --device cpu`` (the packaged demo teacher by
default) and runs C client threads (default 64) for D seconds (default 60). Each client posts, one
after another, vLLM completions requests (``prompt``: a list of ``--prompts`` lists of 40-70 token
ids drawn from the teacher's vocabulary, ``prompt_logprobs: K``, ``max_tokens: 1``), each on a new
connection as opd's client does, and checks every answer (one choice per prompt, one position per
token). It counts answers, errors by kind (connection reset or refused, timeout, HTTP status, a
malformed answer) and latencies, then stops the server with SIGTERM and records whether it exited
cleanly. What this catches: a server whose listen queue overflows resets connections (opd's
earlier server on the standard library, listen backlog 5, reset 1-3% of these requests).

Clients and server share the machine, so answers/s measures both; errors and the clean stop are the
point. The server gets ``--threads`` torch threads (default 1): two OpenMP threads collapse when
the cores are oversubscribed (64 client threads, and whatever else runs); on a busy 2-core
machine that measured 6 answers/s instead of 83. Loopback only: ``--url`` (a server already
running, e.g. another build, or vLLM with ``--vocab``) must be on 127.0.0.1 or localhost.

Run (from the repository root):
  python benchmarks/bench_serve.py                                 # 64 clients, 60 s (~70 s)
  python benchmarks/bench_serve.py --clients 16 --duration 10 --json /tmp/serve.json
Writes benchmarks/results/serve_load.json (``--json``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_TEACHER = ROOT / "src" / "opd" / "assets" / "demo" / "teacher"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start_server(teacher: str, threads: int, log) -> tuple[subprocess.Popen, str]:
    """``opd serve-teacher`` on a free port; its URL, from the line it prints once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd", "serve-teacher", teacher, "--port", "0", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=log,  # a file, not a pipe: a pipe nobody reads would stall the server once full
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not match:
        proc.kill()
        log.seek(0)
        raise RuntimeError(f"the teacher server did not start: {line.strip()} {log.read()[-2000:]}")
    return proc, match.group(0)


def stop_server(proc: subprocess.Popen) -> dict:
    """SIGTERM, as a job scheduler or ``docker stop`` sends it: the exit code and how long it took."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return {"exit_code": code, "stop_s": round(time.monotonic() - t0, 2)}


def vocab_size(url: str, given: int) -> int:
    if given:
        return given
    with urllib.request.urlopen(url + "/opd/vocab", timeout=30) as r:  # opd's server only; else --vocab
        info = json.loads(r.read())
    return min(info["tokens"], info["head_rows"])


def error_kind(exc: BaseException) -> str:
    """A short name for what went wrong with one request."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    reason = getattr(exc, "reason", exc)  # urllib wraps socket errors in URLError
    kinds = [
        (ConnectionResetError, "connection reset"),
        (ConnectionRefusedError, "connection refused"),
        (BrokenPipeError, "broken pipe"),
        (http.client.RemoteDisconnected, "closed without an answer"),
        ((TimeoutError, socket.timeout), "timeout"),
        (http.client.IncompleteRead, "answer cut short"),
    ]
    for cls, name in kinds:
        if isinstance(reason, cls) or isinstance(exc, cls):
            return name
    return type(reason).__name__


def client(url: str, args, vocab: int, seed: int, deadline: float, out: dict) -> None:
    """Post requests until the deadline; record each one's latency or error kind in ``out``."""
    rng = random.Random(seed)
    while time.monotonic() < deadline and out["requests"] < args.max_requests:
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(args.prompts)
        ]
        payload = {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": args.k}
        req = urllib.request.Request(
            url + "/v1/completions", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        out["requests"] += 1
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=args.request_timeout) as r:
                answer = json.loads(r.read())
            plps = [c["prompt_logprobs"] for c in answer["choices"]]
            if [len(p) for p in plps] != [len(p) for p in prompts] or any(p[0] is not None for p in plps):
                out["errors"].append("malformed answer")
                continue
            out["latencies"].append(time.monotonic() - t0)
        except Exception as exc:  # every failure counts, by kind
            out["errors"].append(error_kind(exc))


def run(url: str, args) -> dict:
    vocab = vocab_size(url, args.vocab)
    deadline = time.monotonic() + args.duration
    outs = [{"requests": 0, "latencies": [], "errors": []} for _ in range(args.clients)]
    threads = [
        threading.Thread(target=client, args=(url, args, vocab, args.seed + i, deadline, outs[i]), daemon=True)
        for i in range(args.clients)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:  # bounded: each client stops at the deadline, a request after its timeout
        t.join(timeout=max(deadline - time.monotonic(), 0) + args.request_timeout + 30)
    wall = time.monotonic() - t0
    latencies = sorted(x for o in outs for x in o["latencies"])
    errors = Counter(e for o in outs for e in o["errors"])

    def pct(q: float) -> float | None:
        return round(latencies[min(int(q * len(latencies)), len(latencies) - 1)], 3) if latencies else None

    return {
        "requests": sum(o["requests"] for o in outs),
        "answers": len(latencies),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(errors.most_common()),
        "answers_per_s": round(len(latencies) / wall, 1),
        "p50_s": pct(0.50),
        "p99_s": pct(0.99),
        "max_s": round(latencies[-1], 3) if latencies else None,
        "wall_s": round(wall, 1),
        "clients_still_running": sum(t.is_alive() for t in threads),
        "clients_without_an_answer": sum(not o["latencies"] for o in outs),
    }


def table(result: dict) -> str:
    p, r = result["plan"], result["result"]
    stop = result.get("server_stop")
    kinds = ", ".join(f"{k}: {v}" for k, v in r["errors_by_kind"].items()) or "none"
    lines = [
        f"{p['clients']} clients for {p['duration_s']} s, {p['prompts']} prompt(s) of {p['min_len']}-{p['max_len']} "
        f"tokens per request, prompt_logprobs {p['k']}, one connection per request; server: {p['server']} "
        f"({result['machine']['cpus']} cores shared by server and clients, "
        f"1-minute load average before {result['load1_before']:.1f}).",
        "",
        "| requests | answers | answers/s | errors | p50 s | p99 s | max s | clients without an answer |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['requests']} | {r['answers']} | {r['answers_per_s']} | {r['errors']} | {r['p50_s']} | {r['p99_s']} | "
        f"{r['max_s']} | {r['clients_without_an_answer']} |",
        "",
        f"errors by kind: {kinds}",
    ]
    if stop:
        lines.append(f"server stopped by SIGTERM: exit code {stop['exit_code']} after {stop['stop_s']} s")
    return "\n".join(lines)


def machine() -> dict:
    import starlette
    import uvicorn

    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "uvicorn": uvicorn.__version__,
        "starlette": starlette.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64, help="client threads posting at once")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds the clients post for")
    ap.add_argument("--teacher", default=str(DEMO_TEACHER), help="model directory to serve (default: the demo's)")
    ap.add_argument("--url", default="", help="an already running server on loopback, instead of starting one")
    ap.add_argument("--vocab", type=int, default=0, help="token ids to draw from (default: the server's /opd/vocab)")
    ap.add_argument("--k", type=int, default=32, help="prompt_logprobs per position")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per request")
    ap.add_argument("--min-len", type=int, default=40, help="shortest prompt (tokens)")
    ap.add_argument("--max-len", type=int, default=70, help="longest prompt (tokens)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds a client waits for one answer")
    ap.add_argument("--max-requests", type=int, default=100_000, help="per client, a bound besides the duration")
    ap.add_argument("--threads", type=int, default=1, help="torch (OpenMP) threads of the server started here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "serve_load.json")
    args = ap.parse_args()
    if min(args.clients, args.prompts, args.k, args.min_len, args.threads) < 1 or args.max_len < args.min_len:
        ap.error("--clients, --prompts, --k, --min-len and --threads must be >= 1, --max-len >= --min-len")
    if not 0 < args.duration <= 3600:
        ap.error("--duration must be in (0, 3600] seconds")
    if args.url and urllib.parse.urlsplit(args.url).hostname not in LOOPBACK:
        ap.error(f"--url {args.url}: loopback only (127.0.0.1 or localhost)")
    teacher = Path(args.teacher).resolve()
    teacher = teacher.relative_to(ROOT) if teacher.is_relative_to(ROOT) else teacher
    plan = {
        "clients": args.clients,
        "duration_s": args.duration,
        "k": args.k,
        "prompts": args.prompts,
        "min_len": args.min_len,
        "max_len": args.max_len,
        "server": args.url or f"opd serve-teacher {teacher}, {args.threads} torch thread(s)",
    }
    result = {"plan": plan, "machine": machine(), "load1_before": os.getloadavg()[0]}
    with tempfile.TemporaryFile("w+") as log:
        proc, url = (None, args.url.rstrip("/")) if args.url else start_server(args.teacher, args.threads, log)
        try:
            result["result"] = run(url, args)
        finally:
            if proc is not None:
                result["server_stop"] = stop_server(proc)
                log.seek(0)
                result["server_log_tail"] = log.read()[-2000:]
    text = table(result)
    print("\n" + text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    from opd.lab.experiments.core import machine_info, source_commit  # after the load: the clients stay light

    result = {**result, "commit": source_commit(), "machine": {**machine_info(), **result["machine"]}}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
