"""The one evaluation (opd.evaluation.core): seeds, token-budget batches, figures, sampling and records,
first over items whose outcome is a known function of the seed, then with the demo student through opd's
engines (its loop with and without the static cache) and ``opd eval``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import opd
from opd.config import ConfigError, EvalConfig
from opd.errors import UserError
from opd.evaluation.core import (
    GREEDY,
    EvalPlan,
    EvalSampling,
    Rollout,
    clip_text,
    eval_seed,
    evaluate,
    resolve_sampling,
)
from opd.evaluation.estimators import maj_at_k
from opd.evaluation.model_eval import PromptItems, run_eval
from opd.evaluation.records import read_records
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.engine import Sampling
from opd.rollout.prompt_set import PromptSet, eval_prompts, load_task
from opd.rollout.sampling import HFRollout

DEMO = Path(opd.__file__).parent / "assets" / "demo"


class SeedItems:
    """Items whose rollout is a function of its seed: correct when the seed is divisible by 3, the answer
    the seed modulo 4, ``seed % 7`` tokens, truncated when that is 6. Records what each call asked for."""

    answers = True

    def __init__(self, n: int, tokens: int = 10):
        self.n, self.tokens, self.calls = n, tokens, []

    def __len__(self):
        return self.n

    def tokens_per_rollout(self):
        return self.tokens

    def run(self, engine, items, seeds, sampling):
        self.calls.append((list(items), list(seeds), sampling))
        return [
            Rollout(s % 3 == 0, s % 7, s % 7 == 6, {"prompt": f"p{i}", "response": "x" * (s % 50)}, str(s % 4))
            for i, s in zip(items, seeds)
        ]

    def figures(self, headline):
        return {"headline_correct": sum(r.correct for r in headline)}


def test_every_rollout_has_its_items_seed_and_batches_follow_the_token_budget():
    items = SeedItems(7, tokens=30)
    plan = EvalPlan(samples=2, batch_tokens=100, seed=5)  # 100 // 30: three rollouts a batch
    evaluate(None, items, plan)
    asked = [(i, s) for its, seeds, _ in items.calls for i, s in zip(its, seeds)]
    want = {(i, eval_seed(5, i, p)) for i in range(7) for p in (GREEDY, 0, 1)}
    assert sorted(asked) == sorted(want) and len(asked) == 21
    assert max(len(its) for its, _, _ in items.calls) == 3
    assert all(c[2].greedy == (c[1][0] == eval_seed(5, c[0][0], GREEDY)) for c in items.calls)
    assert eval_seed(5, 2, 1) == 5 * 7919 + 2 * 131 + 1  # the formula the figures in results/ were made with


def test_max_batch_caps_a_generous_budget_and_one_rollout_always_runs():
    items = SeedItems(10, tokens=1)
    evaluate(None, items, EvalPlan(max_batch=4))
    assert [len(c[0]) for c in items.calls] == [4, 4, 2]
    small = SeedItems(3, tokens=1000)
    evaluate(None, small, EvalPlan(batch_tokens=10))  # a budget below one rollout still runs them, one by one
    assert [len(c[0]) for c in small.calls] == [1, 1, 1]


def _reference_figures(n, samples, seed, greedy, maj_k):
    """The figures written out from the items' rule, with explicit loops."""
    rows = []
    for i in range(n):
        passes = ([GREEDY] if greedy else []) + list(range(samples))
        rows.append([eval_seed(seed, i, p) for p in passes])
    sampled = [row[1:] if greedy else row for row in rows]
    if greedy:
        acc = sum(row[0] % 3 == 0 for row in rows) / n
    else:
        acc = sum(sum(s % 3 == 0 for s in row) / len(row) for row in sampled) / n
    every = [s for row in rows for s in row]
    maj = 0.0
    for row in sampled:
        counts = {}
        for s in row[:maj_k]:
            counts[s % 4] = counts.get(s % 4, 0) + 1
        best = max(counts.values())
        winner = next(s for s in row[:maj_k] if counts[s % 4] == best)  # the first answer with the top count
        maj += winner % 3 == 0
    return {
        "accuracy": acc,
        "maj_at_k": maj / n,
        "response_tokens_mean": sum(s % 7 for s in every) / len(every),
        "response_tokens_max": max(s % 7 for s in every),
        "truncation_rate": sum(s % 7 == 6 for s in every) / len(every),
    }


@pytest.mark.parametrize("mode", ["greedy", "explicit"])
def test_figures_match_a_reference_written_from_the_rule(mode):
    plan = EvalPlan(samples=5, maj_k=3, seed=11, sampling=EvalSampling(mode, 0.7, 0.8), batch_tokens=40)
    got = evaluate(None, SeedItems(9), plan).figures
    want = _reference_figures(9, 5, 11, mode == "greedy", 3)
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert got["k"] == 5 and got["maj_k"] == 3 and got["n"] == 9
    assert got["sampling"]["mode"] == mode and got["sampling"]["greedy_response"] == (mode == "greedy")
    assert got["sampling"]["temperature"] == 0.7 and got["sampling"]["top_p"] == 0.8


def test_maj_at_k_against_a_hand_count():
    answers = [["3", "5", "5", None], ["1", "2", "2", "1"], [None, None, None, None], ["7", " 7", "8", "9"]]
    correct = [[False, True, True, False], [True, False, False, True], [False] * 4, [True, True, False, False]]
    # prompt 0: 5 twice (right); prompt 1: a tie 1/2 goes to 1, seen first (right); 2: no answer (wrong);
    # 3: "7" and " 7" are one answer (right)
    assert maj_at_k(answers, correct, 4) == pytest.approx(3 / 4)
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 4)  # the first sample alone
    with pytest.raises(ValueError):
        maj_at_k(answers, correct, 5)


def test_records_hold_every_rollout_clipped_by_the_rule():
    done = evaluate(None, SeedItems(4), EvalPlan(samples=2, record_chars=20, seed=1))
    assert len(done.records) == 4 * 3
    assert [(r["item"], r["sample"]) for r in done.records[:3]] == [(0, GREEDY), (0, 0), (0, 1)]
    for r in done.records:
        s = eval_seed(1, r["item"], r["sample"])
        assert r["correct"] == (s % 3 == 0) and r["tokens"] == s % 7 and r["truncated"] == (s % 7 == 6)
        assert r["response"] == clip_text("x" * (s % 50), 20)
    assert evaluate(None, SeedItems(4), EvalPlan(record_chars=0)).records == []


def test_clip_text_keeps_the_head_and_the_longer_tail():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    out = clip_text(text, 100)
    assert out.startswith(text[:25]) and out.endswith(text[-75:]) and "[... 900 characters cut ...]" in out
    assert clip_text("short", 100) == "short"


def test_model_sampling_reads_the_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    s = resolve_sampling("model", 1.0, 1.0, str(tmp_path / ""))
    assert (s.mode, s.temperature, s.top_p, s.top_k, s.note) == ("model", 0.6, 0.95, 20, "")
    assert s.record(4) == {
        "mode": "model",
        "greedy_response": False,
        "samples": 4,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    # a model whose config does not sample is decoded greedily, and eval.json says why
    plain = resolve_sampling("model", 1.0, 1.0, str(DEMO / "student"))
    assert plain.mode == "greedy" and "does not sample" in plain.note
    assert resolve_sampling("explicit", 0.3, 0.5, str(DEMO / "student")) == EvalSampling("explicit", 0.3, 0.5)


def test_vllm_requests_carry_the_top_k():
    """vLLM's completions request: the sampling's top-k, or -1 (vLLM's "off") when it has none; greedy asks
    for temperature 0 alone."""
    from types import SimpleNamespace

    from opd.rollout.served import Request
    from opd.rollout.vllm_engine import VLLMRollout

    engine = SimpleNamespace(model_name="student", eos_id=2)
    ask = lambda how: VLLMRollout.payload(engine, Request([5, 6], 7, 16, how))  # noqa: E731
    assert {k: ask(Sampling(0.6, 0.95, top_k=20))[k] for k in ("temperature", "top_p", "top_k")} == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    assert ask(Sampling(1.0, 0.9))["top_k"] == -1
    assert "top_k" not in ask(Sampling(greedy=True, top_k=20)) and ask(Sampling(greedy=True))["temperature"] == 0.0


def test_maj_at_k_without_samples_and_an_unknown_mode_are_refused():
    with pytest.raises(ConfigError, match="maj_k=4 votes over samples"):
        EvalConfig.from_flat(samples=0, maj_k=4)
    with pytest.raises(ConfigError, match="raise it or lower --maj-k"):
        EvalConfig.from_flat(samples=2, maj_k=4)
    with pytest.raises(ConfigError, match="eval_sampling='best'"):
        EvalConfig.from_flat(eval_sampling="best")
    with pytest.raises(ConfigError, match="takes every figure from samples"):
        EvalConfig.from_flat(eval_sampling="model", samples=0)


# ----------------------------------------------------------------------------- the demo student


@pytest.fixture(scope="module")
def demo_prompts():
    tok = load_tokenizer(DEMO / "student")
    task = load_task("arithmetic", 2, 0)
    prompts = PromptSet.build(eval_prompts(task, 12), tok, 128, "test prompts")
    return load_model(DEMO / "student"), tok, PromptItems(prompts, task, tok, max_new_tokens=40)


def test_the_static_cache_evaluates_as_opds_loop_does(demo_prompts):
    """The engine is what the evaluation is given: the static-cache decoder writes the same responses."""
    model, tok, items = demo_prompts
    plan = EvalPlan(samples=2, seed=3, batch_tokens=400, sampling=EvalSampling("greedy", 1.0, 0.9))
    plain = evaluate(HFRollout(model, tok.eos_token_id, tok.pad_token_id), items, plan)
    static = evaluate(HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on"), items, plan)
    assert static.records == plain.records and static.figures == plain.figures
    assert 0 < plain.figures["accuracy"] < 1  # the demo student gets some right: the equality says something
    right = [r for r in plain.records if r["correct"]]
    assert right and all(r["answer"] is not None and r["reference"] for r in right)


def test_batches_do_not_change_the_figures(demo_prompts):
    model, tok, items = demo_prompts
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id)
    runs = [evaluate(engine, items, EvalPlan(samples=2, seed=3, batch_tokens=b)) for b in (100, 10_000)]
    assert [r["response"] for r in runs[0].records] == [r["response"] for r in runs[1].records]


def test_opd_eval_writes_figures_and_records(tmp_path):
    out = tmp_path / "eval"
    common = dict(student=str(DEMO / "student"), device="cpu", max_new_tokens=40, eval_size=8)
    result = run_eval(EvalConfig.from_flat(out=str(out), samples=2, maj_k=2, **common))
    saved = json.loads((out / "eval.json").read_text())
    assert saved["records"] == "eval_samples.jsonl" and saved["maj_k"] == 2 and 0 <= saved["maj_at_k"] <= 1
    records = read_records(out / "eval_samples.jsonl")
    assert len(records) == 8 * 3
    keys = {"item", "sample", "prompt", "response", "answer", "reference", "correct", "tokens", "truncated"}
    assert all(keys <= set(r) for r in records)
    greedy = [r for r in records if r["sample"] == GREEDY]
    assert sum(r["correct"] for r in greedy) / 8 == result["accuracy"]


def test_opd_eval_runs_on_the_engine_options_given(tmp_path, monkeypatch):
    """``opd eval --rollout-engine hf --static-cache on`` decodes with the static cache, and writes what the
    dynamic cache writes (greedy and sampled alike); the engine is closed after."""
    import opd.rollout.sampling as sampling

    static_batches, closed = [], []
    init, close = sampling._StaticSteps.__init__, sampling.HFRollout.close
    monkeypatch.setattr(sampling._StaticSteps, "__init__", lambda s, *a: static_batches.append(1) or init(s, *a))
    monkeypatch.setattr(sampling.HFRollout, "close", lambda s: closed.append(1) or close(s))
    common = dict(student=str(DEMO / "student"), device="cpu", max_new_tokens=40, eval_size=6, samples=1, seed=2)
    runs = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        cfg = EvalConfig.from_flat(out=str(out), rollout_engine="hf", static_cache=mode, **common)
        runs[mode] = (run_eval(cfg), read_records(out / "eval_samples.jsonl"))
        assert len(static_batches) == (2 if mode == "on" else 0)  # its greedy batch, its sampled batch
    assert closed == [1, 1]
    (off, off_records), (on, on_records) = runs["off"], runs["on"]
    assert on_records == off_records and {**on, "wall_s": 0} == {**off, "wall_s": 0}
    assert 0 < off["accuracy"] < 1  # some right, some wrong: the equality says something


def test_opd_eval_engine_options_are_checked_as_trainings(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="static_cache=on is a setting of opd's own sampling loop"):
        EvalConfig.from_flat(rollout_engine="vllm", static_cache="on")
    with pytest.raises(ConfigError, match="--vllm-url set but rollout_engine is hf"):
        EvalConfig.from_flat(vllm_url="http://127.0.0.1:8000")
    loaded = []
    monkeypatch.setattr("opd.evaluation.model_eval.load_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(UserError, match="rollout_engine='nope' is not a registered rollout engine"):
        run_eval(EvalConfig.from_flat(out=str(tmp_path / "out"), student=str(DEMO / "student"), rollout_engine="nope"))
    assert not loaded


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_records_place_is_found_before_the_model_loads(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    loaded = []
    monkeypatch.setattr("opd.evaluation.model_eval.load_model", lambda *a, **k: loaded.append(1))
    try:
        with pytest.raises(UserError, match="cannot write"):  # the run folder's check or the records'
            run_eval(EvalConfig.from_flat(out=str(locked / "out"), student=str(DEMO / "student"), device="cpu"))
    finally:
        locked.chmod(0o700)
    assert not loaded


def test_a_records_place_that_cannot_be_a_file_is_found_before_the_model_loads(tmp_path, monkeypatch):
    """Root ignores permissions: a folder where the records file should be, in an earlier opd eval's output
    folder (which opd eval takes again), is the case any user can make."""
    cfg = EvalConfig.from_flat(
        out=str(tmp_path / "out"), student=str(DEMO / "student"), device="cpu", eval_size=2, samples=0
    )
    run_eval(cfg.replace(max_new_tokens=4))
    (tmp_path / "out" / "eval_samples.jsonl").unlink()
    (tmp_path / "out" / "eval_samples.jsonl").mkdir()
    loaded = []
    monkeypatch.setattr("opd.evaluation.model_eval.load_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(UserError, match="cannot write the evaluation records .*eval_samples.jsonl: it is a folder"):
        run_eval(cfg)
    assert not loaded


def test_each_training_evaluation_writes_its_records(tiny_models, tmp_path):
    from helpers import cfg_for, read_metrics

    from opd.training import loop

    cfg = cfg_for(tiny_models, tmp_path, steps=2, eval_every=1, eval_size=4, eval_samples=2, maj_k=2)
    loop.train(cfg, show_progress=False)
    run = Path(cfg.run.out)
    evals = [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert [p.name for p in sorted((run / "eval_samples").iterdir())] == [f"step_{r['step']:07d}.jsonl" for r in evals]
    for r in evals:
        records = read_records(run / "eval_samples" / f"step_{r['step']:07d}.jsonl")
        assert len(records) == 4 * 3
        assert sum(x["correct"] for x in records if x["sample"] == GREEDY) / 4 == r["eval/accuracy"]
        assert "eval/maj_at_k" in r and "eval/truncation_rate" in r and "eval/sampling" not in r
    used = json.loads((run / "eval_sampling.json").read_text())
    assert used == {
        "mode": "greedy",
        "greedy_response": True,
        "samples": 2,
        "temperature": 1.0,
        "top_p": cfg.rollout.top_p,
        "top_k": 0,
    }


def test_training_evaluates_through_the_runs_engine(tiny_models, tmp_path, monkeypatch):
    """Every evaluation response comes from the engine --rollout-engine names (here a registered one that
    counts its greedy calls): evaluation no longer builds opd's own loop behind the run's back."""
    from helpers import cfg_for

    from opd.rollout import registry
    from opd.rollout.sampling import start_hf
    from opd.training import loop

    greedy_rows = []

    def counting(ctx):
        engine = start_hf(ctx)
        generate = engine.generate

        def counted(prompt_ids, seeds, **kw):
            if kw.get("greedy"):
                greedy_rows.append(len(prompt_ids))
            return generate(prompt_ids, seeds, **kw)

        engine.generate = counted
        return engine

    monkeypatch.setitem(registry.ENGINES, "counting", counting)
    cfg = cfg_for(tiny_models, tmp_path, steps=1, eval_size=5, eval_samples=0, rollout_engine="counting")
    loop.train(cfg, show_progress=False)
    assert sum(greedy_rows) == 5  # the one evaluation's greedy responses: training's rollouts sample


def test_training_evaluation_samples_reach_the_trackers(tiny_models, tmp_path):
    from helpers import cfg_for, read_metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from opd.training import loop

    cfg = cfg_for(tiny_models, tmp_path, steps=2, eval_every=1, eval_size=3, eval_samples=1, report_to=["tensorboard"])
    loop.train(cfg, show_progress=False)
    run = Path(cfg.run.out)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("eval/samples/text_summary")
    assert [e.step for e in events] == [r["step"] for r in read_metrics(run) if "eval/accuracy" in r]
    for e in events:
        table = e.tensor_proto.string_val[0].decode()
        records = read_records(run / "eval_samples" / f"step_{e.step:07d}.jsonl")
        assert len(records) == 3 * 2 and "| prompt |" in table and "| response |" in table
        assert all(r["prompt"].strip().splitlines()[0][:40] in table for r in records)
