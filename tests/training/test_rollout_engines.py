"""Adding a rollout engine is one module and one registry entry (docs/architecture.md): a stand-in engine,
written here as a user would write theirs, registered and trained with, single-turn and multi-turn; the
engine interface's bad inputs (an engine name not registered, an engine that answers too few prompts).

The stand-in answers each request with the student itself, re-encoding the whole text at every token (no
cache), drawing token t with the t-th uniform of the request's seed (opd's own sampler's draw): so its
single-turn rollouts are opd's HF engine's, token for token, which the first test checks.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SMALL, cfg_for, step_records

from opd.errors import UserError
from opd.rollout import registry
from opd.rollout.engine import Sample
from opd.rollout.sampling import prompt_uniforms, sample_next
from opd.rollout.served import Request, ServerEngine
from opd.training import loop as train_mod

AGENTIC = dict(env="toy", env_level=1, max_new_tokens=96, max_action_tokens=8, max_turns=4, eval_size=4)


class ReencodingEngine(ServerEngine):
    """The stand-in (see the module docstring). ``requests`` counts what it was asked, ``syncs`` the times
    it was given the weights (it samples the student itself: there is nothing to copy)."""

    name = "reencode"
    requests: list[Request] = []
    syncs = 0

    def sync(self) -> None:
        type(self).syncs += 1

    def complete(self, requests: list[Request]) -> list[Sample]:
        type(self).requests += requests
        return [self.one(r) for r in requests]

    @torch.no_grad()
    def one(self, r: Request) -> Sample:
        ids, out, lps = list(r.prompt), [], []
        u_T = prompt_uniforms([r.seed], r.max_tokens)[0]
        how = r.sampling
        for t in range(r.max_tokens):
            logits_1V = self.model(input_ids=torch.tensor([ids])).logits[:, -1]
            tok, lp = sample_next(logits_1V, u_T[t : t + 1], how.temperature, how.top_p, how.greedy)
            ids.append(int(tok)), out.append(int(tok)), lps.append(float(lp))
            if out[-1] == self.eos_id:
                break
        return Sample(out, lps, out[-1] == self.eos_id)


class ShortEngine(ReencodingEngine):
    """A broken engine: it drops the last request's answer."""

    name = "short"

    def complete(self, requests: list[Request]) -> list[Sample]:
        return super().complete(requests)[:-1]


def start(kind):
    return lambda ctx: kind(ctx.model, ctx.tokenizer.eos_token_id, ctx.tokenizer.pad_token_id, max_gap=1e-4)


@pytest.fixture
def registered():
    """The stand-ins registered (one line each, as a user's module would), and unregistered afterwards."""
    registry.register("reencode", start(ReencodingEngine))
    registry.register("short", start(ShortEngine))
    ReencodingEngine.requests, ReencodingEngine.syncs = [], 0
    yield
    for name in ("reencode", "short"):
        registry.ENGINES.pop(name)


def rollouts(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def test_a_registered_engine_trains_single_turn_and_samples_as_opds_own(registered, tiny_models, tmp_path):
    kw = dict(steps=2, batch_size=4, log_rollouts=4, eval_samples=0)
    train_mod.train(cfg_for(tiny_models, tmp_path / "hf", **kw), show_progress=False)
    train_mod.train(cfg_for(tiny_models, tmp_path / "standin", rollout_engine="reencode", **kw), show_progress=False)
    steps = step_records(tmp_path / "standin" / "run")
    assert [r["step"] for r in steps] == [0, 1]
    sampled = [r for r in ReencodingEngine.requests if not r.sampling.greedy]
    assert len(sampled) == 2 * 4  # every rollout of both steps came from the stand-in
    # ... and the final evaluation's greedy responses too (SMALL's eval_size prompts): it runs on the run's engine
    assert len(ReencodingEngine.requests) - len(sampled) == SMALL["eval_size"]
    # the policy check ran on each step (re-encoding and the student's forward agree to float rounding)
    assert all(r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), steps
    # synced before the first rollout and after each update (the update stage's weights_changed): before
    # step 1's rollouts and the final evaluation's; each step's sync reported with its batch
    assert ReencodingEngine.syncs == 3 and all(r["time/weight_sync"] >= 0 for r in steps), steps
    assert "rollout/engine_logprob_gap" not in step_records(tmp_path / "hf" / "run")[0]  # opd's own: nothing to check
    ours, theirs = rollouts(tmp_path / "hf" / "run"), rollouts(tmp_path / "standin" / "run")
    first = [(r["prompt"], r["response"]) for r in ours if r["step"] == 0]
    assert first and first == [(r["prompt"], r["response"]) for r in theirs if r["step"] == 0]


def test_a_registered_engine_plays_episodes(registered, tiny_models, tmp_path):
    # evaluation off: its games run on the same engine and would add their own requests to the count
    cfg = cfg_for(tiny_models, tmp_path, rollout_engine="reencode", steps=2, batch_size=4, eval=False, **AGENTIC)
    train_mod.train(cfg, show_progress=False)
    steps = step_records(tmp_path / "run")
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["rollout/turns"] >= 1 and r["rollout/engine_logprob_gap"] < 1e-4 for r in steps), steps
    episodes = [r for r in rollouts(tmp_path / "run")]
    written_turns = sum(len(e["turns"]) for e in episodes)
    assert written_turns >= 2 * 4 and len(ReencodingEngine.requests) >= written_turns  # a request per written turn
    assert len({r.seed for r in ReencodingEngine.requests}) == len(ReencodingEngine.requests)  # one seed per turn


@pytest.mark.parametrize("extra", [{}, AGENTIC], ids=["single-turn", "episodes"])
def test_an_engine_that_answers_too_few_prompts_is_named(registered, tiny_models, tmp_path, extra):
    cfg = cfg_for(tiny_models, tmp_path, rollout_engine="short", steps=1, batch_size=4, **extra)
    with pytest.raises(UserError, match=r"the rollout engine 'short' returned 3 sequences for 4 prompts"):
        train_mod.train(cfg, show_progress=False)


def test_an_engine_not_registered_lists_the_registered_ones(registered, tiny_models, tmp_path):
    with pytest.raises(
        UserError, match=r"rollout_engine='sglang' is not a registered rollout engine; choose one of hf, vllm, reencode"
    ):
        train_mod.train(cfg_for(tiny_models, tmp_path, rollout_engine="sglang"), show_progress=False)
    with pytest.raises(ValueError, match="a rollout engine named 'hf' is already registered"):
        registry.register("hf", start(ReencodingEngine))


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_one_ranks_engine_dying_checkpoints_and_stops_every_rank(tiny_models, tmp_path, fsdp):
    """torchrun, 2 ranks: rank 1's engine goes at step 2 while rank 0's lives. Every rank stops at that step,
    together (no rank left waiting at a collective), after the checkpoint of step 1; --resume goes on from it."""
    import subprocess
    from pathlib import Path

    from helpers import ENV, cli_args, launch_command

    out = tmp_path / "run"
    args = cli_args(tiny_models, out, batch_size=2, steps=4, ckpt_every=0, rollout_engine="dies", fsdp=fsdp)
    script = str(Path(__file__).with_name("engine_dies.py"))
    cmd = [*launch_command("torchrun", [])[:-2], script, *args]  # the launcher's own part, then the script
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    err = done.stderr
    assert "the rollout engine of rank 1 died (connection refused); checkpoint of step 1 written" in err, err[-3000:]
    assert "the rollout engine of another rank stayed unreachable; checkpoint of step 1 written" in err, err[-3000:]
    assert [r["step"] for r in step_records(out)] == [0, 1]
    assert (out / "checkpoints" / "step_0000001").is_dir() and not (out / "final").exists()
    resumed = subprocess.run([*cmd, "--resume"], env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # rank 1's engine answers again (a new process)
    assert [r["step"] for r in step_records(out)] == [0, 1, 2, 3] and (out / "final").is_dir()
