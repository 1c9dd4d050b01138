"""The HF engine's rollouts, token for token, against rollouts recorded before the engine interface
(:mod:`opd.rollout.engine`) existed: the episode loop written once over engine sessions and the
single-turn sampler must give what opd's own KV-cache loops gave (tests/golden/hf_rollouts.json,
recorded at commit aaff9eb).

Several episodes of several turns each: sampled turns that end at the end-of-turn token, turns cut at
``max_action_tokens``, episodes cut by their token budget, greedy episodes; and single-turn batches
whose rows end at EOS at different steps (the sampler drops finished rows from its batch). Token ids,
masks, records compared exactly; log-probs to 1e-6 (one machine's kernels; the file says which).

The static KV cache (``--static-cache on``, :mod:`opd.rollout.static_cache`) must give the same rollouts:
the same ids, masks and records, and log-probs to STATIC_LOGP_TOL. Its attention reads a longer, masked
key range (its preallocated slots) than the dynamic cache's, so float32 sums are taken in another order:
a few ulps of logits around 10 in magnitude (an ulp is 1e-6 there); 5.9e-6 was the largest difference seen.

Re-record (only when a change is meant to move the rollouts, and say why):

    python tests/rollout/test_hf_identity.py --record
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import opd
from opd.envs import get_env
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.episodes import EpisodeRollout
from opd.rollout.sampling import HFRollout

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "hf_rollouts.json"
DEMO = Path(opd.__file__).parent / "assets" / "demo"
EPISODES = {  # name: play()'s limits and sampling
    "eos": dict(max_new_tokens=360, max_action_tokens=24, temperature=1.0, top_p=0.9),
    "budget": dict(max_new_tokens=48, max_action_tokens=5, temperature=0.8, top_p=1.0),
    "greedy": dict(max_new_tokens=200, max_action_tokens=16, greedy=True),
}
SINGLE = {  # name: generate()'s options
    "top_p": dict(max_new_tokens=24, temperature=1.0, top_p=0.9),
    "temperature": dict(max_new_tokens=16, temperature=0.7, top_p=1.0),
}
PROMPTS = ["Tom has 3 apples and buys 4 more.", "What is 12 + 30?", "Compute 7 * 6.", "2 + 2 =", "Sam", "9 - 4"]
STATIC_LOGP_TOL = 2e-5


def _rows(batch) -> dict:
    """A batch as lists, each row cut to its real tokens."""
    out: dict = {"prompt_len": batch.prompt_len, "prompt": [], "response": [], "action": [], "logprobs": []}
    for n in range(batch.num_rollouts):
        attn = batch.attention_mask_NL[n, : batch.prompt_len].bool()
        L = int(batch.response_mask_NT[n].sum())
        out["prompt"].append(batch.input_ids_NL[n, : batch.prompt_len][attn].tolist())
        out["response"].append(batch.response_ids_NT[n, :L].tolist())
        out["action"].append(batch.action_mask_NT[n, :L].int().tolist())
        out["logprobs"].append(batch.logprobs_NT[n, :L].tolist())
    out["finished"] = batch.finished_N.tolist()
    out["shape"] = list(batch.response_ids_NT.shape)
    return out


def rollouts(static_cache: str = "off") -> dict:
    """Every case's rollouts, from the code under test (with ``--static-cache static_cache``)."""
    torch.set_num_threads(1)  # one thread: float sums in one order
    model, tok = load_model(DEMO / "student", "student").eval(), load_tokenizer(DEMO / "student", "student")
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache=static_cache)
    env = get_env("toy", rooms=3, max_turns=6)
    games = env.games("train")[:8]
    out: dict = {"episodes": {}, "single": {}}
    for name, how in EPISODES.items():
        eps = EpisodeRollout(engine, tok).play(env, games, [11 * i + 5 for i in range(len(games))], **how)
        out["episodes"][name] = {**_rows(eps.batch), "records": [dataclasses.asdict(r) for r in eps.records]}
    prompts = [tok(p)["input_ids"] for p in PROMPTS] * 2
    for name, how in SINGLE.items():
        out["single"][name] = _rows(engine.generate(prompts, list(range(12)), **how))
    out["static_decoders"] = len(engine.static.free)  # kept after use: 0 when the static cache never ran
    return out


def machine() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


@pytest.mark.parametrize("static_cache", ["off", "on"])
def test_hf_rollouts_equal_the_recorded_ones(static_cache):
    golden = json.loads(GOLDEN.read_text())
    if golden["machine"] != machine():
        pytest.skip(f"recorded under {golden['machine']}, this is {machine()}: re-record with --record")
    got = json.loads(json.dumps(rollouts(static_cache)))  # as the file holds them (tuples become lists)
    assert (got["static_decoders"] > 0) == (static_cache == "on")
    tol = STATIC_LOGP_TOL if static_cache == "on" else 1e-6
    for kind in ("episodes", "single"):
        for name, want in golden[kind].items():
            have = got[kind][name]
            for key in want:
                if key == "logprobs":
                    for a, b in zip(have[key], want[key], strict=True):
                        assert a == pytest.approx(b, abs=tol), (kind, name)
                else:
                    assert have[key] == want[key], (kind, name, key)


def test_the_recorded_cases_cover_every_way_a_turn_ends():
    """What makes the comparison above worth its name: several turns per episode, turns ended by EOS and
    by their cap, episodes ended by the budget, single-turn rows that end early and late."""
    golden = json.loads(GOLDEN.read_text())
    eps = golden["episodes"]
    eos_id = load_tokenizer(DEMO / "student", "student").eos_token_id
    turns = [len(r["actions"]) for case in eps.values() for r in case["records"]]
    assert max(turns) >= 3 and sum(turns) >= 40
    ended_eos = ended_cap = 0
    for case in eps.values():
        for resp, rec in zip(case["response"], case["records"], strict=True):
            for s, e in rec["spans"]:
                ended_eos += e > s and resp[e - 1] == eos_id
                ended_cap += e > s and resp[e - 1] != eos_id
    assert ended_eos >= 5 and ended_cap >= 5
    assert any(r["end"] == "budget" for r in eps["budget"]["records"])
    lens = [len(r) for r in golden["single"]["top_p"]["response"]]
    assert min(lens) < max(lens) == golden["single"]["top_p"]["shape"][1]


if __name__ == "__main__" and "--record" in sys.argv:
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cases = {k: v for k, v in rollouts().items() if k != "static_decoders"}
    GOLDEN.write_text(json.dumps({"machine": machine(), "commit": commit, **cases}) + "\n")
    print(f"wrote {GOLDEN}")
