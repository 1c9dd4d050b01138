"""The static KV cache (``--static-cache``, :mod:`opd.rollout.static_cache`): the same rollouts as the dynamic
cache, on this CPU without a CUDA graph (the graph itself needs a GPU: benchmarks/bench_decode.py checks it).

Single-turn batches whose rows end at EOS at different steps, sampled and greedy; episodes whose turns end at
EOS, at their cap and at the budget (tests/rollout/test_hf_identity.py also holds the static path to the
recorded rollouts); a cache kept between batches that reads weights changed in place; bfloat16 autocast;
and the bad input: a model it does not fit, a batch too big for the device, a session past its budget.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

import opd
import opd.rollout.static_cache as S
from opd.config import ConfigError, TrainConfig
from opd.envs import get_env
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.models.precision import compute_in
from opd.rollout.engine import EngineContext, Sampling
from opd.rollout.episodes import EpisodeRollout
from opd.rollout.sampling import HFRollout, start_hf

DEMO = pathlib.Path(opd.__file__).parent / "assets" / "demo"
TEXTS = ["Tom has 3 apples and buys 4 more.", "What is 12 + 30?", "Compute 7 * 6.", "2 + 2 =", "Sam", "9 - 4"]
# Log-prob agreement with the dynamic cache in float32: the attention sums over a longer, masked key range,
# in another order (tests/rollout/test_hf_identity.py says how much that moves them).
LOGP_TOL = 2e-5


@pytest.fixture(scope="module")
def demo():
    torch.manual_seed(0)
    return load_model(DEMO / "student", "student").eval(), load_tokenizer(DEMO / "student", "student")


def prompts(tok, n: int = 8) -> list[list[int]]:
    return [tok(TEXTS[i % len(TEXTS)] + " " * (i // len(TEXTS)))["input_ids"] for i in range(n)]


def assert_same_rollouts(a, b) -> None:
    for field in ("input_ids_NL", "attention_mask_NL", "response_ids_NT", "response_mask_NT", "finished_N"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    torch.testing.assert_close(a.logprobs_NT, b.logprobs_NT, atol=LOGP_TOL, rtol=0)


@pytest.mark.parametrize("how", [dict(top_p=0.9), dict(temperature=0.7), dict(greedy=True)], ids=str)
def test_single_turn_rollouts_are_the_dynamic_caches(demo, how, monkeypatch):
    model, tok = demo
    ps, seeds = prompts(tok), list(range(8))
    free = HFRollout(model, -1, tok.pad_token_id).generate(ps, seeds, max_new_tokens=20, **how)
    stop = int(free.response_ids_NT[1, 4])  # a token the rollouts write: rows end at different steps
    dynamic = HFRollout(model, stop, tok.pad_token_id).generate(ps, seeds, max_new_tokens=20, **how)
    ends = dynamic.response_mask_NT.sum(-1)
    assert int(ends.min()) < int(ends.max()), "the test needs rows that end at different steps"
    rows_seen, forward = [], model.forward
    monkeypatch.setattr(
        model, "forward", lambda *a, **kw: rows_seen.append(kw["input_ids"].shape[0]) or forward(*a, **kw)
    )
    engine = HFRollout(model, stop, tok.pad_token_id, static_cache="on")
    static = engine.generate(ps, seeds, max_new_tokens=20, **how)
    assert_same_rollouts(static, dynamic)
    assert set(rows_seen) == {8}, "the static cache keeps every row in the model's batch"
    assert len(engine.static.free) == 1 and isinstance(engine.static.free[0].cache, S.SlotCache)


def test_a_lora_student_decodes_the_same():
    """peft's wrapper passes the cache, the positions and the 4-D mask through to the model it wraps."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = load_model(DEMO / "student", "student")
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    tok = load_tokenizer(DEMO / "student", "student")
    ps = prompts(tok, 4)
    dynamic = HFRollout(model, tok.eos_token_id, tok.pad_token_id).generate(ps, list(range(4)), max_new_tokens=12)
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on")
    assert_same_rollouts(engine.generate(ps, list(range(4)), max_new_tokens=12), dynamic)
    assert len(engine.static.free) == 1


def test_episodes_are_the_dynamic_caches(demo):
    """Turns ended by EOS and by their cap, episodes cut by the budget, replies of different lengths."""
    model, tok = demo
    env = get_env("toy", rooms=3, max_turns=5)
    games, seeds = env.games("train")[:6], [7 * i + 3 for i in range(6)]
    how = dict(max_new_tokens=140, max_action_tokens=20, temperature=1.0, top_p=0.9)
    runs = {}
    for mode in ("off", "on"):
        engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache=mode)
        runs[mode] = EpisodeRollout(engine, tok).play(env, games, seeds, **how)
        assert (len(engine.static.free) == 1) == (mode == "on")
    dynamic, static = runs["off"], runs["on"]
    assert_same_rollouts(static.batch, dynamic.batch)
    assert torch.equal(static.batch.action_mask_NT, dynamic.batch.action_mask_NT)
    assert [dataclasses.asdict(r) for r in static.records] == [dataclasses.asdict(r) for r in dynamic.records]
    spans = [(s, e) for r in dynamic.records for s, e in r.spans]
    resp = dynamic.batch.response_ids_NT
    cut = [r.end for r in dynamic.records]
    eos_turns = sum(
        e > s and int(resp[n, e - 1]) == tok.eos_token_id for n, r in enumerate(dynamic.records) for s, e in r.spans
    )
    assert len(spans) >= 12 and 0 < eos_turns < len(spans) and "budget" in cut, (len(spans), eos_turns, cut)


def test_a_kept_cache_is_reused_and_reads_weights_changed_in_place(demo):
    model, tok = demo
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on")
    ps = prompts(tok)
    engine.generate(ps, list(range(8)), max_new_tokens=6)
    kept = engine.static.free[0]
    changed = load_model(DEMO / "student", "student").eval()
    try:
        with torch.no_grad():
            for p in model.parameters():  # in place, as an optimizer step writes them
                p.mul_(1.25)
                changed.get_parameter(next(n for n, q in model.named_parameters() if q is p)).mul_(1.25)
        again = engine.generate(ps[:7] + [ps[0]], list(range(10, 18)), max_new_tokens=6)
        assert engine.static.free == [kept], "a batch of the same shape reuses the cache"
        want = HFRollout(changed, tok.eos_token_id, tok.pad_token_id).generate(
            ps[:7] + [ps[0]], list(range(10, 18)), max_new_tokens=6
        )
        assert_same_rollouts(again, want)
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.div_(1.25)


def test_a_captured_graph_is_dropped_when_weight_tensors_are_replaced_only(demo):
    model, tok = demo
    dec = S.StaticDecoder(model, layers=2, rows=2, slots=64, graphs=False)
    dec.step.graph, dec.step.weights = "a graph", S._weights_key(model)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.0)  # the optimizer's way: same tensors
    dec.start()
    assert dec.step.graph == "a graph"
    old = model.model.norm.weight
    model.model.norm.weight = torch.nn.Parameter(old.detach().clone())  # a reload's way: new tensors
    try:
        dec.start()
        assert dec.step.graph is None
    finally:
        model.model.norm.weight = old


class StandInGraph:
    """What a captured CUDA graph does, on the CPU: replaying writes the decode step's logits into the output
    buffer it was captured with (``off`` times them: a graph that read something stale)."""

    def __init__(self, dec: S.StaticDecoder, off: float):
        self.dec, self.off = dec, off

    def replay(self) -> None:
        s = self.dec.step
        s.logits_RV.copy_(self.dec._forward(s.ids_R1, s.pos_R1, s.mask_R11S) * self.off)


def static_notes(capsys) -> list[str]:
    """The static cache's notes on stderr since the last read."""
    return [line for line in capsys.readouterr().err.splitlines() if "static KV cache" in line]


def two_batches_with_graphs(model, tok, capsys) -> tuple[HFRollout, list[str]]:
    """Two batches of one shape from an engine told to capture its decode step: each the dynamic cache's
    rollouts; the engine, and the notes it printed."""
    ps = prompts(tok)
    want = HFRollout(model, tok.eos_token_id, tok.pad_token_id).generate(ps, list(range(8)), max_new_tokens=8)
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on")
    engine.static.graphs = True
    capsys.readouterr()
    for _ in range(2):
        assert_same_rollouts(engine.generate(ps, list(range(8)), max_new_tokens=8), want)
    return engine, static_notes(capsys)


@pytest.mark.parametrize("off", [1.0, 1.5], ids=["faithful", "stale"])
def test_the_graph_path_replays_and_checks_its_first_replay(demo, off, monkeypatch, capsys):
    model, tok = demo
    captured = []

    def capture(dec):
        s = dec.step
        s.graph, s.logits_RV, s.weights = StandInGraph(dec, off), torch.empty(dec.rows, 2048), S._weights_key(model)
        dec.capture_s, dec.verified = 0.25, False
        captured.append(dec)

    monkeypatch.setattr(S.StaticDecoder, "_capture", capture)
    engine, notes = two_batches_with_graphs(model, tok, capsys)
    assert len(captured) == 1, "captured once, replayed by the next batch of the same shape"
    if off == 1.0:
        assert engine.static.free[0].step.graph is not None and engine.static.captures == [0.25]
        assert notes == ["opd: static KV cache: the rollout's decode step was captured as a CUDA graph in 0.2 s (8 rows, "
                         "64 positions); it is replayed while batches keep that shape"]  # fmt: skip
    else:
        assert engine.static.free[0].step.graph is None
        assert any(
            "runs without a CUDA graph: its first replay's logits differ from the eager step's" in n for n in notes
        )


def test_a_graph_that_cannot_be_captured_leaves_the_eager_step(demo, capsys):
    """On this CPU build a capture fails at once (no CUDA): the step runs eagerly, said once."""
    _, notes = two_batches_with_graphs(*demo, capsys)
    assert len(notes) == 1 and "runs without a CUDA graph: capture failed" in notes[0], notes


def test_under_bfloat16_autocast_the_cache_keeps_the_attentions_dtypes():
    """opd's mixed precision: float32 weights, the decoder under bfloat16 autocast. The rotary embedding
    returns float32 keys, the value projection bfloat16 values; the cache stores what the dynamic one stores."""
    model = compute_in(load_model(DEMO / "student", "student").eval(), "bfloat16")
    tok = load_tokenizer(DEMO / "student", "student")
    ps = prompts(tok)
    ids = torch.tensor([ps[0]])
    with torch.no_grad():
        dyn = model(input_ids=ids, use_cache=True).cache.layers[0]
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on")
    batch = engine.generate(ps, list(range(8)), max_new_tokens=16, top_p=0.9)
    layer = engine.static.free[0].cache.layers[0]
    assert (
        (layer.keys.dtype, layer.values.dtype) == (dyn.keys.dtype, dyn.values.dtype) == (torch.float32, torch.bfloat16)
    )
    # the log-probs are the model's: a plain forward over the rollouts, under the same autocast, agrees to
    # bfloat16's rounding (2^-8 of logits around 10; the dynamic cache's rollouts are 0.02 off here)
    mask = batch.attention_mask_NL
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids_NL, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
    P, T = batch.prompt_len, batch.response_ids_NT.shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : P - 1 + T].float(), -1).gather(-1, batch.response_ids_NT.unsqueeze(-1))
    gap = (lp.squeeze(-1) - batch.logprobs_NT).abs()[batch.response_mask_NT]
    assert gap.numel() > 50 and float(gap.max()) < 0.05


def tiny(**config) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, **config,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "config, why",
    [
        (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "DynamicSlidingWindowLayer layers"),
        (dict(attn_implementation="eager"), "attention implementation is 'eager'"),
    ],
    ids=["sliding-window", "eager-attention"],
)
def test_a_model_it_does_not_fit_keeps_the_dynamic_cache_said_once(config, why, capsys):
    model = tiny(**config)
    ps = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    want = HFRollout(model, 1, 0).generate(ps, [0, 1, 2], max_new_tokens=5)
    engine = HFRollout(model, 1, 0, static_cache="on")
    capsys.readouterr()
    for _ in range(2):
        assert_same_rollouts(engine.generate(ps, [0, 1, 2], max_new_tokens=5), want)
    engine.episodes(ps, [0, 1, 2], budget=4, sampling=Sampling()).close()
    notes = static_notes(capsys)
    assert len(notes) == 1 and why in notes[0] and "dynamic cache" in notes[0], notes
    assert engine.static.free == []


def test_a_cache_too_big_for_the_device_is_an_error_with_on_and_falls_back_with_auto(demo, monkeypatch, capsys):
    model, tok = demo
    ps = prompts(tok, 4)
    want = HFRollout(model, tok.eos_token_id, tok.pad_token_id).generate(ps, list(range(4)), max_new_tokens=8)
    monkeypatch.setattr(S, "free_memory", lambda device: 2**18)  # 0.25 MiB free: the cache needs 0.5
    with pytest.raises(
        UserError,
        match=r"--static-cache on: the static KV cache for 4 rows of 64 positions needs "
        r"0\.5 MiB and cpu has 0\.2 MiB free \(a batch of 4 rollouts, prompts of up to \d+ tokens and a "
        r"budget of 8 new tokens\); lower the batch size or --max-new-tokens, or use --static-cache auto",
    ):
        HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on").generate(
            ps, [0, 1, 2, 3], max_new_tokens=8
        )
    monkeypatch.setattr(S, "wanted", lambda mode, device: mode != "off")  # auto as on a GPU
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="auto")
    capsys.readouterr()
    for _ in range(2):
        assert_same_rollouts(engine.generate(ps, list(range(4)), max_new_tokens=8), want)
    notes = static_notes(capsys)
    assert len(notes) == 1 and "this batch uses the dynamic cache" in notes[0], notes
    assert engine.static.free == []


def test_the_cache_size_is_what_its_tensors_take(demo, monkeypatch):
    model, tok = demo
    asked = []
    monkeypatch.setattr(S, "free_memory", lambda device: asked.append(device) or 2**40)
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on")
    engine.generate(prompts(tok, 4), list(range(4)), max_new_tokens=8)
    cache = engine.static.free[0].cache
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    k, v = cache.layers[0].keys, cache.layers[0].values
    assert len(asked) == 1 and cache.bytes_needed(k[:, :, :1], v[:, :, :1]) == held


def test_a_session_past_its_budget_is_refused(demo):
    model, tok = demo
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on")
    session = engine.episodes(prompts(tok, 2), [0, 1], budget=4, sampling=Sampling())
    try:
        session.extend({0: [5, 6, 7]})  # within the budget
        with pytest.raises(
            ValueError,
            match=r"episode 0 would hold 5 tokens after its prompt, more than the session's "
            r"budget of 4",
        ):
            session.extend({0: [5, 6]})
    finally:
        session.close()
    assert len(engine.static.free) == 1


def test_the_option_reaches_the_engine_and_bad_values_are_refused(demo):
    model, tok = demo
    base = dict(student="/m/student", teacher="/m/teacher")
    assert TrainConfig.from_flat(**base).rollout.static_cache == "off"  # until a GPU run measures it faster
    for cfg, mode in ((TrainConfig.from_flat(**base, static_cache="auto"), "auto"), (TrainConfig.from_flat(**base, static_cache="on"), "on"),
                      (TrainConfig.from_flat(**base, static_cache="auto", fsdp=True), "off")):  # fmt: skip
        assert start_hf(EngineContext(model, tok, cfg)).static.mode == mode
    with pytest.raises(ConfigError, match=r"static_cache='yes': choose one of auto, on, off"):
        TrainConfig.from_flat(**base, static_cache="yes")
    with pytest.raises(ConfigError, match=r"static_cache=on does not run with --fsdp"):
        TrainConfig.from_flat(**base, static_cache="on", fsdp=True)
    with pytest.raises(ConfigError, match=r"static_cache=on is a setting of opd's own sampling loop"):
        TrainConfig.from_flat(**base, static_cache="on", rollout_engine="vllm")
