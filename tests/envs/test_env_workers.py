"""Games in worker processes (``--env-workers``, :mod:`opd.envs.workers`): the same episodes with
0, 1 and 2 workers, a worker killed mid-episode, a game that hangs, and bad settings.

The environments are toy games that fail on purpose inside the worker (an ``EnvError``, the
worker's own ``os.kill``, a step that never returns), in ``failing_games.py``: a module a worker
process imports quickly. The reference is always the same batch played in this process.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time
import types

import pytest
import torch
from failing_games import FailingToy, NoEngine
from typer.testing import CliRunner

import opd
from opd.cli import app
from opd.config import TrainConfig
from opd.config.fields import ConfigError
from opd.envs import EnvError, get_env
from opd.envs.toy import ToyEnv, ToySession
from opd.envs.workers import AUTO_WORKERS, EnvWorkers, InProcess, sessions
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.episodes import EpisodeRollout
from opd.rollout.game_set import CPU_SHARE_ENV, auto_workers, episode_metrics, in_workers, make_env

DEMO = pathlib.Path(opd.__file__).parent / "assets" / "demo"
PLAY = dict(max_new_tokens=360, max_action_tokens=24, temperature=1.0, top_p=1.0)
N_GAMES = 6


@pytest.fixture(scope="module")
def student():
    return load_model(DEMO / "student", "student").eval(), load_tokenizer(DEMO / "student", "student")


@pytest.fixture(scope="module")
def reference(student):
    """The six episodes played in this process, with games 1 and 3 failing by EnvError."""
    env = FailingToy({"toy-train-1": (2, "error")}, rooms=3, max_turns=6)
    return env, EpisodeRollout(*student).play(env, env.games("train")[:N_GAMES], list(range(N_GAMES)), **PLAY)


def same_episode(got, want, n: int, same_batch: bool = True) -> None:
    """Episode n played alike: its record and tokens; its log-probs bit for bit when the batch ran
    the same forwards (else other rows left the batch at other times: float rounding only)."""
    assert dataclasses.asdict(got.records[n]) == dataclasses.asdict(want.records[n])
    L = int(want.batch.response_mask_NT[n].sum())
    assert torch.equal(got.batch.response_ids_NT[n, :L], want.batch.response_ids_NT[n, :L])
    assert torch.equal(got.batch.action_mask_NT[n, :L], want.batch.action_mask_NT[n, :L])
    if same_batch:
        assert torch.equal(got.batch.logprobs_NT[n, :L], want.batch.logprobs_NT[n, :L])
    else:
        torch.testing.assert_close(got.batch.logprobs_NT[n, :L], want.batch.logprobs_NT[n, :L], rtol=1e-4, atol=1e-5)
    assert not got.batch.response_mask_NT[n, L:].any()


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_play_the_same_episodes_as_this_process(student, reference, workers):
    env, want = reference
    assert want.records[1].end == "error" and want.records[1].turns == 2, "the test needs game 1 to crash"
    with EnvWorkers(env, workers) as pool:
        assert pool.name == env.name and pool.max_turns == env.max_turns
        got = EpisodeRollout(*student).play(pool, env.games("train")[:N_GAMES], list(range(N_GAMES)), **PLAY)
    assert torch.equal(got.batch.input_ids_NL, want.batch.input_ids_NL)
    assert torch.equal(got.batch.attention_mask_NL, want.batch.attention_mask_NL)
    for n in range(N_GAMES):
        same_episode(got, want, n)
    assert got.records[1].error == "engine crashed"  # an EnvError raised in a worker comes back as itself


def test_a_killed_worker_ends_its_episodes_as_errors_and_is_replaced(student, reference):
    env, want = reference
    games = env.games("train")[:N_GAMES]
    killer = FailingToy({"toy-train-1": (2, "error"), "toy-train-3": (2, "kill")}, rooms=3, max_turns=6)
    engine = EpisodeRollout(*student)
    with EnvWorkers(killer, 2) as pool:
        before = [w.pid for w in pool.workers]
        got = engine.play(pool, games, list(range(N_GAMES)), **PLAY)
        # worker 1 held episodes 1, 3 and 5: all end as errors, counted; worker 0's play on
        for n in (0, 2, 4):
            same_episode(got, want, n, same_batch=False)
        for n in (1, 3, 5):
            assert got.records[n].end == "error", n
        assert got.records[3].turns == 2 and "died" in got.records[3].error
        assert "died" in got.records[5].error
        assert episode_metrics(got.records)["rollout/env_error_rate"] == pytest.approx(3 / 6)
        # the next batch has a new worker 1 and plays as this process does
        again = engine.play(pool, [games[n] for n in (0, 2, 4, 5)], [0, 2, 4, 5], **PLAY)
        assert pool.workers[0].pid == before[0] and pool.workers[1].pid != before[1]
    for j, n in enumerate((0, 2, 4, 5)):
        assert dataclasses.asdict(again.records[j]) == dataclasses.asdict(want.records[n])


def test_a_hung_game_ends_as_an_error_after_the_step_timeout(student, reference):
    env, want = reference
    games = env.games("train")[:N_GAMES]
    hangs = FailingToy({"toy-train-1": (2, "error"), "toy-train-2": (3, "hang")}, rooms=3, max_turns=6)
    with EnvWorkers(hangs, 2, step_timeout=1.0) as pool:
        t = time.monotonic()
        got = EpisodeRollout(*student).play(pool, games, list(range(N_GAMES)), **PLAY)
        assert time.monotonic() - t < 30
        hung = got.records[2]
        assert hung.end == "error" and hung.turns == 3 and "env_step_timeout=1 s" in hung.error
        for n in (0, 4):  # the same worker: stopped with it, counted
            assert got.records[n].end == "error", n
        for n in (1, 3, 5):  # the other worker
            same_episode(got, want, n, same_batch=False)
        again = EpisodeRollout(*student).play(pool, games[:1], [0], **PLAY)
    assert dataclasses.asdict(again.records[0]) == dataclasses.asdict(want.records[0])


# Asked of a worker: eval is a builtin, so unpickling it there imports nothing.
HEAVY_IMPORTS = "sorted(m for m in ('torch', 'transformers') if m in __import__('sys').modules)"
# The `opd` console script as pip writes it: its first import is the CLI's, torch with it.
OPD_SCRIPT = """\
import re
import sys
from opd.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


def fake_main(monkeypatch, path: pathlib.Path, source: str) -> types.ModuleType:
    """This process's ``__main__`` as if ``python path`` had run it (its guarded lines aside)."""
    path.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    exec(compile(source.split("if __name__")[0], str(path), "exec"), vars(main))
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def test_workers_start_without_torch_under_the_opd_script(tmp_path, monkeypatch):
    """Under ``opd train --env-workers N`` a spawned worker would re-run the ``opd`` script, whose
    first line imports the CLI and torch (~250 MB and seconds a worker): it must not."""
    main = fake_main(monkeypatch, tmp_path / "opd", OPD_SCRIPT)
    env = ToyEnv(rooms=3)
    game = env.games("train")[0]
    with EnvWorkers(env, 1) as pool:
        assert sys.modules["__main__"] is main  # put back once the worker started
        assert pool.workers[0].submit(eval, HEAVY_IMPORTS).result(timeout=60) == []
        batch = pool.batch()
        batch.open(0, game)
        assert batch.results() == {0: env.open(game).reset()}
        batch.close()
    assert "torch" in sys.modules  # this process, as the trainer, has it


def test_an_environment_class_in_the_main_script_still_reaches_the_workers(tmp_path, monkeypatch):
    """A script that defines its environment class itself: the workers re-run it to unpickle it."""
    source = "from opd.envs.toy import ToyEnv\n\n\nclass ScriptToy(ToyEnv):\n    name = 'script-toy'\n"
    main = fake_main(monkeypatch, tmp_path / "train_script.py", source)
    env = main.ScriptToy(rooms=4)
    assert type(env).__module__ == "__main__"
    game = env.games("train")[2]
    with EnvWorkers(env, 1) as pool:
        assert sys.modules["__main__"] is main
        batch = pool.batch()
        batch.open(0, game)
        assert batch.results() == {0: env.open(game).reset()}
        batch.close()


def test_in_process_sessions_are_what_the_engine_always_did():
    env = FailingToy({"toy-train-0": (1, "error")}, rooms=3, max_turns=6)
    games = env.games("train")[:2]
    local = sessions(env)
    assert isinstance(local, InProcess)
    local.open(0, games[0])
    local.open(1, games[1])
    firsts = local.results()
    assert firsts[1] == env.open(games[1]).reset()
    local.step(0, "look")
    local.step(1, "look")
    answers = local.results()
    assert isinstance(answers[0], EnvError) and answers[1][1].observation.startswith("You are in the")
    assert local.results() == {}
    local.close()


def test_bad_env_workers_settings_are_clear_errors(tmp_path):
    for bad in (-1, 257):
        with pytest.raises(ConfigError, match=f"env_workers={bad}: use 0 .* to 256"):
            TrainConfig.from_flat(env="toy", env_workers=bad)
    with pytest.raises(ConfigError, match="env_step_timeout=-1.0 must be >= 0"):
        TrainConfig.from_flat(env="toy", env_step_timeout=-1.0)
    assert TrainConfig.from_flat(env="toy", env_workers=0).env.env_workers == 0
    result = CliRunner().invoke(app, ["train", "--env", "toy", "--env-workers", "-3", "--out", str(tmp_path)])
    assert isinstance(result.exception, ConfigError) and "env_workers=-3: use 0" in str(result.exception)
    with pytest.raises(UserError, match="use 1 to 256"):
        EnvWorkers(ToyEnv(), 0)


def test_an_environment_that_cannot_go_to_a_worker_is_refused_or_kept_here():
    env = ToyEnv()
    env.open = lambda game: ToySession(0)  # a lambda does not pickle
    with pytest.raises(UserError, match="cannot be sent to worker processes.*--env-workers 0"):
        EnvWorkers(env, 1)
    assert in_workers(env, 2, required=False) is env  # unset --env-workers: the games stay in this process
    with pytest.raises(
        UserError, match="env worker 0 could not start .*opd_engine_that_is_not_installed.*--env-workers 0"
    ):
        EnvWorkers(NoEngine(), 1)
    assert isinstance(in_workers(make_env("toy", 1, []), 0), ToyEnv)


def test_unset_env_workers_use_the_cores_the_trainer_leaves_free(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(CPU_SHARE_ENV, raising=False)
    assert auto_workers(torch.device("cpu")) == 12  # the model's 4 threads keep their cores
    assert auto_workers(torch.device("cuda")) == 15  # the trainer drives the GPU from one core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert auto_workers(torch.device("cuda")) == 1  # 2 cores a rank
    assert auto_workers(torch.device("cpu")) == 0  # the model's threads already hold them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert auto_workers(torch.device("cuda")) == AUTO_WORKERS
    # one of several runs side by side: only its share of the cores counts
    monkeypatch.setenv(CPU_SHARE_ENV, "4")
    assert auto_workers(torch.device("cpu")) == 0 and auto_workers(torch.device("cuda")) == 3
    monkeypatch.setenv(CPU_SHARE_ENV, "")  # unset: the whole machine again
    assert auto_workers(torch.device("cuda")) == AUTO_WORKERS


def test_side_by_side_runs_count_only_their_share_of_the_cores(monkeypatch):
    from opd.lab.demos.parallel import with_threads

    monkeypatch.delenv(CPU_SHARE_ENV, raising=False)
    threads = torch.get_num_threads()
    try:
        assert with_threads(1, lambda: (os.environ[CPU_SHARE_ENV], torch.get_num_threads())) == ("1", 1)
    finally:
        torch.set_num_threads(threads)
        os.environ.pop(CPU_SHARE_ENV, None)


def test_alfworld_games_answer_alike_in_a_worker(tmp_path):
    """ALFWorld's environment goes to a worker (it pickles without its lock), and the worker's
    sessions answer the batch's opens and steps as this process's do, rejected commands included."""
    env = get_env("alfworld", level=1, num_train=3, games_dir=tmp_path, generated=True)
    games = env.games("train")
    commands = ["look", "go to nowhere 7", "inventory", "examine sidetable 1"]

    def transcript(where) -> list:
        batch, out = sessions(where), []
        for i, game in enumerate(games):
            batch.open(i, game)
        batch.send()
        out.append(batch.results())
        for command in commands:
            for i in range(len(games)):
                batch.step(i, command)
            batch.send()
            out.append(batch.results())
        batch.close()
        return out

    want = transcript(env)
    with EnvWorkers(env, 2) as pool:
        assert transcript(pool) == want
    assert len(want[0]) == 3 and all(isinstance(a, str) and "Your task is to" in a for a in want[0].values())
