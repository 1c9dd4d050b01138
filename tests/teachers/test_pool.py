"""A teacher served by several servers (``--teacher-url A,B,C``): the option's forms, which server gets
each request, a server lost and found again, servers that serve different teachers, and runs against
two ``opd serve-teacher`` processes, one killed mid-run (no step lost, the same scores).

The pool's choices are tested on stand-ins (a request is a function of the server it is given); the
HTTP checks on in-process servers (:func:`opd.teachers.server.start_server`); the killed server is a
real process (test_teacher_restart.ServedTeacher), started once for this module.
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import time

import pytest
import torch
from helpers import free_port, rollouts
from test_bad_input import SHORT, assert_one_line_error, run_opd
from test_teacher_restart import RUN, FakeClock, ServedTeacher, same_run
from typer.testing import CliRunner

from opd.config import ConfigError, TrainConfig, build_config
from opd.config.files import dump_config, read_config_file
from opd.errors import UserError
from opd.models.loading import head_weight, load_model, load_tokenizer
from opd.service import Patience
from opd.teachers.client import HTTPTeacher, vocab_info
from opd.teachers.pool import Identity, NoAnswer, TeacherPool
from opd.teachers.scoring import HFTeacher, TeacherUnavailable
from opd.teachers.server import Limits, TeacherApp, start_server, stop_server
from opd.training import loop as train_mod
from opd.training import producer
from opd.training import setup as setup_mod

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]

# ----------------------------------------------------------------------------- the option


def test_teacher_url_takes_servers_comma_separated_repeated_or_as_a_yaml_list(tiny_models, tmp_path, monkeypatch):
    from opd.cli import app

    student, joined = str(tiny_models[0]), ",".join(URLS)
    seen = []
    monkeypatch.setattr(train_mod, "train", seen.append)
    args = ["train", "--student", student, "--teacher-url", URLS[0], "--teacher-url", f"{URLS[1]}, {URLS[2]}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen[0].teacher.teacher_url == joined  # repeated and comma-separated flags add up, in order
    (tmp_path / "list.yaml").write_text(f"student: {student}\nteacher_url:\n" + "".join(f"  - {u}\n" for u in URLS))
    (tmp_path / "one.yaml").write_text(f"student: {student}\nteacher_url: {URLS[0]}\n")
    assert build_config(TrainConfig, read_config_file(tmp_path / "list.yaml")).teacher.teacher_url == joined
    assert build_config(TrainConfig, read_config_file(tmp_path / "one.yaml")).teacher.teacher_url == URLS[0]
    # config.json keeps one string: a run's own (a pool's) and an older single-URL one load back the same
    for url in (joined, URLS[0]):
        dump_config(TrainConfig.from_flat(student=student, teacher_url=url), tmp_path / "config.json")
        assert json.loads((tmp_path / "config.json").read_text())["teacher"]["teacher_url"] == url
        assert build_config(TrainConfig, read_config_file(tmp_path / "config.json")).teacher.teacher_url == url


@pytest.mark.parametrize(
    "value, said",
    [
        (f"{URLS[0]},ftp://b:1", "--teacher-url 'ftp://b:1' must start with http:// or https://"),
        (f"{URLS[0]},{URLS[1]},{URLS[0]}/", f"lists {URLS[0]} more than once"),
        ([URLS[0], 8000], "must be a URL, several comma-separated, or a list of them"),
    ],
)
def test_a_bad_server_in_the_list_is_named(tiny_models, value, said):
    with pytest.raises(ConfigError, match=said):
        TrainConfig.from_flat(student=str(tiny_models[0]), teacher_url=value)


# ----------------------------------------------------------------------------- the pool, on stand-ins


class StandIns:
    """A pool of ``URLS`` whose servers serve ``models`` (by URL), answer nothing while in ``down``, and
    take requests that are functions of the server: no HTTP. ``clock``: the pool's patience's (tests move it)."""

    def __init__(self, models: dict | None = None, rank: int = 0):
        self.down: set[str] = set()
        self.identified: list[str] = []  # the URL of each identify
        self.models = models or dict.fromkeys(URLS, "teacher")
        self.lines: list[str] = []
        self.clock = FakeClock()
        self.patience = Patience("pool", 60, clock=self.clock, sleep=self.clock.sleep, log=self.lines.append)
        self.pool = TeacherPool(URLS, self.patience, self.identify, self.verify, rank=rank)

    @classmethod
    def started(cls) -> StandIns:
        s = cls()
        s.pool.start()
        return s

    def identify(self, server) -> Identity:
        self.identified.append(server.url)
        self.answer(server)
        return Identity(self.models[server.url], None)

    def verify(self, server) -> None:
        self.answer(server)

    def answer(self, server) -> str:
        if server.url in self.down:
            raise NoAnswer("/v1/completions", "connection refused")
        return server.url

    def server(self, url: str):
        return next(s for s in self.pool.servers if s.url == url)


def test_requests_go_to_the_least_busy_server_and_ties_take_turns():
    s = StandIns.started()
    got = []

    def hold(cost: int, then=None):
        """A request of ``cost`` tokens that sends ``then`` while it is held (so both are outstanding)."""

        def request(server):
            got.append((server.url, cost))
            return then() if then else None

        return lambda: s.pool.send(cost, request)

    # 100 tokens on one server, 40 on the next, 10 on the last: the next request goes to the 10's
    hold(100, hold(40, hold(10, hold(5))))()
    assert got == [(URLS[0], 100), (URLS[1], 40), (URLS[2], 10), (URLS[2], 5)]
    got.clear()
    for _ in range(6):  # nothing outstanding: each in turn
        hold(7)()
    assert [u for u, _ in got] == URLS * 2
    assert [srv.outstanding for srv in s.pool.servers] == [0, 0, 0]


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_each_rank_starts_its_turns_at_another_server(rank, monkeypatch):
    """Each rank balances only its own requests: were ties broken in the same order everywhere, every
    rank's first request of a step would go to the first server."""
    got = []
    for s in (StandIns(rank=rank), None):
        if s is None:  # without one given: torchrun's RANK
            monkeypatch.setenv("RANK", str(rank))
            s = StandIns()
            s.pool = TeacherPool(URLS, s.patience, s.identify, s.verify)
        s.pool.start()
        got.append([s.pool.send(1, s.answer) for _ in range(4)])
    turn = [URLS[(rank + i) % 3] for i in range(4)]
    assert got == [turn, turn]


def test_a_failed_server_is_skipped_and_rejoins_once_it_answers():
    s = StandIns.started()
    s.down.add(URLS[0])
    # the request that finds it gone goes on to the next server; none of it is lost
    assert s.pool.send(3, s.answer) == URLS[1]
    assert [srv.up for srv in s.pool.servers] == [False, True, True]
    assert s.lines == [
        f"teacher server {URLS[0]} failed (connection refused); its requests go to the other 2 server(s) "
        "while it is asked again, every 15 s at most"
    ]
    assert {s.pool.send(3, s.answer) for _ in range(4)} == {URLS[1], URLS[2]}  # not asked before its backoff
    s.down.clear()
    s.clock.now += 0.5  # its first backoff: the next request asks it again, in a thread of its own
    assert s.pool.send(3, s.answer) in URLS[1:]
    deadline = time.monotonic() + 10
    while not s.server(URLS[0]).up and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.lines[-1] == f"teacher server {URLS[0]} is back; it takes requests again"
    assert URLS[0] in {s.pool.send(3, s.answer) for _ in range(3)}


def test_with_every_server_down_a_request_waits_like_a_single_servers_then_gives_up():
    s = StandIns.started()
    s.down.update(URLS)
    s.clock.on_sleep = lambda n: n == 2 and s.down.discard(URLS[2])  # one comes back during the second wait
    assert s.pool.send(1, s.answer) == URLS[2]  # tried on each server, then waited for
    assert s.clock.sleeps == [0.5, 1]
    assert s.lines[2:] == [
        "teacher server pool unreachable (connection refused); waiting up to 60 s (--teacher-wait)",
        f"teacher server {URLS[2]} is back; it takes requests again",
        "teacher server pool is back after 2 s",
    ]
    s.down.update(URLS)
    s.clock.on_sleep = None
    with pytest.raises(TeacherUnavailable) as err:
        s.pool.send(1, s.answer)
    assert str(err.value).startswith(f"teacher servers {', '.join(URLS)} are unreachable after ")
    assert "(connection refused, --teacher-wait 60); start them" in str(err.value)


def test_a_pool_of_different_models_is_refused_naming_both():
    s = StandIns({**dict.fromkeys(URLS, "teacher"), URLS[2]: "other"})
    with pytest.raises(UserError) as err:
        s.pool.start()
    assert str(err.value).startswith(
        f"teacher servers {URLS[0]} and {URLS[2]} serve different teachers ({URLS[0]}: model 'teacher', vocabulary "
        f"not reported; {URLS[2]}: model 'other', vocabulary not reported)"
    )


def test_a_server_back_with_another_teacher_is_left_out_once_and_not_asked_again():
    s = StandIns.started()
    s.down.add(URLS[2])
    assert [s.pool.send(1, s.answer) for _ in range(3)] == [URLS[0], URLS[1], URLS[0]]  # the third resent
    s.down.clear()
    s.models[URLS[2]] = "other"  # restarted with another model
    asked = s.identified.count(URLS[2])
    for _ in range(5):  # past every backoff: a request would ask it again, and revive() too
        s.clock.now += 20
        s.pool.send(1, s.answer)
        deadline = time.monotonic() + 10
        while s.server(URLS[2]).probing and time.monotonic() < deadline:
            time.sleep(0.01)
        s.pool.revive()
    assert s.identified.count(URLS[2]) == asked + 1
    left_out = [line for line in s.lines if "left out" in line]
    assert left_out == [
        f"teacher server {URLS[2]} answers but is left out of the pool: teacher servers {URLS[0]} and {URLS[2]} "
        "serve different teachers ("
        + f"{URLS[0]}: model 'teacher', vocabulary not reported; {URLS[2]}: model 'other', vocabulary not reported)"
        + "; every server of --teacher-url must serve the same model with the same tokenizer: start each from the "
        "same model, with the same --served-model-name"
    ]
    assert not s.server(URLS[2]).up


@pytest.mark.parametrize("checked_first", ["vllm", "opd"])
def test_a_cross_tokenizer_pool_of_vllm_and_opd_servers_settles_its_rows_in_either_order(
    tiny_models, checked_first, monkeypatch
):
    """A cross-tokenizer teacher (no rows given) served by a vLLM server (no vocabulary reported) and an
    opd server whose head has more rows than its tokenizer has tokens (Qwen: 151,936 and 151,669): the
    opd server's rows, whichever server's check runs first (the checks run in parallel threads)."""
    tok = load_tokenizer(tiny_models[1], "teacher")
    rows = len(tok) + 7
    vllm, opd = URLS[:2]
    done = {vllm: threading.Event(), opd: threading.Event()}
    later = opd if checked_first == "vllm" else vllm

    def identify(self, server):
        return Identity("teacher", vocab_info(tok, rows) if server.url == opd else None)

    def probe_tokenizer(self, server):  # the vLLM server's check
        return wait_then(server, lambda: True)

    def check_vocab(self, theirs):  # the opd server's
        return wait_then(self.pool.servers[1], lambda: real_check(self, theirs))

    def wait_then(server, check):
        if server.url == later:
            assert done[vllm if later == opd else opd].wait(10)
        try:
            return check()
        finally:
            done[server.url].set()

    real_check = HTTPTeacher._check_vocab
    monkeypatch.setattr(HTTPTeacher, "_identify", identify)
    monkeypatch.setattr(HTTPTeacher, "_probe_tokenizer", probe_tokenizer)
    monkeypatch.setattr(HTTPTeacher, "_check_vocab", check_vocab)
    client = HTTPTeacher([vllm, opd], tok, None, wait=0)
    assert all(done[u].is_set() for u in (vllm, opd))
    assert [s.up for s in client.pool.servers] == [True, True]
    assert client.vocab_rows == rows


# ----------------------------------------------------------------------------- opd's servers over HTTP


@pytest.fixture(scope="module")
def apps(tiny_models):
    """Two in-process servers of the tiny teacher (one named otherwise) and one whose tokenizer has one
    token more: (urls by name, tokenizer, vocabulary rows); each stopped at the end."""
    model, tok = load_model(tiny_models[1], "teacher"), load_tokenizer(tiny_models[1], "teacher")
    more = load_tokenizer(tiny_models[1], "teacher")
    more.add_tokens(["<extra>"])
    limits = Limits(max_k=16, max_prompts=32)
    servers = {
        "a": start_server(TeacherApp(model, tok, "tiny", limits)),
        "b": start_server(TeacherApp(model, tok, "tiny", Limits(max_k=4))),
        "renamed": start_server(TeacherApp(model, tok, "tiny-renamed", limits)),
        "retokenized": start_server(TeacherApp(model, more, "tiny", limits)),
    }
    yield {n: f"http://127.0.0.1:{s.server_address[1]}" for n, s in servers.items()}, tok, head_weight(model).shape[0]
    for server in servers.values():
        stop_server(server)


@pytest.mark.parametrize("other, model, extra", [("renamed", "tiny-renamed", 0), ("retokenized", "tiny", 1)])
def test_servers_of_another_model_or_tokenizer_are_refused_naming_both(apps, other, model, extra):
    urls, tok, rows = apps
    with pytest.raises(UserError) as err:
        HTTPTeacher([urls["a"], urls[other]], tok, rows, wait=0)
    said = str(err.value)
    assert said.startswith(
        f"teacher servers {urls['a']} and {urls[other]} serve different teachers ({urls['a']}: model 'tiny', "
        f"vocabulary of {len(tok)} tokens, {rows} output rows, sha256 "
    )
    assert f"; {urls[other]}: model '{model}', vocabulary of {len(tok) + extra} tokens" in said
    assert said.endswith("start each from the same model, with the same --served-model-name")


def test_opd_train_refuses_such_a_pool_in_one_line(apps, tiny_models, tmp_path, monkeypatch, capsys):
    urls, _, _ = apps
    pool = f"{urls['a']},{urls['renamed']}"
    args = ["train", "--student", tiny_models[0], "--teacher-url", pool, "--out", tmp_path / "run", *shlex.split(SHORT)]
    code, out, err = run_opd(monkeypatch, capsys, args)
    a, renamed = re.escape(urls["a"]), re.escape(urls["renamed"])
    assert_one_line_error(
        code,
        out,
        err,
        rf"teacher servers {a} and {renamed} serve different teachers \({a}: model 'tiny', .*; {renamed}: model "
        r"'tiny-renamed', .*\); every server of --teacher-url must serve the same model with the same tokenizer: "
        r"start each from the same model, with the same --served-model-name",
    )


def test_a_server_that_joins_later_is_checked_and_a_wrong_one_left_out(apps, tiny_models):
    urls, tok, rows = apps
    ports, lines = [free_port(), free_port()], []
    wrong, right = (f"http://127.0.0.1:{p}" for p in ports)
    client = HTTPTeacher([urls["a"], wrong, right], tok, rows, k=8, wait=0, log=lines.append)
    assert [s.up for s in client.pool.servers] == [True, False, False] and lines == []
    assert client.pool.servers[1].reason == "connection refused"
    model = load_model(tiny_models[1], "teacher")
    servers = [
        start_server(TeacherApp(model, tok, name, Limits(max_k=16)), port=p)
        for name, p in zip(["tiny-renamed", "tiny"], ports)
    ]
    try:
        assert client.pool.revive()  # a still answers; one late one with another model, one with the teacher
        assert [s.up for s in client.pool.servers] == [True, False, True]
        sha = client.pool.identity.vocab["sha256"][:12]
        assert set(lines) == {
            f"teacher server {right} is back; it takes requests again",
            f"teacher server {wrong} answers but is left out of the pool: teacher servers {urls['a']} and {wrong} "
            f"serve different teachers ({urls['a']}: model 'tiny', vocabulary of {len(tok)} tokens, {rows} output "
            f"rows, sha256 {sha}; {wrong}: model 'tiny-renamed', vocabulary of {len(tok)} tokens, {rows} output "
            f"rows, sha256 {sha}); every server of --teacher-url must serve the same model with the same "
            "tokenizer: start each from the same model, with the same --served-model-name",
        }  # in either order: they are checked in parallel
        client.pool.revive()  # left out for the run: not asked again, no second line
        assert len(lines) == 2 and [s.up for s in client.pool.servers] == [True, False, True]
    finally:
        for server in servers:
            stop_server(server)


def test_every_server_is_asked_for_k_when_it_joins(apps):
    urls, tok, rows = apps
    HTTPTeacher([urls["a"], urls["b"]], tok, rows, k=4, wait=0)  # b's --max-k is 4
    with pytest.raises(UserError, match=rf"teacher server {urls['b']}/v1/completions answered HTTP 422: .*--max-k"):
        HTTPTeacher([urls["a"], urls["b"]], tok, rows, k=8, wait=0)


def test_the_libraries_limits_default_to_the_models_context_as_the_cli_does(tiny_models):
    model, tok = load_model(tiny_models[1], "teacher"), load_tokenizer(tiny_models[1], "teacher")
    assert Limits().max_prompt_tokens == 0  # opd serve-teacher --max-prompt-tokens 0: the model's context
    app = TeacherApp(model, tok, "t", Limits(max_k=4))
    try:
        assert app.limits.max_prompt_tokens == model.config.max_position_embeddings != 4096
        assert app.limits.max_k == 4
    finally:
        app.scorer.close()


# ----------------------------------------------------------------------------- opd serve-teacher processes


@pytest.fixture(scope="module")
def two(tiny_models, tmp_path_factory):
    """Two ``opd serve-teacher`` processes of the tiny teacher (started together), and a 6-step run
    against the first alone: the reference the pool's runs must equal. (Two show what three would: the
    pool's choices among more servers are the stand-ins' tests above.)"""
    logs = tmp_path_factory.mktemp("servers")
    servers = [ServedTeacher(tiny_models[1], logs / f"{i}.txt") for i in range(2)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(300)  # both start at once: slow on a busy 2-core machine
        out = tmp_path_factory.mktemp("pool") / "one-server"
        cfg = TrainConfig.from_flat(
            student=str(tiny_models[0]), teacher_url=servers[0].url, out=str(out), **{**RUN, "steps": 6}
        )
        train_mod.train(cfg, show_progress=False)
        yield servers, cfg, out
    finally:
        for server in servers:
            server.stop()


@pytest.mark.xdist_group("teacher-pool")
def test_a_pools_servers_score_as_the_in_process_teacher_and_share_the_requests(two, tiny_models):
    servers, _, _ = two
    for server in servers:
        server.wait_ready(300)  # a test before may have restarted one
    tok = load_tokenizer(tiny_models[1], "teacher")
    batch = rollouts(tok, tiny_models[0], n=9)
    model = load_model(tiny_models[1], "teacher")
    client = HTTPTeacher([s.url for s in servers], tok, head_weight(model).shape[0], prompts_per_request=1, k=8)
    assert client.vocab_verified and client.binary and client.model_name == str(tiny_models[1])
    got, want = client.score(batch, 8), HFTeacher(model).score(batch, 8)
    m = batch.response_mask_NT
    assert torch.equal(got.topk_ids_NTK[m], want.topk_ids_NTK[m])
    torch.testing.assert_close(got.topk_logprobs_NTK[m], want.topk_logprobs_NTK[m].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.sampled_logprobs_NT[m], want.sampled_logprobs_NT[m].float(), atol=1e-5, rtol=0)
    answered = [s.answered for s in client.pool.servers]
    assert sum(answered) == 9 and min(answered) >= 1  # nine one-rollout requests, each server some


@pytest.mark.xdist_group("teacher-pool")  # one fixture, one set of servers, for both tests
def test_a_server_killed_mid_run_costs_no_step(two, tmp_path, monkeypatch):
    """The run's requests take turns (one a step): the server due at step 2 is killed as that step starts,
    so its request finds it gone and is answered by another. Every step's metrics and rollouts equal
    those of the run against one server. (A server coming back: the tests above.)"""
    servers, cfg, whole = two
    victim, lines, pools = servers[0], [], []
    real_make, real_rollout = setup_mod.make_teacher, producer.rollout_stage

    def make(c, student, tok):
        teacher = real_make(c, student, tok)
        pools.append(teacher.pool)
        teacher.patience.log = lines.append
        return teacher

    def rollout(run, step, *args):
        if step == 2:
            victim.kill()
        return real_rollout(run, step, *args)

    monkeypatch.setattr(setup_mod, "make_teacher", make)
    monkeypatch.setattr(producer, "rollout_stage", rollout)
    urls = ",".join(s.url for s in servers)
    try:
        train_mod.train(cfg.replace(out=str(tmp_path / "run"), teacher_url=urls), show_progress=False)
    finally:
        victim.start()  # for whichever test comes next
    assert lines == [
        f"teacher server {victim.url} failed (connection refused); its requests go to the other 1 server(s) "
        "while it is asked again, every 15 s at most"
    ]
    # in turns: steps 0 and 1, then 2 (the victim's, resent), 3, 4 and 5 on the other (the victim stays down)
    assert [s.answered for s in pools[0].servers] == [1, 5]
    same_run(tmp_path / "run", whole)


def test_tasks_naming_the_same_servers_in_another_order_share_one_pool(tiny_models):
    """A teacher several tasks name is made once (opd.training.setup.build_tasks): the same servers listed
    in another order, or written otherwise (a trailing slash), are the same pool."""
    student = str(tiny_models[0])

    def key(url: str) -> tuple:
        return setup_mod._teacher_key(TrainConfig.from_flat(student=student, teacher_url=url))

    assert key(f"{URLS[0]},{URLS[1]}/") == key(f"{URLS[1]},{URLS[0]}") == key(f"{URLS[0]}/v1,{URLS[1]}")
    assert key(f"{URLS[0]},{URLS[1]}") != key(URLS[0])
    assert key(URLS[0]) != setup_mod._teacher_key(TrainConfig.from_flat(student=student, teacher=str(tiny_models[1])))
