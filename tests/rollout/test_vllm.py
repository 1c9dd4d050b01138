"""opd against a real vLLM server (vLLM's CPU build, set up by ``opd vllm-setup``) on the packaged demo teacher
with an API key (``vllm_teacher``, tests/vllm_servers.py, shared with tests/teachers/test_pool_vllm.py): its
scores against the in-process teacher's, a training run against one with ``--teacher``, the tokenizer probe,
``--max-logprobs`` and the key; and vLLM's rollouts, on a server of this module's on the demo student.

Without a vLLM environment these tests skip, naming the set-up command; CI sets ``OPD_REQUIRE_VLLM=1``,
which makes a missing vLLM a failure instead, so they never skip there. The tests of each shared server
(``vllm_teacher``, ``vllm_student``) are one ``xdist_group``, so that the server starts once, on one worker
(``--dist loadgroup``); the tests that start engines of their own are in no group, free to run beside them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import files_holding, free_port, needs_vllm, rollouts
from vllm_servers import DEMO, KEY, MAX_LOGPROBS, ON_TEACHER_SERVER

from opd.config import TrainConfig
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.teachers.client import HTTPTeacher
from opd.teachers.scoring import HFTeacher
from opd.training import loop as train_mod
from opd.training.producer import Ahead

real_rollouts_ahead = Ahead._rollouts

AGENTIC_STUDENT = DEMO.parent / "agentic" / "student"
# float32 on both sides, different kernels: the largest gap seen was 4.6e-5 nats over 504 positions x 32
TOL = 2e-4

pytestmark = pytest.mark.slow  # CI's second step runs it
ON_STUDENT_SERVER = pytest.mark.xdist_group("vllm-student")  # every test that takes the fixture vllm_student


def demo_rollouts(n: int = 16, new_tokens: int = 40):
    tok = load_tokenizer(DEMO / "student", "student")
    return tok, rollouts(tok, DEMO / "student", n=n, new_tokens=new_tokens)


@ON_TEACHER_SERVER
def test_vllm_teacher_scores_equal_the_in_process_teacher(vllm_teacher):
    tok, batch = demo_rollouts()
    served = HTTPTeacher(vllm_teacher, tok, 2048, api_key=KEY, wait=0)
    assert not served.vocab_verified and not served.binary  # vLLM: probed through /tokenize, answers in JSON
    got, want = served.score(batch, MAX_LOGPROBS), HFTeacher(load_model(DEMO / "teacher", "teacher")).score(batch, 32)
    m = batch.response_mask_NT
    g_lp, w_lp = got.topk_logprobs_NTK[m], want.topk_logprobs_NTK[m].float()
    torch.testing.assert_close(g_lp, w_lp, atol=TOL, rtol=0)  # both sorted descending
    torch.testing.assert_close(got.sampled_logprobs_NT[m], want.sampled_logprobs_NT[m].float(), atol=TOL, rtol=0)
    # The same tokens in the same order, except where two log-probs are within the tolerance (a near-tie
    # may order either way): at a differing slot the log-prob must equal a neighbour's.
    differ = got.topk_ids_NTK[m] != want.topk_ids_NTK[m]
    gaps = torch.cat([w_lp[:, :-1] - w_lp[:, 1:], torch.full_like(w_lp[:, :1], float("inf"))], 1)
    near_tie = (gaps <= 2 * TOL) | torch.cat(
        [torch.zeros_like(gaps[:, :1], dtype=torch.bool), gaps[:, :-1] <= 2 * TOL], 1
    )
    assert not (differ & ~near_tie).any(), f"{int((differ & ~near_tie).sum())} top-K slots differ outside near-ties"
    assert m.sum() > 200


@ON_TEACHER_SERVER
def test_training_against_vllm_equals_the_in_process_teacher(vllm_teacher, tmp_path, monkeypatch):
    """The docs' "drop-in replacement": LSM losses of 3 steps, and the key (from the environment) nowhere
    in the run directory, its checkpoint included."""
    common = dict(
        student=str(DEMO / "student"),
        steps=3,
        batch_size=8,
        max_new_tokens=48,
        k=32,
        eval_every=0,
        eval_size=8,
        eval_samples=0,
        ckpt_every=2,
        log_rollouts=2,
        diag_positions=16,
    )
    monkeypatch.setenv("OPD_TEACHER_API_KEY", KEY)
    losses = {}
    for name, extra in (("local", {"teacher": str(DEMO / "teacher")}), ("vllm", {"teacher_url": vllm_teacher})):
        out = tmp_path / name
        train_mod.train(TrainConfig.from_flat(out=str(out), **common, **extra), show_progress=False)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses["vllm"]) == 3
    assert losses["vllm"] == pytest.approx(losses["local"], rel=1e-4, abs=1e-6)
    files, holding = files_holding(tmp_path / "vllm", KEY)
    assert any("checkpoints" in str(p) for p in files) and not holding


@ON_TEACHER_SERVER
def test_vllm_teacher_with_another_tokenizer_is_refused(vllm_teacher):
    tok = load_tokenizer(AGENTIC_STUDENT, "student")  # 3,282 tokens; the demo teacher has 2,048
    with pytest.raises(
        UserError, match=r"tokenizes differently from opd's tokenizer .*3282 tokens.*--teacher-tokenizer"
    ):
        HTTPTeacher(vllm_teacher, tok, len(tok), api_key=KEY, wait=0)


@ON_TEACHER_SERVER
def test_k_above_the_servers_max_logprobs_names_the_option(vllm_teacher):
    tok, batch = demo_rollouts(n=2, new_tokens=4)
    served = HTTPTeacher(vllm_teacher, tok, 2048, api_key=KEY, wait=0)
    with pytest.raises(UserError, match=r"greater than max allowed: 32.*start the server with a larger --max-logprobs"):
        served.score(batch, MAX_LOGPROBS + 8)


@ON_TEACHER_SERVER
def test_a_missing_or_wrong_key_is_a_clear_error(vllm_teacher):
    tok = load_tokenizer(DEMO / "student", "student")
    with pytest.raises(UserError, match="HTTP 401: Unauthorized; no API key was sent.*OPD_TEACHER_API_KEY"):
        HTTPTeacher(vllm_teacher, tok, 2048, wait=0)
    wrong = "not-" + KEY
    with pytest.raises(UserError, match="the API key sent was refused.*OPD_TEACHER_API_KEY") as err:
        HTTPTeacher(vllm_teacher, tok, 2048, api_key=wrong, wait=0)
    assert wrong not in str(err.value)


# ----------------------------------------------------------------------------- rollouts from vLLM

ROLLOUT_RUN = dict(
    student=str(DEMO / "student"),
    teacher=str(DEMO / "teacher"),
    rollout_engine="vllm",
    steps=3,
    batch_size=8,
    max_new_tokens=48,
    lr=2e-3,  # large enough that one update moves the policy well past the check's bound
    eval_every=0,
    eval_size=8,
    eval_samples=0,
    ckpt_every=0,
    log_rollouts=2,
    diag_positions=16,
)


@pytest.fixture(scope="module")
def vllm_student(tmp_path_factory):
    """A vLLM server on the demo student in dev mode (weights reloaded in place), with an API key."""
    from opd.rollout.vllm_server import start_vllm_server

    needs_vllm()  # its tests are a group of their own: the teacher fixture may never run on this worker
    log = tmp_path_factory.mktemp("vllm-student") / "server.log"
    server = start_vllm_server(DEMO / "student", log, max_model_len=512, api_key=KEY, dev_mode=True, timeout=900)
    yield server.url
    server.stop()


def test_vllm_rollouts_follow_the_trained_policy(tmp_path):
    """opd starts the engine on the student, syncs it before every batch, and the policy check holds."""
    needs_vllm()  # starts engines of its own: no module server
    out = tmp_path / "run"
    train_mod.train(TrainConfig.from_flat(out=str(out), **ROLLOUT_RUN), show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 3
    # float32 engine and trainer: 7.6e-7 nats per token seen; a stale policy is about 1e-2 (next test)
    assert all(r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), [r["rollout/engine_logprob_gap"] for r in steps]
    assert all(0 <= r["rollout/accuracy"] <= 1 for r in steps)
    assert all(r["time/weight_sync"] > 0 for r in steps)  # synced before every step's rollouts
    # opd's own server on this machine: the weights travel through /dev/shm (--vllm-sync auto), not the run folder
    assert (out / "vllm" / "server.log").is_file() and not (out / "vllm" / "weights").exists()
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 6 and all(r["response"] for r in rollouts)


def test_rollouts_run_ahead_from_vllm_checked_against_the_policy_that_sampled(tmp_path):
    """--max-staleness 1 with opd's engine: the rollout worker syncs the server with the weights of the policy
    one step back and checks the engine against those, not the trainer's newer ones (at this lr a step moves the
    log-probs about 1e-2: the check would trip against the trainer's)."""
    needs_vllm()  # starts engines of its own: no module server
    out = tmp_path / "run"
    train_mod.train(
        TrainConfig.from_flat(out=str(out), max_staleness=1, **{**ROLLOUT_RUN, "steps": 4}), show_progress=False
    )
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), [r["rollout/engine_logprob_gap"] for r in steps]


@ON_STUDENT_SERVER
def test_a_skipped_weight_sync_trips_the_policy_check(vllm_student, tmp_path, monkeypatch):
    """A user's engine (--vllm-url, its key from OPD_VLLM_API_KEY) that misses one sync: the run stops."""
    from opd.rollout.vllm_engine import VLLMRollout

    real_sync, calls = VLLMRollout.sync, []

    def sync_but_the_second(self):
        calls.append(1)
        if len(calls) != 2:  # step 1's rollouts come from step 0's weights
            real_sync(self)

    monkeypatch.setattr(VLLMRollout, "sync", sync_but_the_second)
    monkeypatch.setenv("OPD_VLLM_API_KEY", KEY)
    cfg = TrainConfig.from_flat(out=str(tmp_path / "run"), vllm_url=vllm_student, **ROLLOUT_RUN)
    with pytest.raises(UserError, match=r"does not serve the policy being trained.*--vllm-max-gap 0.001"):
        train_mod.train(cfg, show_progress=False)
    assert len(calls) == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/engine_logprob_gap"] < 1e-4 for r in records if "train/loss" in r] == [True]


@ON_STUDENT_SERVER
def test_vllm_rollouts_of_a_lora_student_carry_the_merged_weights(vllm_student, tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_VLLM_API_KEY", KEY)
    out = tmp_path / "run"
    cfg = TrainConfig.from_flat(out=str(out), vllm_url=vllm_student, lora_r=4, **{**ROLLOUT_RUN, "lr": 1e-2})
    train_mod.train(cfg, show_progress=False)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/engine_logprob_gap"] < 1e-4 for r in steps if "train/loss" in r] == [True] * 3


def test_a_lora_students_adapter_alone_reaches_the_engine(tmp_path):
    """--vllm-sync adapter (auto's choice for a LoRA run on opd's own server on GPUs): the server starts with
    --enable-lora, each sync loads the adapter in place under one name and the rollouts come from it: the
    policy check holds with a drawn adapter and again once it is drawn anew (reloaded in place), and fails
    for the base model alone (so the adapter is what made the difference)."""
    from opd.models.lora import apply_lora
    from opd.rollout.engine import EngineContext
    from opd.rollout.vllm_engine import start_vllm

    needs_vllm()
    tok = load_tokenizer(DEMO / "student", "student")
    cfg = TrainConfig.from_flat(out=str(tmp_path / "run"), lora_r=4, vllm_sync="adapter", **ROLLOUT_RUN)
    model = apply_lora(load_model(DEMO / "student", "student"), 4, 16.0, ["all-linear"], 0.0, DEMO / "student")

    def draw_adapter():  # a trained-looking adapter: B is zero at initialisation
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)

    engine = start_vllm(EngineContext(model, tok, cfg, cfg.model.student, folder=tmp_path / "engine"))
    try:
        assert engine.way.name == "adapter" and "--enable-lora --max-lora-rank 8" in engine.server.log_path.read_text()
        ids = [tok(f"Compute {i} + {i * 7}.")["input_ids"] for i in range(8)]
        for _ in range(2):  # synced when told (weights_changed), not before every rollout
            draw_adapter()
            engine.weights_changed()
            gap = engine.generate(ids, list(range(8)), max_new_tokens=24, top_p=0.9).report.policy_gap
            assert engine.model_name == "opd-student" and gap is not None and gap < 1e-4, gap
        engine.model_name, engine.max_gap = engine.base_name, float("inf")
        gap = engine.generate(ids, list(range(8)), max_new_tokens=24, top_p=0.9).report.policy_gap
        assert gap is not None and gap > 1e-2, gap  # the base model alone serves another policy
    finally:
        engine.close()
    assert (tmp_path / "engine" / "adapter" / "adapter_model.safetensors").is_file()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nobody listens there: connection refused


@ON_STUDENT_SERVER
def test_an_engine_that_stops_answering_checkpoints_and_the_run_resumes(vllm_student, tmp_path, monkeypatch):
    from opd.rollout import vllm_engine

    real_sync, calls = vllm_engine.VLLMRollout.sync, []

    def gone_at_step_2(self):
        calls.append(1)
        if len(calls) == 3:
            self.client.url = closed_port_url()  # the server went away: connection refused from here on
        real_sync(self)

    monkeypatch.setattr(vllm_engine.VLLMRollout, "sync", gone_at_step_2)
    monkeypatch.setenv("OPD_VLLM_API_KEY", KEY)
    run = {**ROLLOUT_RUN, "steps": 4, "out": str(tmp_path / "run"), "vllm_url": vllm_student, "vllm_wait": 0.0}
    with pytest.raises(vllm_engine.EngineUnavailable) as err:
        train_mod.train(TrainConfig.from_flat(**run), show_progress=False)
    assert "connection refused" in str(err.value) and "--vllm-wait 0" in str(err.value)
    assert str(err.value).endswith(
        f"checkpoint of step 1 written in {tmp_path / 'run' / 'checkpoints'}; resume with --resume once the rollout "
        "engine is up"
    )
    monkeypatch.setattr(vllm_engine.VLLMRollout, "sync", real_sync)
    train_mod.train(TrainConfig.from_flat(**run, resume=True), show_progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [0, 1, 2, 3]  # step 2 redone after the resume


@ON_STUDENT_SERVER
def test_an_engine_opd_started_that_exited_is_restarted(vllm_student, tmp_path, capsys, monkeypatch):
    import subprocess

    from opd.rollout import vllm_engine
    from opd.rollout.vllm_server import VLLMServer

    monkeypatch.setenv("OPD_VLLM_API_KEY", KEY)
    tok = load_tokenizer(DEMO / "student", "student")
    log = tmp_path / "server.log"
    log.write_text("ValueError: the engine died\n")
    placeholder = subprocess.Popen(["sleep", "120"], start_new_session=True)  # stands for the relaunched server
    engine = vllm_engine.VLLMRollout(
        load_model(DEMO / "student", "student"),
        tok,
        tmp_path / "weights",
        url=vllm_student,
        relaunch=lambda: VLLMServer(placeholder, vllm_student, log),
    )
    dead = subprocess.Popen(["true"], start_new_session=True)
    dead.wait()
    engine.server, engine.client.url = VLLMServer(dead, closed_port_url(), log), closed_port_url()
    ids = [tok("Tom has 3 apples.")["input_ids"]] * 2
    batch = engine.generate(ids, [0, 1], max_new_tokens=8, top_p=0.9)
    assert engine.restarts == 1 and engine.url == vllm_student and batch.response_mask_NT.any()
    assert "the vLLM engine exited" in capsys.readouterr().err
    engine.restarts = vllm_engine.MAX_RESTARTS
    engine.server, engine.client.url = VLLMServer(dead, closed_port_url(), log), closed_port_url()
    with pytest.raises(vllm_engine.EngineUnavailable, match=r"(?s)the engine exited \(2 restarts\).*the engine died"):
        engine.generate(ids, [0, 1], max_new_tokens=8)
    placeholder.kill()


# A stand-in for an engine's process that can be killed without killing the module's server: a TCP proxy
# to it, in a process (and session) of its own.
PROXY = """
import socket, sys, threading
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    client, _ = server.accept()
    upstream = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


def proxy_to(url: str, log: Path, port: int = 0):
    """A :class:`VLLMServer` whose process forwards ``port`` (a free one by default) to the server at ``url``."""
    import socket
    import subprocess
    import sys
    import time

    from opd.rollout.vllm_server import VLLMServer

    port = port or free_port()
    args = [sys.executable, "-c", PROXY, str(port), url.rsplit(":", 1)[1]]
    proc = subprocess.Popen(args, start_new_session=True)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return VLLMServer(proc, f"http://127.0.0.1:{port}", log)


def kill_engine_at(step: int, monkeypatch, server_of) -> None:
    """Kill (-9) the engine's process (``server_of(producer)``, the run's Ahead) as step ``step`` begins, before the trainer asks
    for step + 1's rollouts (step ``step``'s may still be in the making)."""
    import signal

    def ahead(self, s):
        if s == step:
            server = server_of(self)
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
        return real_rollouts_ahead(self, s)

    monkeypatch.setattr(Ahead, "_rollouts", ahead)


@ON_STUDENT_SERVER
def test_an_engine_killed_under_staleness_is_restarted_by_its_owner(vllm_student, tmp_path, monkeypatch, capsys):
    """--max-staleness 1 with an engine opd started (here a proxy to the module's server, so the test can
    kill it): killed at step 2, the worker finds it gone, the trainer restarts it (a new address) and the
    worker's requests go there: the run goes on as on-policy, each step checked against its policy."""
    from opd.rollout import vllm_engine

    launched: list = []

    def launch(model_dir, log, **kw):
        launched.append(proxy_to(vllm_student, Path(log)))
        return launched[-1]

    monkeypatch.setattr(vllm_engine, "start_vllm_server", launch)
    monkeypatch.setenv("OPD_VLLM_API_KEY", KEY)
    kill_engine_at(2, monkeypatch, lambda ahead: ahead.rollouts.engine.server)
    out = tmp_path / "run"
    try:
        train_mod.train(
            TrainConfig.from_flat(out=str(out), max_staleness=1, **{**ROLLOUT_RUN, "steps": 4}), show_progress=False
        )
    finally:
        for server in launched:
            server.stop()
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), [r["rollout/engine_logprob_gap"] for r in steps]
    assert len(launched) == 2 and launched[0].url != launched[1].url  # restarted once, on another port
    assert "the vLLM engine exited (the rollout worker's requests got no answer); restarting it (1 of 2)" in (
        capsys.readouterr().err
    )


@ON_STUDENT_SERVER
def test_a_users_engine_gone_under_staleness_checkpoints_and_the_run_resumes(vllm_student, tmp_path, monkeypatch):
    """--max-staleness 1 with --vllm-url (here a proxy the test kills at step 2) and --vllm-wait 0: the run
    stops as on-policy does, checkpointing the step before with the requests the worker could not make (their
    weights); brought back, --resume makes them with those weights: each step's policy is the uninterrupted
    run's (staleness 1), nothing lost."""
    from opd.rollout import vllm_engine

    monkeypatch.setenv("OPD_VLLM_API_KEY", KEY)
    users = [proxy_to(vllm_student, tmp_path / "proxy.log")]
    kill_engine_at(2, monkeypatch, lambda ahead: users[0])
    url = users[0].url
    run = {**ROLLOUT_RUN, "steps": 4, "out": str(tmp_path / "run"), "vllm_url": url, "vllm_wait": 0.0}
    try:
        with pytest.raises(vllm_engine.EngineUnavailable) as err:
            train_mod.train(TrainConfig.from_flat(max_staleness=1, **run), show_progress=False)
        assert "connection refused" in str(err.value) and "--vllm-wait 0" in str(err.value)
        assert re.search(
            r"checkpoint of step [12] written in .*; resume with --resume once the rollout engine is up$",
            str(err.value),
        )
        monkeypatch.setattr(Ahead, "_rollouts", real_rollouts_ahead)
        users.append(proxy_to(vllm_student, tmp_path / "proxy.log", port=int(url.rsplit(":", 1)[1])))
        train_mod.train(TrainConfig.from_flat(max_staleness=1, resume=True, **run), show_progress=False)
    finally:
        for server in users:
            server.stop()
    steps = [
        r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r
    ]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), [r["rollout/engine_logprob_gap"] for r in steps]


@ON_STUDENT_SERVER
def test_episodes_and_a_second_task_roll_out_from_one_engine(vllm_student, tmp_path, monkeypatch):
    """--tasks with math prompts and toy-game episodes (multi-turn, one request a turn) from one engine:
    every turn's tokens pass the policy check, and the engine is synced once per optimizer step, not per task
    (and once more for the final evaluation)."""
    from opd.rollout.vllm_engine import VLLMRollout

    real_sync, syncs = VLLMRollout.sync, []

    def counted(self):
        syncs.append(1)
        real_sync(self)

    monkeypatch.setattr(VLLMRollout, "sync", counted)
    monkeypatch.setenv("OPD_VLLM_API_KEY", KEY)
    out = tmp_path / "run"
    toy = dict(env="toy", env_level=1, max_new_tokens=160, max_action_tokens=24, max_turns=4, eval_size=3)
    run = {k: v for k, v in ROLLOUT_RUN.items() if k not in ("teacher", "max_new_tokens", "eval_size")}
    cfg = TrainConfig.from_flat(
        out=str(out),
        vllm_url=vllm_student,
        tasks=[
            {"name": "math", "teacher": str(DEMO / "teacher")},
            {"name": "toy", "teacher": str(DEMO / "teacher"), **toy},
        ],
        task_mode="mix",
        **{**run, "steps": 2, "lr": 1e-3},
    )
    train_mod.train(cfg, show_progress=False)
    steps = [
        r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r
    ]
    # one sync a step for both tasks' rollouts, and one before the final evaluation, which runs on the engine
    # with the last update's weights
    assert len(steps) == 2 and len(syncs) == 2 + 1
    assert all(r["toy/rollout/turns"] >= 1 and "math/train/loss" in r for r in steps)
    assert all(r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), [r["rollout/engine_logprob_gap"] for r in steps]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    episodes = [r for r in rollouts if r["task"] == "toy"]
    assert episodes and all(1 <= len(e["turns"]) <= 4 and e["end"] for e in episodes)  # --max-turns 4


def two_rank_args(out, *more: str) -> list[str]:
    """``opd train`` with vLLM rollouts for a 2-rank launch: 2 steps of batch 2 per rank."""
    args = ["train", "--student", str(DEMO / "student"), "--teacher", str(DEMO / "teacher"), "--out", str(out)]
    args += ["--rollout-engine", "vllm", "--steps", "2", "--batch-size", "2", "--max-new-tokens", "24"]
    return [
        *args,
        "--eval-every",
        "0",
        "--eval-size",
        "4",
        "--eval-samples",
        "0",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        *more,
    ]


def checked_steps(out) -> list[dict]:
    """A run's steps, each with the policy check held on every rank (the largest rank's gap is logged; past
    --vllm-max-gap, 1e-3, the rank would have stopped the run)."""
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert len(steps) == 2 and all(r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), steps
    return steps


def test_two_fsdp_ranks_roll_out_from_an_engine_each(tmp_path):
    """torchrun with 2 ranks under FSDP (gloo): each rank starts its own engine (its own folder, log and port,
    no GPU to give on this machine), gives it the full weights gathered for the rollout and rolls out its
    share of the batch there; the policy check holds on both at every step."""
    from helpers import launch

    needs_vllm()
    out = tmp_path / "fsdp"
    launch("torchrun", two_rank_args(out, "--fsdp"), timeout=900)
    assert all(r["time/weight_sync"] > 0 for r in checked_steps(out))  # the gathered weights, through /dev/shm
    ports = set()
    for rank in ("rank0", "rank1"):
        started = (out / "vllm" / rank / "server.log").read_text().splitlines()[0]
        assert started.startswith("opd: starting ") and started.endswith("(no GPU given)"), started
        ports.add(started.split("--port ")[1].split()[0])
    assert len(ports) == 2


@ON_STUDENT_SERVER
def test_two_fsdp_ranks_share_one_engine(vllm_student, tmp_path):
    """--vllm-url with 2 ranks under FSDP: one server for both; rank 0 gives it the gathered weights after
    each step while rank 1 waits, each rank sends its own share of the prompts, and the policy check holds on
    both ranks (rank 1 checks rollouts from weights rank 0 synced)."""
    from helpers import launch

    out = tmp_path / "shared"
    launch(
        "torchrun", two_rank_args(out, "--fsdp", "--vllm-url", vllm_student), timeout=900, env={"OPD_VLLM_API_KEY": KEY}
    )
    checked_steps(out)
    assert (out / "vllm" / "rank0" / "weights" / "model.safetensors").is_file()
    assert not (out / "vllm" / "rank1").exists()  # rank 1 neither writes weights nor starts a server


@pytest.mark.parametrize(
    "args, said",
    [
        ("--no-such-option", "api_server.py: error: unrecognized arguments: --no-such-option"),
        ("--max-num-seqs 0", "max_num_seqs\n  Input should be greater than or equal to 1"),
    ],
)
def test_vllm_args_the_engine_refuses_stop_it_with_its_error_line(tmp_path, args, said):
    """--vllm-args pass vLLM's own options through; one it refuses (an unknown option, a value out of range)
    is an error holding vLLM's own lines, as soon as the server exits (seconds, not --vllm-start-timeout)."""
    import time

    from opd.rollout.engine import EngineContext
    from opd.rollout.vllm_engine import start_vllm

    needs_vllm()
    tok = load_tokenizer(DEMO / "student", "student")
    cfg = TrainConfig.from_flat(
        student=str(DEMO / "student"), teacher=str(DEMO / "teacher"), rollout_engine="vllm", vllm_args=args
    )
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"the vLLM server exited \(status \d+\) before it was ready") as err:
        start_vllm(EngineContext(load_model(DEMO / "student", "student"), tok, cfg, cfg.model.student, folder=tmp_path))
    assert said in str(err.value) and time.monotonic() - t0 < 120


def test_the_vllm_rollouts_experiment_runs_quick(tmp_path):
    needs_vllm()  # starts engines of its own: no module server
    from opd.lab.experiments import run
    from opd.lab.experiments.stats import INCONCLUSIVE

    res = run("vllm-rollouts", tmp_path, seeds=1, quick=True, show_progress=False)
    assert [c["verdict"] for c in res["claims"]] == [INCONCLUSIVE]  # one seed decides nothing
    assert len(res["tables"]) == 3
    commands = (tmp_path / "vllm-rollouts" / "commands.txt").read_text()
    assert commands.count("--rollout-engine vllm") == 2 and "opd train" in commands


def test_a_batch_of_seeded_prompts_over_the_engines_token_budget(tmp_path):
    """128 seeded prompts at once: more prompt tokens than vLLM schedules in one step. With chunked
    prefill its CPU build died on them ("CPU Generator does not use offset": the demo's 64 prompts);
    the engine opd starts runs without it."""
    needs_vllm()  # starts engines of its own: no module server
    from opd.rollout.engine import EngineContext
    from opd.rollout.prompt_set import PromptSet, load_task
    from opd.rollout.vllm_engine import start_vllm

    tok = load_tokenizer(DEMO / "student", "student")
    cfg = TrainConfig.from_flat(student=str(DEMO / "student"), teacher=str(DEMO / "teacher"), rollout_engine="vllm")
    engine = start_vllm(
        EngineContext(load_model(DEMO / "student", "student"), tok, cfg, cfg.model.student, folder=tmp_path)
    )
    try:
        prompts = PromptSet.build(load_task("arithmetic", 2, 0).examples("train")[:128], tok, 256).prompt_ids
        batch = engine.generate(prompts, list(range(128)), max_new_tokens=48, top_p=0.9)
        gap = batch.report.policy_gap
        assert batch.response_mask_NT.sum(-1).min() >= 1 and gap is not None and gap < 1e-4
    finally:
        engine.close()
