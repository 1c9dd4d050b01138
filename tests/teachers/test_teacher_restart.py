"""A served teacher that goes away: the trainer waits for it, or checkpoints and stops, and loses nothing.

The client's waiting (:class:`opd.teachers.client.Patience`) is tested with an injected clock and sleep,
so no test sleeps through its backoff; the runs kill -9 an ``opd serve-teacher`` process at a
step's start (a hook, not a timer) and compare what the run wrote with an uninterrupted run's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import ENV, free_port, read_metrics, run_options
from typer.testing import CliRunner

from opd.config import ConfigError, TrainConfig, build_config
from opd.errors import UserError
from opd.models.loading import head_weight, load_model, load_tokenizer
from opd.rollout.sampling import HFRollout
from opd.teachers.client import HTTPTeacher, Patience, vocab_info
from opd.teachers.factory import make_teacher
from opd.teachers.scoring import TeacherUnavailable
from opd.training import loop as train_mod
from opd.training import producer
from opd.training import setup as setup_mod


class FakeClock:
    """``clock`` and ``sleep`` for :class:`Patience`: sleeping moves the clock, and ``on_sleep`` may act."""

    def __init__(self, on_sleep=None):
        self.now, self.sleeps, self.on_sleep = 0.0, [], on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep:
            self.on_sleep(len(self.sleeps))


def patience(clock: FakeClock, lines: list, **kw) -> dict:
    return dict(clock=clock, sleep=clock.sleep, log=lines.append, **kw)


# ----------------------------------------------------------------------------- the waiting, alone


def test_backoff_doubles_to_its_cap_and_the_last_try_lands_on_the_deadline():
    clock, lines = FakeClock(), []
    p = Patience("http://t", wait=60, **patience(clock, lines))
    attempt = 0
    while p.retry(attempt, 0.0, "connection refused"):
        attempt += 1
    assert clock.sleeps == [0.5, 1, 2, 4, 8, 15, 15, 14.5] and clock.now == 60
    assert attempt == 8  # 9 tries: at 0, 0.5, 1.5, 3.5, 7.5, 15.5, 30.5, 45.5 and 60 s
    assert lines == [
        "teacher server http://t unreachable (connection refused); waiting up to 60 s (--teacher-wait)",
        "teacher server http://t unreachable (connection refused); waiting, 30 s of 60 s",
    ]
    assert p.spent(attempt + 1) == "--teacher-wait 60"
    p.answered()
    assert lines[-1] == "teacher server http://t is back after 60 s"
    p.answered()  # an answer while nothing was down says nothing
    assert len(lines) == 3


def test_a_retry_cap_stops_first_and_no_patience_means_no_wait():
    clock, lines = FakeClock(), []
    capped = Patience("http://t", wait=60, retries=2, **patience(clock, lines))
    assert [capped.retry(a, 0.0, "x") for a in range(3)] == [True, True, False]
    assert clock.sleeps == [0.5, 1] and capped.spent(3) == "--teacher-retries 2"
    clock, lines = FakeClock(), []
    assert not Patience("http://t", wait=0, **patience(clock, lines)).retry(0, 0.0, "x")
    assert clock.sleeps == [] and lines == []


def test_concurrent_requests_tell_one_story():
    clock, lines = FakeClock(), []
    p = Patience("http://t", wait=60, **patience(clock, lines))
    threads = [threading.Thread(target=p.retry, args=(0, 0.0, "connection reset")) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lines == ["teacher server http://t unreachable (connection reset); waiting up to 60 s (--teacher-wait)"]


# ----------------------------------------------------------------------------- the client, against a stand-in


class _Scripted(BaseHTTPRequestHandler):
    """A teacher server stand-in: GET /v1/models plays ``script`` (a status, cut short, closed, ok),
    one entry per request, then answers; /opd/vocab answers ``vocab``."""

    script: list = []
    vocab: dict = {}
    posts = 0

    def log_message(self, *args):
        pass

    def _send(self, status, payload, declared=None):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(declared or len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/opd/vocab":
            return self._send(200, type(self).vocab)
        act = type(self).script.pop(0) if type(self).script else "ok"
        if act == "close":  # no answer at all
            self.close_connection = True
            return
        if act == "cut":  # an answer shorter than it says
            return self._send(200, {"data": []}, declared=1000)
        if isinstance(act, int):
            return self._send(act, {"error": {"message": "scripted"}})
        self._send(200, {"object": "list", "data": [{"id": "scripted"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        self._send(400, {"error": {"message": "prompt too long"}})


@pytest.fixture
def scripted(tiny_models):
    """(url, tokenizer, vocab rows, start): a stand-in on a free port; ``start()`` begins serving."""
    tok = load_tokenizer(tiny_models[1], "teacher")
    V = head_weight(load_model(tiny_models[1], "teacher")).shape[0]
    _Scripted.script, _Scripted.vocab, _Scripted.posts = [], vocab_info(tok, V), 0
    port, servers = free_port(), []

    def start():
        servers.append(ThreadingHTTPServer(("127.0.0.1", port), _Scripted))
        threading.Thread(target=servers[-1].serve_forever, args=(0.05,), daemon=True).start()

    yield f"http://127.0.0.1:{port}", tok, V, start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_startup_waits_for_a_server_that_comes_up_later(scripted):
    url, tok, V, start = scripted
    clock, lines = FakeClock(on_sleep=lambda n: n == 3 and start()), []
    client = HTTPTeacher(url, tok, V, **patience(clock, lines))
    assert client.model_name == "scripted" and clock.sleeps == [0.5, 1, 2]
    assert lines == [
        f"teacher server {url} unreachable (connection refused); waiting up to 600 s (--teacher-wait)",
        f"teacher server {url} is back after 4 s",
    ]


def test_startup_gives_up_after_the_wait_with_a_clear_error(scripted):
    url, tok, V, _ = scripted
    clock, lines = FakeClock(), []
    with pytest.raises(TeacherUnavailable) as err:
        HTTPTeacher(url, tok, V, wait=20, **patience(clock, lines))
    assert str(err.value) == (
        f"teacher server {url} is unreachable after 7 attempts over 20 s (connection refused, --teacher-wait 20); "
        f"start it (opd serve-teacher TEACHER_DIR --port PORT) or fix --teacher-url {url}"
    )
    assert clock.sleeps == [0.5, 1, 2, 4, 8, 4.5]


def test_5xx_cut_short_and_closed_answers_are_waited_out(scripted):
    url, tok, V, start = scripted
    start()
    _Scripted.script = [503, "cut", "close", 429]
    clock, lines = FakeClock(), []
    assert HTTPTeacher(url, tok, V, **patience(clock, lines)).vocab_verified
    assert clock.sleeps == [0.5, 1, 2, 4] and _Scripted.script == []
    assert lines[0] == f"teacher server {url} unreachable (HTTP 503: scripted); waiting up to 600 s (--teacher-wait)"
    assert lines[1:] == [f"teacher server {url} is back after 8 s"]
    _Scripted.script = [503] * 10  # a server that keeps failing: its own log says why
    with pytest.raises(TeacherUnavailable, match=r"/v1/models answered HTTP 503: scripted; still failing after "):
        HTTPTeacher(url, tok, V, wait=5, **patience(FakeClock(), []))


def test_4xx_is_the_requests_fault_and_not_retried(scripted, tiny_models):
    url, tok, V, start = scripted
    start()
    _Scripted.script = [400]
    clock, lines = FakeClock(), []
    with pytest.raises(UserError, match="answered HTTP 400: scripted") as err:
        HTTPTeacher(url, tok, V, **patience(clock, lines))
    assert not isinstance(err.value, TeacherUnavailable) and clock.sleeps == [] and lines == []
    client = HTTPTeacher(url, tok, V, **patience(clock, lines))
    student = load_model(tiny_models[0], "student")
    batch = HFRollout(student, tok.eos_token_id, tok.pad_token_id).generate([[5, 6, 7]], [0], max_new_tokens=3)
    with pytest.raises(UserError, match="answered HTTP 400: prompt too long") as err:
        client.score(batch, 4)
    assert not isinstance(err.value, TeacherUnavailable) and _Scripted.posts == 1 and clock.sleeps == []


# ----------------------------------------------------------------------------- configuration


def test_teacher_wait_option_and_old_configs(tiny_models):
    from opd.cli import app

    help_text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "--teacher-wait" in help_text and "--teacher-retries" in help_text
    student = str(tiny_models[0])
    old = {"student": student, "teacher_url": "http://127.0.0.1:1", "teacher_retries": 3}
    cfg = build_config(TrainConfig, old)  # a config.json of an older run still loads, with its cap
    assert (cfg.teacher.teacher_wait, cfg.teacher.teacher_retries) == (600.0, 3)
    with pytest.raises(ConfigError, match="teacher_wait >= 0"):
        TrainConfig.from_flat(student=student, teacher_wait=-1.0)
    # make_teacher passes the settings on: no patience is an error at the first refusal
    cfg = TrainConfig.from_flat(student=student, teacher_url=f"http://127.0.0.1:{free_port()}", teacher_wait=0.0)
    student_model = load_model(tiny_models[0], "student")
    t0 = time.monotonic()
    with pytest.raises(TeacherUnavailable, match=r"after 1 attempts over 0 s \(connection refused, --teacher-wait 0\)"):
        make_teacher(cfg, student_model, load_tokenizer(tiny_models[0], "student"))
    assert time.monotonic() - t0 < 5


# ----------------------------------------------------------------------------- runs against a killed server


class ServedTeacher:
    """``opd serve-teacher`` in a subprocess on a fixed port: started, killed (-9) and restarted there."""

    def __init__(self, model_dir, log):
        self.model_dir, self.log, self.port, self.proc = model_dir, log, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "opd", "serve-teacher", str(self.model_dir), "--port", str(self.port)]
        with open(self.log, "a") as log:  # a file, not a pipe nobody reads: a full pipe would stall the server
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        pytest.fail(f"opd serve-teacher did not answer on {self.url} within {timeout} s")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


RUN = dict(
    device="cpu",
    steps=4,
    batch_size=2,
    max_new_tokens=8,
    k=8,
    warmup_steps=1,
    lr=3e-3,
    eval_every=0,
    eval_size=4,
    eval_samples=0,
    log_rollouts=2,
    ckpt_every=0,  # only the final one: a checkpoint written on giving up is the run's own doing
)
KILL_AT = 2


# The tests of served_run (and served_ahead_run, built on it) run on one xdist worker, so it is made once.
ON_SERVED_RUN = pytest.mark.xdist_group("teacher-restart-served")


@pytest.fixture(scope="module")
def served_run(tiny_models, tmp_path_factory):
    """(server, config, the uninterrupted run's directory): a served teacher and a run that never lost it."""
    server = ServedTeacher(tiny_models[1], tmp_path_factory.mktemp("server") / "log.txt")
    server.start()
    try:
        server.wait_ready()
        out = tmp_path_factory.mktemp("served") / "whole"
        cfg = TrainConfig.from_flat(student=str(tiny_models[0]), teacher_url=server.url, out=str(out), **RUN)
        train_mod.train(cfg, show_progress=False)
        yield server, cfg, out
    finally:
        server.stop()


def same_run(got, want) -> None:
    """Every step logged, with the same rollouts and metrics (timings aside): the same server process
    configuration scores each step's single request alone, so nothing is reordered."""
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]
    assert strip(read_metrics(got)) == strip(read_metrics(want))
    steps = run_options(want)["steps"]
    assert [r["step"] for r in read_metrics(got) if "train/loss" in r] == list(range(steps))
    assert (got / "rollouts.jsonl").read_text() == (want / "rollouts.jsonl").read_text()


def kill_at_step(monkeypatch, server: ServedTeacher, seen_rng: list | None = None) -> None:
    """kill -9 the server as step KILL_AT starts; with ``seen_rng``, after drawing from the global
    generator as a rollout with dropout would (a checkpoint of the step before must not hold that draw)."""
    real = producer.rollout_stage

    def rollout(run, step, *args):
        if step == KILL_AT and server.proc.poll() is None:
            if seen_rng is not None:
                seen_rng.append(torch.get_rng_state())
                torch.rand(5)
            server.kill()
        return real(run, step, *args)

    monkeypatch.setattr(producer, "rollout_stage", rollout)


@ON_SERVED_RUN
def test_a_run_waits_out_a_kill_9_and_restart_of_its_teacher(served_run, tmp_path, monkeypatch):
    server, cfg, whole = served_run
    lines = []
    real_make = setup_mod.make_teacher

    def make(c, student, tok):
        teacher = real_make(c, student, tok)
        teacher.patience.max_backoff = 1.0  # poll the restarting server every second (the default cap is 15 s)
        log = teacher.patience.log

        def restart_when_missed(line):
            lines.append(line)
            log(line)
            if "waiting up to" in line:  # the trainer has found it gone: bring it back on the same port
                server.start()

        teacher.patience.log = restart_when_missed
        return teacher

    monkeypatch.setattr(setup_mod, "make_teacher", make)
    kill_at_step(monkeypatch, server)
    cfg = cfg.replace(out=str(tmp_path / "run"), teacher_wait=120.0)
    train_mod.train(cfg, show_progress=False)
    server.wait_ready()
    assert len(lines) >= 2 and "unreachable (connection refused); waiting up to 120 s" in lines[0]
    assert "is back after" in lines[-1]
    same_run(tmp_path / "run", whole)


@ON_SERVED_RUN
def test_a_teacher_that_stays_down_leaves_a_checkpoint_and_resume_loses_nothing(
    served_run, tmp_path, monkeypatch, capfd
):
    server, cfg, whole = served_run
    seen_rng = []
    kill_at_step(monkeypatch, server, seen_rng)
    out = tmp_path / "run"
    cfg = cfg.replace(out=str(out), teacher_wait=1.0)
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        train_mod.train(cfg, show_progress=False)
    assert time.monotonic() - t0 < 30
    last = KILL_AT - 1
    assert isinstance(err.value, TeacherUnavailable)
    assert f"{server.url} is unreachable after " in str(err.value) and "--teacher-wait 1)" in str(err.value)
    assert str(err.value).endswith(
        f"; checkpoint of step {last} written in {out / 'checkpoints'}; resume with --resume once the teacher is up"
    )
    assert "waiting up to 1 s (--teacher-wait)" in capfd.readouterr().err
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:07d}"
    assert [r["step"] for r in read_metrics(out)] == list(range(KILL_AT))
    state = torch.load(out / "checkpoints" / f"step_{last:07d}" / "state.pt", weights_only=False)
    assert state["step"] == last and torch.equal(state["rng"]["torch"], seen_rng[0])
    monkeypatch.undo()
    server.start()
    server.wait_ready()
    train_mod.train(cfg.replace(resume=True), show_progress=False)
    same_run(out, whole)


@ON_SERVED_RUN
def test_giving_up_before_any_step_says_there_is_no_checkpoint(served_run, tmp_path, monkeypatch):
    server, cfg, _ = served_run

    def down(*args, **kw):
        raise TeacherUnavailable(f"teacher server {server.url} is unreachable after 3 attempts")

    monkeypatch.setattr(producer, "score_stage", down)
    with pytest.raises(TeacherUnavailable, match="no step had finished, so nothing was checkpointed; run the same"):
        train_mod.train(cfg.replace(out=str(tmp_path / "run")), show_progress=False)
    assert (tmp_path / "run" / "config.json").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_a_multi_task_step_cut_short_between_its_parts_is_redone_whole(tiny_models, tmp_path, monkeypatch):
    """Task a's part of step 2 is scored, task b's teacher gives up: step 1 is checkpointed, and the
    resumed run redoes step 2 from its rollouts on, equal to a run that was never cut short."""
    student, teacher = tiny_models
    tasks = [{"name": "a", "task_level": 1}, {"name": "b", "task_level": 2}]
    small = {**RUN, "steps": 3, "eval_size": 2}  # mix: the batch of 2 is one prompt per task
    cfg = TrainConfig.from_flat(student=str(student), teacher=str(teacher), tasks=tasks, task_mode="mix", **small)
    whole, out = tmp_path / "whole", tmp_path / "cut"
    train_mod.train(cfg.replace(out=str(whole)), show_progress=False)
    real_make = setup_mod.make_teacher

    class GivesUp:  # the teacher both tasks share: its 6th call is task b's part of step 2
        def __init__(self, real):
            self.real, self.calls = real, 0

        def score(self, batch, k, **kw):
            self.calls += 1
            if self.calls == 6:
                raise TeacherUnavailable("teacher server http://t is unreachable after 9 attempts")
            return self.real.score(batch, k, **kw)

    monkeypatch.setattr(setup_mod, "make_teacher", lambda *a: GivesUp(real_make(*a)))
    with pytest.raises(UserError, match=r"^task 'b': teacher server http://t is unreachable .*checkpoint of step 1 "):
        train_mod.train(cfg.replace(out=str(out)), show_progress=False)
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    monkeypatch.undo()
    train_mod.train(cfg.replace(out=str(out), resume=True), show_progress=False)
    same_run(out, whole)


# ----------------------------------------------------------------------------- scored ahead (--max-staleness)


@pytest.fixture(scope="module")
def served_ahead_run(served_run, tmp_path_factory):
    """(server, config, its uninterrupted run's directory) at --max-staleness 1: the served teacher scores
    each step's rollouts while the trainer updates on the step before."""
    server, cfg, _ = served_run
    server.wait_ready()
    out = tmp_path_factory.mktemp("served-ahead") / "whole"
    cfg = cfg.replace(out=str(out), max_staleness=1)
    train_mod.train(cfg, show_progress=False)
    return server, cfg, out


@ON_SERVED_RUN
def test_a_served_teacher_scores_the_next_step_while_the_trainer_updates(served_ahead_run, tmp_path, monkeypatch):
    """Each update (but the last step's) waits until the teacher has started on the next step's rollouts
    from the scoring thread: were scoring not concurrent with the update, the wait would time out.
    What the run logs equals the same run scoring every step in turn (and the prescored run's)."""
    server, cfg, whole = served_ahead_run
    started, waits = threading.Event(), []
    real_score, real_update = producer.score_stage, train_mod.update_stage

    def score(*args):
        if threading.current_thread().name.startswith("opd-score-ahead"):
            started.set()
        return real_score(*args)

    def update(run, step, parts):
        if step < cfg.optimizer.steps - 1:
            waits.append(started.wait(60))
            started.clear()
        return real_update(run, step, parts)

    monkeypatch.setattr(producer, "score_stage", score)
    monkeypatch.setattr(train_mod, "update_stage", update)
    ahead = tmp_path / "ahead"
    train_mod.train(cfg.replace(out=str(ahead)), show_progress=False)
    assert waits == [True] * (cfg.optimizer.steps - 1)
    monkeypatch.undo()
    monkeypatch.setattr(producer.Ahead, "_score_ahead", lambda self, step: None)
    in_turn = tmp_path / "in-turn"
    train_mod.train(cfg.replace(out=str(in_turn)), show_progress=False)
    same_run(ahead, in_turn)
    same_run(whole, in_turn)
    scored = [r for r in read_metrics(ahead) if "train/loss" in r]
    assert ["time/score_ahead" in r for r in scored] == [False] + [True] * (cfg.optimizer.steps - 1)
    assert not any("time/score_ahead" in r for r in read_metrics(in_turn))


@ON_SERVED_RUN
def test_a_teacher_lost_while_scoring_ahead_stops_the_next_step_and_resume_loses_nothing(
    served_ahead_run, tmp_path, monkeypatch
):
    """The server is killed as the trainer starts scoring step KILL_AT ahead: the thread's error is step
    KILL_AT's, so step KILL_AT - 1 (whose update ran meanwhile) is checkpointed and a resume equals the
    uninterrupted run."""
    server, cfg, whole = served_ahead_run
    real = producer.Ahead._score_ahead

    def kill_then_score(self, step):
        if step == KILL_AT and server.proc.poll() is None:
            server.kill()
        return real(self, step)

    monkeypatch.setattr(producer.Ahead, "_score_ahead", kill_then_score)
    out = tmp_path / "run"
    cut = cfg.replace(out=str(out), teacher_wait=1.0)
    with pytest.raises(TeacherUnavailable, match=f"checkpoint of step {KILL_AT - 1} written in "):
        train_mod.train(cut, show_progress=False)
    assert [r["step"] for r in read_metrics(out)] == list(range(KILL_AT))
    monkeypatch.undo()
    server.start()
    server.wait_ready()
    train_mod.train(cut.replace(resume=True), show_progress=False)
    same_run(out, whole)
