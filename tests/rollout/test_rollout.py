"""Rollouts and masks: nucleus sampling, recorded log-probs, per-prompt seeding, and which
positions the losses see (response up to EOS, minus special tokens; never prompt or padding).

References are explicit loops over plain Python lists, not calls into the code under test.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from opd.models.loading import load_model, load_tokenizer
from opd.models.tokenizer import format_prompt
from opd.rollout.sampling import HFRollout, RolloutBatch, nucleus_sample
from opd.training.loss import loss_mask
from opd.training.sft import encode_pairs


def ref_nucleus(probs: list[float], top_p: float) -> set[int]:
    """Smallest set of most probable tokens whose mass reaches top_p (ties: lower id first)."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, mass = set(), 0.0
    for i in order:
        if probs[i] == 0.0:
            break
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


def ref_softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    finite = [x / temperature for x in row if x != -math.inf]
    m = max(finite)
    e = [0.0 if x == -math.inf else math.exp(x / temperature - m) for x in row]
    s = sum(e)
    return [v / s for v in e]


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("candidates", [2, 64, (1, 3)])
def test_nucleus_sample_draws_exactly_the_renormalized_nucleus(top_p, temperature, candidates):
    logits = [[2.0, 0.3, -1.0, 1.1, -math.inf, 0.0, 1.7], [0.0, 0.0, 0.0, 5.0, -math.inf, -math.inf, 0.1]]
    M = 4000  # evenly spaced uniforms: each token is drawn M * p_renorm times, to within one
    u = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    for row in logits:
        probs = ref_softmax(row, temperature)
        nucleus = ref_nucleus(probs, top_p)
        mass = sum(probs[i] for i in nucleus)
        drawn = nucleus_sample(torch.tensor([row] * M), u, temperature, top_p, candidates).tolist()
        assert set(drawn) == nucleus, f"drew {set(drawn) - nucleus} outside the nucleus {nucleus}"
        for i in nucleus:
            assert abs(drawn.count(i) - M * probs[i] / mass) <= 1.5


@pytest.mark.parametrize("candidates", [8, (2, 8)])
def test_nucleus_sample_with_few_candidates_draws_what_the_full_sort_draws(candidates):
    """Rows whose nucleus fits in the candidates (of either round) and rows that need the full sort, in one batch."""
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.1, 0.5, 1.0, 3.0, 8.0, 20.0]).repeat(50).unsqueeze(-1)  # flat ... peaked rows
    logits = torch.randn(300, 301, generator=g) * scale
    u = torch.rand(300, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits.double(), -1)
    top2, top8 = (probs.topk(c, dim=-1).values.sum(-1) for c in (2, 8))
    paths = [top2 >= 0.9, (top2 < 0.9) & (top8 >= 0.9), top8 < 0.9]
    assert all(bool(p.any()) for p in paths), "the test needs rows on every path"
    few = nucleus_sample(logits, u, 1.0, 0.9, candidates=candidates)
    every = nucleus_sample(logits, u, 1.0, 0.9, candidates=301)
    assert torch.equal(few, every)
    for n in range(0, 300, 7):  # and each draw is in its row's nucleus (float64 reference)
        assert int(few[n]) in ref_nucleus(probs[n].tolist(), 0.9)


def ref_top_k_nucleus(probs: list[float], top_k: int, top_p: float) -> dict[int, float]:
    """Each token's chance under top-k then top-p: the k most probable tokens (ties: lower id first),
    renormalized, then their nucleus, renormalized again."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))[:top_k]
    kept = sum(probs[i] for i in order)
    within = [probs[i] / kept if i in order else 0.0 for i in range(len(probs))]
    nucleus = ref_nucleus(within, top_p)
    mass = sum(within[i] for i in nucleus)
    return {i: within[i] / mass for i in nucleus}


@pytest.mark.parametrize("top_k", [1, 2, 3, 6])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 1.0])
def test_top_k_draws_exactly_the_renormalized_top_k_nucleus(top_k, top_p):
    logits = [[2.0, 0.3, -1.0, 1.1, -math.inf, 0.0, 1.7], [0.0, 0.2, 0.1, 5.0, -math.inf, -math.inf, 0.3]]
    M = 4000  # evenly spaced uniforms: each token is drawn M * its chance times, to within one
    u = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    for row in logits:
        for temperature in (1.0, 0.6):
            chance = ref_top_k_nucleus(ref_softmax(row, temperature), top_k, top_p)
            drawn = nucleus_sample(torch.tensor([row] * M), u, temperature, top_p, top_k=top_k).tolist()
            assert set(drawn) == set(chance), f"drew {set(drawn) - set(chance)}, allowed {set(chance)}"
            for i, p in chance.items():
                assert abs(drawn.count(i) - M * p) <= 1.5


def test_top_k_off_or_at_least_the_vocabulary_draws_what_top_p_alone_draws():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 50, generator=g) * 3
    u = torch.rand(200, generator=g, dtype=torch.float64)
    for top_p in (0.9, 1.0):
        plain = nucleus_sample(logits, u, 1.0, top_p)
        assert torch.equal(nucleus_sample(logits, u, 1.0, top_p, top_k=0), plain)
        assert torch.equal(nucleus_sample(logits, u, 1.0, top_p, top_k=50), plain)
        assert torch.equal(nucleus_sample(logits, u, 1.0, top_p, top_k=80), plain)


@pytest.mark.parametrize("V", [301, 151936])
def test_top_p_1_draws_the_inverse_cdf_of_the_sorted_distribution_without_sorting_settled_rows(V, monkeypatch):
    """At top-p 1 the draw is the token whose interval of the descending-sorted CDF holds u (float64
    reference, ties lower id first); rows settled within the candidates never sort the vocabulary."""
    g = torch.Generator().manual_seed(1)
    rows = 300 if V < 1000 else 8
    scale = torch.tensor([0.1, 1.0, 3.0, 8.0, 20.0, 40.0]).repeat(rows // 6 + 1)[:rows].unsqueeze(-1)
    logits = torch.randn(rows, V, generator=g) * scale
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits.double(), -1)
    for n in range(rows):
        p = probs[n]
        order = (
            sorted(range(V), key=lambda i: (-float(p[i]), i))
            if V < 1000
            else p.argsort(descending=True, stable=True).tolist()
        )
        cdf = torch.cumsum(p[order], 0)
        want = order[int(torch.searchsorted(cdf, torch.tensor([float(u[n])], dtype=torch.float64), right=True))]
        assert int(nucleus_sample(logits[n : n + 1], u[n : n + 1], 1.0, 1.0)) == want, f"row {n}"
    widths = []  # the candidates each topk takes: V is the whole vocabulary sorted
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, *a, **kw: widths.append(k) or topk(self, k, *a, **kw))
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **kw: pytest.fail("sorted the vocabulary"))
    peaked = torch.zeros(4, V)
    peaked[:, 7] = 30.0  # almost all the mass on one token: every row settles in the first round
    uniforms = torch.tensor([0.1, 0.5, 0.9, 0.99], dtype=torch.float64)
    assert nucleus_sample(peaked, uniforms, 1.0, 1.0).tolist() == [7] * 4
    assert widths and max(widths) < V


def sharpened(path, scale=8.0):
    """A tiny random model whose next-token distributions are peaked, so the nucleus is small."""
    model = load_model(path, "student")
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model.eval()


@torch.no_grad()
def model_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """Log-probs of the next token at every response position, from one plain forward pass."""
    mask = batch.attention_mask_NL
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids_NL, attention_mask=mask, position_ids=pos).logits
    P, T = batch.prompt_len, batch.response_ids_NT.shape[1]
    return torch.log_softmax(logits[:, P - 1 : P - 1 + T].double(), -1)


def some_prompts(tok, n):
    texts = [
        "What is 3 + 4?",
        "I have 12 apples and eat 5. How many are left?",
        "Add 7 and 9.",
        "Begin with 13, then put 8 more on top. What is the result?",
    ]
    return [tok(format_prompt(tok, texts[i % len(texts)]), add_special_tokens=False)["input_ids"] for i in range(n)]


@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_rollout_tokens_stay_in_each_positions_nucleus(tiny_models, top_p):
    student, _ = tiny_models
    tok, model = load_tokenizer(student), sharpened(student)
    engine = HFRollout(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    batch = engine.generate(some_prompts(tok, 6), list(range(6)), max_new_tokens=10, top_p=top_p)
    lp = model_logprobs(model, batch)
    outside_somewhere = 0
    for n in range(batch.num_rollouts):
        for t in range(batch.response_ids_NT.shape[1]):
            if not batch.response_mask_NT[n, t]:
                continue
            probs = lp[n, t].exp().tolist()
            nucleus = ref_nucleus(probs, top_p)
            token = int(batch.response_ids_NT[n, t])
            assert token in nucleus, f"rollout {n} position {t}: token {token} outside the top-p nucleus"
            outside_somewhere += len(nucleus) < len(probs)
            # The recorded log-prob is the unmodified policy's (temperature 1, no top-p).
            assert abs(float(batch.logprobs_NT[n, t]) - float(lp[n, t, token])) < 1e-4
    assert outside_somewhere > 0, "the test needs positions where the nucleus excludes tokens"


@pytest.mark.parametrize("static_cache", ["off", "on"])
def test_rollout_tokens_stay_in_each_positions_top_k(tiny_models, static_cache):
    student, _ = tiny_models
    tok, model = load_tokenizer(student), sharpened(student, 2.0)
    engine = HFRollout(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, static_cache=static_cache)
    batch = engine.generate(some_prompts(tok, 6), list(range(6)), max_new_tokens=10, top_p=1.0, top_k=2)
    lp, second = model_logprobs(model, batch), 0
    for n in range(batch.num_rollouts):
        for t in range(int(batch.response_mask_NT[n].sum())):
            probs = lp[n, t].exp().tolist()
            token = int(batch.response_ids_NT[n, t])
            assert token in ref_top_k_nucleus(probs, 2, 1.0), f"rollout {n} position {t}: token outside the top 2"
            second += token != max(range(len(probs)), key=probs.__getitem__)
    assert second > 0, "the test needs draws of the second most probable token (top-k 2 is not greedy)"


def test_top_k_1_samples_what_greedy_decoding_writes_in_batches_and_episodes():
    """Top-k 1 keeps the most probable token alone, so sampling (at temperature 3, where the demo student's
    draws go astray) writes the greedy responses: the single-turn loop and the episode sessions alike."""
    import opd
    from opd.envs import get_env
    from opd.rollout.episodes import EpisodeRollout

    demo = Path(opd.__file__).parent / "assets" / "demo" / "student"
    model, tok = load_model(demo, "student"), load_tokenizer(demo, "student")
    engine = HFRollout(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    prompts, seeds = some_prompts(tok, 4), [0, 1, 2, 3]
    greedy = engine.generate(prompts, seeds, max_new_tokens=12, greedy=True)
    top_1 = engine.generate(prompts, seeds, max_new_tokens=12, temperature=3.0, top_k=1)
    free = engine.generate(prompts, seeds, max_new_tokens=12, temperature=3.0)
    assert torch.equal(top_1.response_ids_NT, greedy.response_ids_NT)
    assert not torch.equal(free.response_ids_NT, greedy.response_ids_NT)  # sampling alone differs here
    env = get_env("toy", rooms=3, max_turns=4)
    games, limits = env.games("train")[:3], dict(max_new_tokens=120, max_action_tokens=16)
    player = EpisodeRollout(engine, tok)
    ways = ({"greedy": True}, {"temperature": 3.0, "top_k": 1}, {"temperature": 3.0})
    greedy_eps, top_1_eps, free_eps = (
        [r.actions for r in player.play(env, games, [0, 1, 2], **limits, **how).records] for how in ways
    )
    assert top_1_eps == greedy_eps != free_eps


def test_rollout_depends_on_its_own_seed_only(tiny_models):
    student, _ = tiny_models
    tok, model = load_tokenizer(student), sharpened(student, 3.0)
    engine = HFRollout(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    prompts = some_prompts(tok, 4)
    together = engine.generate(prompts, [11, 12, 13, 14], max_new_tokens=8)
    # Alone, the short prompt gets no left padding, and it is in a batch of one.
    alone = engine.generate([prompts[2]], [13], max_new_tokens=8)
    T = alone.response_ids_NT.shape[1]
    assert torch.equal(together.response_ids_NT[2, :T], alone.response_ids_NT[0])
    torch.testing.assert_close(together.logprobs_NT[2, :T], alone.logprobs_NT[0], atol=1e-4, rtol=0)
    other = engine.generate(prompts, [21, 12, 13, 14], max_new_tokens=8)
    assert torch.equal(other.response_ids_NT[1:], together.response_ids_NT[1:])


def test_response_mask_ends_at_the_first_eos(tiny_models):
    student, _ = tiny_models
    tok, model = load_tokenizer(student), sharpened(student, 2.0)
    prompts = some_prompts(tok, 8)
    free = HFRollout(model, eos_id=-1, pad_id=tok.pad_token_id).generate(prompts, list(range(8)), max_new_tokens=10)
    # Declare a token the rollouts actually produce to be the EOS, so some stop early.
    stop = int(free.response_ids_NT[0, 3])
    batch = HFRollout(model, eos_id=stop, pad_id=tok.pad_token_id).generate(prompts, list(range(8)), max_new_tokens=10)
    T = batch.response_ids_NT.shape[1]
    for n in range(8):
        row = free.response_ids_NT[n].tolist()
        end = row.index(stop) + 1 if stop in row else len(row)
        assert batch.response_ids_NT[n, :end].tolist() == row[:end]
        assert batch.response_mask_NT[n].tolist() == [t < end for t in range(T)]
        assert bool(batch.finished_N[n]) == (stop in row)
        assert (batch.logprobs_NT[n, end:] == 0).all()


def test_finished_rows_leave_the_decoding_batch_without_changing_any_rollout(tiny_models, monkeypatch):
    import opd.rollout.sampling as R

    student, _ = tiny_models
    tok, model = load_tokenizer(student), sharpened(student, 2.0)
    prompts = some_prompts(tok, 8)
    free = HFRollout(model, eos_id=-1, pad_id=tok.pad_token_id).generate(prompts, list(range(8)), max_new_tokens=10)
    stop = int(free.response_ids_NT[0, 3])  # a token the rollouts produce, so rows stop at different steps
    rows_seen = []
    forward = model.forward
    monkeypatch.setattr(
        model, "forward", lambda *a, **kw: rows_seen.append(kw["input_ids"].shape[0]) or forward(*a, **kw)
    )
    batches = {}
    for share in (0.0, 1.0):  # never drop finished rows; drop them as soon as any finishes
        monkeypatch.setattr(R, "COMPACT_BELOW", share)
        rows_seen.clear()
        batches[share] = HFRollout(model, eos_id=stop, pad_id=tok.pad_token_id).generate(
            prompts, list(range(8)), max_new_tokens=10
        )
        batches[share, "rows"] = list(rows_seen)
    kept, dropped = batches[0.0], batches[1.0]
    assert set(batches[0.0, "rows"]) == {8}
    assert batches[1.0, "rows"][-1] < 8, "no finished row left the batch; the test needs rows that stop early"
    assert batches[1.0, "rows"] == sorted(batches[1.0, "rows"], reverse=True)
    for field in ("input_ids_NL", "attention_mask_NL", "response_ids_NT", "response_mask_NT", "finished_N"):
        assert torch.equal(getattr(kept, field), getattr(dropped, field)), field
    torch.testing.assert_close(kept.logprobs_NT, dropped.logprobs_NT, atol=1e-5, rtol=0)


def test_loss_mask_is_response_until_eos_minus_special_tokens():
    EOS, PAD, THINK, END_THINK = 2, 0, 5, 6
    specials = [EOS, THINK, END_THINK]
    responses = [
        [THINK, 9, 10, END_THINK, 11, EOS, PAD, PAD],
        [7, 8, 9, 10, 11, 12, 13, 14],  # no EOS: cut at the length limit
        [EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
        [8, PAD, 9, EOS, PAD, PAD, PAD, PAD],
    ]  # a PAD id emitted mid-response is still a token
    lengths = [6, 8, 1, 4]
    T = 8
    resp = torch.tensor(responses)
    resp_mask = torch.tensor([[t < n for t in range(T)] for n in lengths])
    prompt = torch.tensor([[PAD, 3, 4], [3, 4, 4], [PAD, PAD, 3], [3, 3, 3]])
    batch = RolloutBatch(
        torch.cat([prompt, resp], 1),
        torch.cat([prompt != PAD, resp_mask], 1).long(),
        3,
        resp,
        resp_mask,
        torch.zeros(4, T),
        torch.tensor([True, False, True, True]),
    )
    on = loss_mask(batch, specials, mask_special=True)
    off = loss_mask(batch, specials, mask_special=False)
    for n, row in enumerate(responses):
        for t in range(T):
            in_response = t < lengths[n]
            assert bool(off[n, t]) == in_response
            assert bool(on[n, t]) == (in_response and row[t] not in specials), (n, t)


def test_sft_labels_cover_exactly_completion_and_eos(tiny_tokenizer):
    tok = load_tokenizer(tiny_tokenizer, "tokenizer")
    prompts = ["What is 3 + 4?", "Add 12 and 9, then take away 5. What do you get?"]
    completions = ["<think>3 + 4 = 7.</think> The answer is \\boxed{7}", "The answer is \\boxed{16}"]
    ids, att, lab = encode_pairs(tok, prompts, completions)
    for n, (p, c) in enumerate(zip(prompts, completions)):
        p_ids = tok(format_prompt(tok, p), add_special_tokens=False)["input_ids"]
        c_ids = tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        L = len(p_ids) + len(c_ids)
        assert ids[n, :L].tolist() == p_ids + c_ids
        assert lab[n].tolist() == [-100] * len(p_ids) + c_ids + [-100] * (ids.shape[1] - L)
        assert att[n].tolist() == [1] * L + [0] * (ids.shape[1] - L)


def hand_batch(pad_id: int, prompts: list[list[int]], responses: list[list[int]], T: int) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of the given (different) lengths."""
    P, N = max(map(len, prompts)), len(prompts)
    ids, mask = torch.full((N, P + T), pad_id), torch.zeros((N, P + T), dtype=torch.long)
    resp, resp_mask = torch.full((N, T), pad_id), torch.zeros((N, T), dtype=torch.bool)
    for n, (p, r) in enumerate(zip(prompts, responses)):
        ids[n, P - len(p) : P], mask[n, P - len(p) : P] = torch.tensor(p), 1
        ids[n, P : P + len(r)], mask[n, P : P + len(r)] = torch.tensor(r), 1
        resp[n, : len(r)], resp_mask[n, : len(r)] = torch.tensor(r), True
    return RolloutBatch(ids, mask, P, resp, resp_mask, torch.zeros(N, T), torch.ones(N, dtype=torch.bool))


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 16])
def test_response_hidden_in_length_chunks_matches_each_row_alone(tiny_models, rows_per_chunk):
    from opd.models.loading import final_hidden
    from opd.rollout.forward import response_hidden

    student, _ = tiny_models
    tok, model = load_tokenizer(student), load_model(student, "student")
    prompts = some_prompts(tok, 7)
    prompts[3] = prompts[3][:5]  # an unusually short prompt in the middle of the batch
    responses = [list(range(30, 30 + n)) for n in (4, 1, 9, 6, 9, 2, 7)]
    batch = hand_batch(tok.pad_token_id, prompts, responses, T=11)
    weights = torch.randn(7, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    h = response_hidden(model, batch, rows_per_chunk)
    assert h.shape == (7, 11, model.config.hidden_size)
    (h * weights)[batch.response_mask_NT].sum().backward()
    got_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    total = 0
    for n, (p, r) in enumerate(zip(prompts, responses)):  # each row unpadded, in a batch of its own
        seq = torch.tensor([p + r])
        alone = final_hidden(model, seq, torch.ones_like(seq))[0, len(p) - 1 : len(p) - 1 + len(r)]
        torch.testing.assert_close(h[n, : len(r)], alone, atol=1e-5, rtol=1e-4)
        total = total + (alone * weights[n, : len(r)]).sum()
    total.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got_grads[k], p.grad, atol=1e-5, rtol=1e-4, msg=f"gradient of {k}")


def test_rows_are_dropped_only_from_caches_whose_every_layer_can_select_rows(tiny_models):
    from opd.rollout.sampling import _can_drop_rows

    student, _ = tiny_models
    tok, model = load_tokenizer(student), load_model(student, "student")
    ids = torch.tensor(some_prompts(tok, 1))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).cache
    assert _can_drop_rows(cache)
    assert not _can_drop_rows((torch.zeros(1),))  # a legacy tuple cache


def test_hybrid_models_generate_without_dropping_rows():
    """A Mamba/attention hybrid's cache layers inherit batch_select_indices but keep their recurrent
    states whole, so dropping finished rows would break its next step: such caches are left alone."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(0)
    cfg = FalconH1Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = FalconH1ForCausalLM(cfg).eval()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    free = HFRollout(model, -1, 0).generate(prompts, [0, 1, 2, 3], max_new_tokens=6)
    stop = int(free.response_ids_NT[0, 1])  # rows stop at different steps
    batch = HFRollout(model, stop, 0).generate(prompts, [0, 1, 2, 3], max_new_tokens=6)
    assert bool(batch.finished_N.any()) and not bool(batch.finished_N.all())
    for n in range(4):
        row = free.response_ids_NT[n].tolist()
        end = row.index(stop) + 1 if stop in row else len(row)
        assert batch.response_ids_NT[n, :end].tolist() == row[:end]
