"""Agentic OPD through the trainer (``opd train --env``): what trains, evaluation, resume, 2 ranks.

The episode engine's own guarantees (masks against the rendered chat text, KV cache vs
re-encoding, batch invariance) are in rollout/test_episodes.py; these tests check the loop around it.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import (
    assert_close_weights,
    cli_args,
    final_weights,
    first_rollout,
    launch,
    read_metrics,
    run_options,
    step_records,
    train_killed_at,
)
from typer.testing import CliRunner

from opd.cli import app
from opd.config import TrainConfig
from opd.envs import Game, StepResult, register_env
from opd.envs.workers import EnvWorkers
from opd.errors import UserError
from opd.evaluation.game_eval import evaluate_agent, write_eval_games
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.episodes import EpisodeRecord
from opd.rollout.game_set import GameSet, make_env, parse_env_args
from opd.training import loop as train_mod
from opd.training.cloning import dagger_sequences, expert_sequences, mistake_command

AGENTIC = dict(
    env="toy",
    env_level=1,
    max_new_tokens=96,
    max_action_tokens=8,
    max_turns=4,
    steps=3,
    eval_size=4,
    eval_samples=2,
    log_rollouts=4,
)


def agentic_cfg(models, out, **kw) -> TrainConfig:
    student, teacher = models
    base = dict(
        student=str(student),
        teacher=str(teacher),
        out=str(out),
        device="cpu",
        batch_size=4,
        k=8,
        warmup_steps=1,
        diag_positions=16,
        eval_every=0,
        ckpt_every=1,
        lr=3e-3,
    )
    return TrainConfig.from_flat(**{**base, **AGENTIC, **kw})


def test_cli_agentic_run_trains_the_students_action_tokens_only(tiny_models, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, cli_args(tiny_models, out, batch_size=4, **AGENTIC))
    assert result.exit_code == 0, result.output + repr(result.exception)
    steps = step_records(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 3 * 4  # every rollout of every step
    for r in steps:
        mine = [x for x in rollouts if x["step"] == r["step"]]
        # The records hold whole episodes, the model's own tokens flagged ``action``; the loss skips
        # only its end-of-turn tokens (lsm masks special tokens), so the loss tokens are the action
        # tokens less the EOS ones.
        own = [[t for t, a in zip(x["tokens"], x["action"]) if a] for x in mine]
        eos = sum(t == "<|im_end|>" for tokens in own for t in tokens)
        actions = sum(len(tokens) for tokens in own)
        assert r["train/loss_tokens"] == actions - eos
        assert all(not m for x in mine for t, m in zip(x["tokens"], x["loss_mask"]) if t == "<|im_end|>")
        assert r["rollout/response_len"] == pytest.approx(actions / 4)
        assert 1 <= r["rollout/turns"] <= AGENTIC["max_turns"]
        assert r["rollout/accuracy"] == sum(x["correct"] for x in mine) / 4
        assert r["rollout/env_error_rate"] == 0.0
        # an observation is never among the trained tokens: its words do not appear in the actions
        assert not any("You are in the" in "".join(tokens).replace("Ġ", " ") for tokens in own)
    evals = [r for r in read_metrics(out) if "eval/success_rate" in r]
    assert len(evals) == 1 and evals[0]["eval/n"] == 4 and evals[0]["eval/k"] == 2
    assert evals[0]["eval/accuracy"] == evals[0]["eval/success_rate"]
    games = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [g["game"] for g in games] == [f"toy-test-{i}" for i in range(4)]
    assert all(g["goal"].startswith("open the ") for g in games)
    assert run_options(out)["env"] == "toy"


@pytest.mark.parametrize("S", [0, 1])
def test_agentic_resume_equals_uninterrupted(tiny_models, tmp_path, monkeypatch, S):
    """Also with episodes played one step ahead in the rollout worker (--max-staleness 1)."""
    train_mod.train(agentic_cfg(tiny_models, tmp_path / "a", eval_samples=0, max_staleness=S), show_progress=False)
    expected = step_records(tmp_path / "a")
    killed = agentic_cfg(tiny_models, tmp_path / "b", eval_samples=0, max_staleness=S)
    train_killed_at(killed, 2, monkeypatch)
    train_mod.train(killed.replace(resume=True), show_progress=False)
    got = step_records(tmp_path / "b")
    assert [r["step"] for r in got] == [0, 1, 2]
    for e, g in zip(expected, got, strict=True):
        for key in e:
            if not key.startswith("time/"):
                assert g[key] == pytest.approx(e[key], rel=1e-6, abs=1e-9), (e["step"], key)


def test_agentic_resume_with_env_workers_equals_uninterrupted_in_process(tiny_models, tmp_path, monkeypatch):
    """Games in 2 worker processes, killed and resumed: the same steps as one uninterrupted run
    that plays its games in this process (evaluation included: it plays through the workers)."""
    train_mod.train(agentic_cfg(tiny_models, tmp_path / "a", env_workers=0), show_progress=False)
    expected = step_records(tmp_path / "a")
    killed = agentic_cfg(tiny_models, tmp_path / "b", env_workers=2)
    batches = []
    real_batch = EnvWorkers.batch
    monkeypatch.setattr(EnvWorkers, "batch", lambda pool: batches.append(len(pool.workers)) or real_batch(pool))
    train_killed_at(killed, 2, monkeypatch)
    train_mod.train(killed.replace(resume=True), show_progress=False)
    assert len(batches) >= 3 and set(batches) == {2}  # the steps' and evaluation's episodes went to 2 workers
    got = read_metrics(tmp_path / "b")
    assert [r["step"] for r in step_records(tmp_path / "b")] == [0, 1, 2]
    for e, g in zip(read_metrics(tmp_path / "a"), got, strict=True):
        assert set(e) == set(g)
        for key in e:
            if not key.startswith("time/"):
                assert g[key] == pytest.approx(e[key], rel=1e-6, abs=1e-9), (e.get("step"), key)
    assert expected[-1]["rollout/env_error_rate"] == 0.0


@pytest.mark.slow
def test_agentic_two_ranks_match_one_process(tiny_models, tmp_path):
    """Two ranks, each with its games in a worker process, train as one process that plays them itself."""
    train_mod.train(agentic_cfg(tiny_models, tmp_path / "one", eval_samples=0, env_workers=0), show_progress=False)
    two = {**AGENTIC, "batch_size": 2, "eval_samples": 0, "env_workers": 1}
    launch("torchrun", cli_args(tiny_models, tmp_path / "two", **two))
    want, got = step_records(tmp_path / "one"), step_records(tmp_path / "two")
    assert [r["step"] for r in got] == [0, 1, 2]
    for w, g in zip(want, got, strict=True):
        for key in ("train/loss", "train/grad_norm", "rollout/turns", "rollout/response_len", "train/loss_tokens"):
            assert g[key] == pytest.approx(w[key], rel=1e-4), (w["step"], key)
    assert_close_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))


# ----------------------------------------------------------------------------- evaluation


class _WinsOnTurn:
    """Every episode is won by its ``n``-th action, whatever it says (or never, for n = 0)."""

    name, system_prompt, max_turns = "wins-on-turn", "Say anything.", 5

    def __init__(self, level: int = 1, n: int = 2, games: int = 3):
        self.n, self.count = n, games

    def games(self, split):
        return [Game(id=f"{split}-{i}", goal="say something") for i in range(self.count)]

    def open(self, game):
        env = self

        class Session:
            def reset(self):
                self.t = 0
                return "Say something."

            def step(self, action):
                self.t += 1
                won = self.t == env.n
                return StepResult("You win." if won else "Go on.", float(won), won, won)

            def admissible_commands(self):
                return None

            def expert_actions(self):
                return None

            def close(self):
                pass

        return Session()


register_env("wins-on-turn", _WinsOnTurn)


@pytest.fixture(scope="module")
def student(tiny_models):
    return load_model(tiny_models[0], device="cpu"), load_tokenizer(tiny_models[0])


@pytest.mark.parametrize("n, success, turns", [(2, 1.0, 2.0), (0, 0.0, None)])
def test_evaluate_agent_counts_wins_and_turns(student, n, success, turns):
    model, tok = student
    games = GameSet.build(make_env("wins-on-turn", 1, [f"n={n}"]), "test")
    res = evaluate_agent(model, tok, games, max_new_tokens=64, max_action_tokens=4, samples=2, top_p=0.9)
    assert res["n"] == 3 and res["success_rate"] == success and res["accuracy"] == success
    assert res["avg_at_k"] == success and res["pass_at_k"] == success and res["k"] == 2
    assert res.get("mean_turns_to_success") == turns  # left out when no game was won
    assert "invalid_action_rate" not in res and res["env_errors"] == 0  # the game lists no commands


def test_evaluate_agent_invalid_action_rate_on_the_toy_game(student):
    model, tok = student
    games = GameSet.build(make_env("toy", 1, ["n_test=2", "max_turns=3"]), "test")
    res = evaluate_agent(model, tok, games, max_new_tokens=64, max_action_tokens=4)
    # A random one-layer model writes no valid command of the toy game.
    assert res["success_rate"] == 0.0 and res["invalid_action_rate"] == 1.0


# ----------------------------------------------------------------------------- bad input and files


def test_environment_mistakes_are_clear(tiny_models, tmp_path):
    with pytest.raises(UserError, match="unknown environment 'nope'"):
        make_env("nope", 1, [])
    with pytest.raises(UserError, match="not KEY=VALUE"):
        parse_env_args(["rooms"])
    with pytest.raises(UserError, match="does not accept these arguments"):
        make_env("toy", 1, ["colours=3"])
    with pytest.raises(UserError, match="has no test games"):
        GameSet.build(make_env("toy", 1, ["n_test=0"]), "test")
    assert parse_env_args(["n_train=8,name=x", "flag=true"]) == {"n_train": 8, "name": "x", "flag": True}
    with pytest.raises(UserError, match="unknown environment"):
        train_mod.setup(agentic_cfg(tiny_models, tmp_path / "run", env="nope"))


def test_write_eval_games_copies_each_games_folder(tmp_path):
    for name, files in (("g1", ["game.tw-pddl", "traj_data.json"]), ("g2", ["game.z8", "game.json"])):
        (tmp_path / "games" / name).mkdir(parents=True)
        for f in files:
            (tmp_path / "games" / name / f).write_text("{}")
    games = GameSet(
        _WinsOnTurn(),
        [
            Game("g1", "a", str(tmp_path / "games" / "g1" / "game.tw-pddl")),
            Game("test/g2", "b", str(tmp_path / "games" / "g2")),
            Game("g3", "c"),
        ],
        [],
    )
    run = tmp_path / "run"
    lines = write_eval_games(run, games)
    assert lines == [
        {"game": "g1", "path": "eval_games/g1/game.tw-pddl", "goal": "a"},
        {"game": "test/g2", "path": "eval_games/test_g2", "goal": "b"},
        {"game": "g3", "path": None, "goal": "c"},
    ]
    assert sorted(p.name for p in (run / "eval_games" / "g1").iterdir()) == ["game.tw-pddl", "traj_data.json"]
    assert sorted(p.name for p in (run / "eval_games" / "test_g2").iterdir()) == ["game.json", "game.z8"]


def test_single_turn_rollout_stage_has_no_episode_records(tiny_models, tmp_path):
    run = train_mod.setup(agentic_cfg(tiny_models, tmp_path / "run", env="", max_new_tokens=8))
    batch, rows, records = first_rollout(run)
    assert records is None and len(rows) == 4 and torch.equal(batch.action_mask_NT, batch.response_mask_NT)


def test_cli_eval_plays_the_environments_held_out_games(tiny_models, tmp_path):
    args = ["eval", "--student", str(tiny_models[0]), "--env", "wins-on-turn", "--env-args", "n=1,games=5"]
    args += ["--samples", "0", "--max-new-tokens", "32", "--max-action-tokens", "4", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    res = json.loads((tmp_path / "eval.json").read_text())
    assert res["n"] == 5 and res["success_rate"] == 1.0 and res["mean_turns_to_success"] == 1.0


def test_an_episode_whose_prompt_is_too_long_ends_counted_and_the_context_is_checked_first(student):
    from opd.rollout.game_set import check_episode_context

    model, tok = student
    games = GameSet.build(make_env("wins-on-turn", 1, ["n=1"]), "test")
    limits = dict(max_new_tokens=32, max_action_tokens=4)
    assert evaluate_agent(model, tok, games, max_prompt_tokens=200, **limits)["success_rate"] == 1.0
    short = evaluate_agent(model, tok, games, max_prompt_tokens=5, **limits)
    assert short["success_rate"] == 0.0 and short["env_errors"] == 3
    check_episode_context(model, 400, 112)  # 512 positions: fits exactly
    with pytest.raises(UserError, match="exceed the model's context of 512 positions"):
        check_episode_context(model, 400, 113)


# ------------------------------------------------------------------- expert episodes with mistakes


class _Recorder:
    """A toy session that records each command played, whether the game listed it, and the reply."""

    def __init__(self, session, log: list):
        self.session, self.log = session, log

    def step(self, action):
        listed = action in self.session.admissible_commands()
        result = self.session.step(action)
        self.log.append((action, listed, result.observation))
        return result

    def __getattr__(self, name):
        return getattr(self.session, name)


def _recorded_toy(log: list):
    env = make_env("toy", 2, ["n_train=12", "max_turns=40"])
    opened = env.open
    env.open = lambda game: _Recorder(opened(game), log)
    return env


def test_expert_episodes_with_mistakes_train_only_the_experts_commands(student):
    _, tok = student
    clean_log, noisy_log = [], []
    clean_env, noisy_env = _recorded_toy(clean_log), _recorded_toy(noisy_log)
    games = clean_env.games("train")
    clean = expert_sequences(clean_env, games, tok, 100_000)
    noisy = expert_sequences(noisy_env, games, tok, 100_000, mistakes=0.5, seed=3)
    assert clean[2] == noisy[2] == 0 and len(noisy[0]) == len(games)
    # The expert's commands are played in the same order; every other command is one the game did not list
    # and answered "Nothing happens." (so the state, and the expert's next command, stay right).
    extra = [(a, listed, obs) for a, listed, obs in noisy_log if (a, listed, obs) not in clean_log]
    assert extra and all(not listed and obs == "Nothing happens." for _, listed, obs in extra)
    assert [x for x in noisy_log if x not in extra] == clean_log
    assert len(extra) > len(clean_log) // 5  # about half the expert's commands get a mistake before them
    # What is trained: exactly the expert's command tokens, as without mistakes; the mistakes are context.
    for ids_c, lab_c, ids_n, lab_n in zip(*clean[:2], *noisy[:2], strict=True):
        assert [t for t in lab_n if t != -100] == [t for t in lab_c if t != -100]
        assert ids_n == ids_c or len(ids_n) > len(ids_c)  # the same, or longer by its mistakes
    again = expert_sequences(_recorded_toy([]), games, tok, 100_000, mistakes=0.5, seed=3)
    other = expert_sequences(_recorded_toy([]), games, tok, 100_000, mistakes=0.5, seed=4)
    assert again[0] == noisy[0] and other[0] != noisy[0]  # seeded per (seed, game)
    assert expert_sequences(_recorded_toy([]), games, tok, 100_000, mistakes=0.0, seed=3)[0] == clean[0]


def test_mistake_command_is_a_rejected_variant_of_a_listed_command():
    rng = random.Random(0)
    listed = ["go to shelf 1", "take apple 1 from shelf 1", "look", "inventory"]
    seen = set()
    for _ in range(200):
        wrong = mistake_command(listed, "take apple 1 from shelf 1", rng)
        assert wrong is not None and wrong not in listed
        words = wrong.split()
        # One verb, name or number replaced by another of the listed commands': "take shelf 1 from shelf 1",
        # "go to apple 1", "take apple 1 from apple 1"; never a word in a preposition's place.
        assert words[0] in ("go", "take") and len(words) in (4, 6) and set(words) <= {*" ".join(listed).split()}
        seen.add(wrong)
    assert len(seen) >= 4
    assert mistake_command(None, "go to shelf 1", rng) is None  # the game does not say what it accepts
    assert mistake_command(["look"], "look", rng) is None  # nothing to get wrong


def test_expert_mistakes_option_is_checked():
    from opd.config import ConfigError, SFTConfig

    with pytest.raises(ConfigError, match=r"expert_mistakes=1.0 must be in \[0, 1\)"):
        SFTConfig.from_flat(arch="qwen2:1:8", env="toy", expert_mistakes=1.0)
    with pytest.raises(ConfigError, match="expert_mistakes needs --env"):
        SFTConfig.from_flat(arch="qwen2:1:8", expert_mistakes=0.25)
    assert SFTConfig.from_flat(arch="qwen2:1:8", env="toy", expert_mistakes=0.25).env.expert_mistakes == 0.25


# ------------------------------------------------------------------- DAgger: another player's states


def _played(env, game, commands: list[str]) -> EpisodeRecord:
    """The record of an episode in which ``commands`` were played (what a rollout would log)."""
    session = env.open(game)
    record = EpisodeRecord(game_id=game.id, seed=0, observations=[session.reset()])
    for command in commands:
        result = session.step(command)
        record.actions.append(command)
        record.observations.append(result.observation)
        if result.done:
            break
    return record


def _trained_commands(tok, labels: list[int], ids: list[int]) -> list[str]:
    """The texts of the labelled runs of a sequence (its trained commands), without their EOS."""
    runs, run = [], []
    for i, label in zip(ids, labels, strict=True):
        if label != -100:
            run.append(i)
            if i == tok.eos_token_id:
                runs.append(tok.decode(run[:-1]).strip())
                run = []
    assert not run  # every trained command ends with its EOS
    return runs


def test_dagger_sequences_train_the_experts_command_in_the_players_states(student):
    _, tok = student
    env = make_env("toy", 3, ["n_train=6", "max_turns=30"])
    played, expected = [], []
    for n, game in enumerate(env.games("train")):
        rng = random.Random(n)
        session = env.open(game)
        session.reset()
        commands, turns = [], []  # turns: (the expert's command there, did the player play it)
        for _ in range(8):
            expert = session.expert_next()
            if expert is None:
                break
            command = expert if rng.random() < 0.5 else rng.choice(["dance", *session.admissible_commands()])
            turns.append((expert, command == expert))
            commands.append(command)
            if session.step(command).done:
                break
        played.append((game, _played(env, game, commands)))
        expected.append(turns)
    seqs, labels, skipped = dagger_sequences(env, played, tok, 100_000, branches=2, seed=1)
    # Each sequence: the player's commands up to a turn where it left the expert's path, those the
    # expert agrees with trained on, then the expert's command there, trained on.
    allowed = []
    for turns in expected:
        for t, (expert, agrees) in enumerate(turns):
            if not agrees:
                allowed.append([e for e, ok in turns[:t] if ok] + [expert])
    got = [_trained_commands(tok, lab, ids) for ids, lab in zip(seqs, labels, strict=True)]
    assert got and all(g in allowed for g in got)
    per_episode = [min(2, sum(not ok for _, ok in turns)) for turns in expected]
    assert len(seqs) == sum(per_episode) and skipped == per_episode.count(0)
    again = dagger_sequences(env, played, tok, 100_000, branches=2, seed=1)
    assert again[0] == seqs  # seeded
    assert len(dagger_sequences(env, played, tok, 100_000, branches=1, seed=1)[0]) == sum(
        min(1, k) for k in per_episode
    )


def test_dagger_needs_an_expert_that_takes_over(student):
    _, tok = student
    env = make_env("toy", 1, ["n_train=1"])
    game = env.games("train")[0]
    record = _played(env, game, ["dance"])
    opened = env.open
    env.open = lambda g: _NoNext(opened(g))
    with pytest.raises(
        UserError, match=r"--dagger-from needs an environment whose sessions have expert_next\(\) \(_NoNext has none\)"
    ):
        dagger_sequences(env, [(game, record)], tok, 100_000)
    # opd sft asks before any model plays: the player here does not even exist.
    from opd.config import SFTConfig
    from opd.training.sft import dagger_data

    cfg = SFTConfig.from_flat(arch="qwen2:1:8", env="toy", dagger_from=["/no/such/player"])
    with pytest.raises(UserError, match=r"sessions have expert_next\(\) \(_NoNext has none\)"):
        dagger_data(cfg, env, [game], tok, "/no/such/player", "cpu")


class _NoNext:
    """A session without expert_next() (the protocol's optional method)."""

    def __init__(self, session):
        self._s = session

    def reset(self):
        return self._s.reset()

    def step(self, action):
        return self._s.step(action)

    def close(self):
        pass


def test_dagger_options_are_checked():
    from opd.config import ConfigError, SFTConfig

    with pytest.raises(ConfigError, match="dagger_from needs --env"):
        SFTConfig.from_flat(arch="qwen2:1:8", dagger_from=["m"])
    with pytest.raises(ConfigError, match="dagger_branches=0 must be >= 1"):
        SFTConfig.from_flat(arch="qwen2:1:8", env="toy", dagger_from=["m"], dagger_branches=0)
