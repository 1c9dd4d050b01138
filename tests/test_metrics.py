"""Tests for opd.metrics against an independent reference: plain Python loops over float64 lists."""

import math

import pytest
import torch

from opd import metrics as M

NEG = float("-inf")


# --------------------------------------------------------------------------- reference (loops)


def ref_log_softmax(row):
    finite = [x for x in row if x != NEG]
    if not finite:
        return [NEG] * len(row)
    mx = max(finite)
    log_z = mx + math.log(sum(math.exp(x - mx) for x in finite))
    return [x - log_z if x != NEG else NEG for x in row]


def ref_ranked(row, k):
    """First k ids by logit descending, ties to the lower id (may include -inf ids)."""
    return sorted(range(len(row)), key=lambda v: (-row[v], v))[:k]


def ref_topk_set(row, k):
    return [v for v in ref_ranked(row, k) if row[v] != NEG]


def ref_overlap(s, t, k):
    return len(set(ref_topk_set(s, k)) & set(ref_topk_set(t, k))) / k


def ref_advantage(s, t, k):
    """(eq. 7 value, whether the intersection is non-empty); p-bar, q-bar over the student top-k."""
    sp = ref_topk_set(s, k)
    sq = set(ref_topk_set(t, k))
    lp = ref_log_softmax([s[v] for v in sp])
    lq = ref_log_softmax([t[v] for v in sp])
    terms = [math.exp(lp[i]) * (lq[i] - lp[i]) for i, v in enumerate(sp) if v in sq]
    return (sum(terms) / len(terms), True) if terms else (0.0, False)


def ref_entropy(row):
    return -sum(math.exp(lp) * lp for lp in ref_log_softmax(row) if lp != NEG)


def ref_support_mass(row, ids, valid):
    lp = ref_log_softmax(row)
    return sum(math.exp(lp[v]) for v in {i for i, ok in zip(ids, valid) if ok})


def ref_per_position_lists(fn, *nested):
    """Apply fn at every (b, t) of nested lists (B, T, ...); returns nested lists (B, T)."""
    B, T = len(nested[0]), len(nested[0][0])
    return [[fn(*(x[b][t] for x in nested)) for t in range(T)] for b in range(B)]


def ref_per_position(fn, *nested):
    return torch.tensor(ref_per_position_lists(fn, *nested), dtype=torch.float64)


def ref_masked_mean(values, mask):
    values, mask = values.tolist(), mask.tolist()
    total, n = 0.0, 0
    for b in range(len(mask)):
        for t in range(len(mask[b])):
            if mask[b][t]:
                total += values[b][t]
                n += 1
    return total / n if n else 0.0


def ref_has_loop(tokens, n, m):
    for i in range(len(tokens) - n * m + 1):
        gram = tokens[i : i + n]
        if all(tokens[i + r * n : i + (r + 1) * n] == gram for r in range(m)):
            return True
    return False


# --------------------------------------------------------------------------- data


def make_logits(B, T, V, seed, ties=False, neg_inf=False, like=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    if like is not None:  # correlated with another model, so overlaps are neither 0 nor 1
        x = like.masked_fill(torch.isinf(like), 0.0) + 0.7 * x
    if ties:
        x = (x * 2).round() / 2
    if neg_inf:
        x = x.masked_fill(torch.rand(B, T, V, generator=g) < 0.3, NEG)
        x[0, 0] = NEG  # no finite logit
        x[-1, -1] = NEG
        x[-1, -1, V - 1] = 0.0  # exactly one finite logit
    return x


def make_mask(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0, -1] = True
    return mask


SHAPES = [(1, 1, 2), (3, 7, 11), (2, 5, 31)]
CASES = [(shape, ties, inf) for shape in SHAPES for ties in (False, True) for inf in (False, True)]


def ks_for(V):
    return sorted({1, 3, V} & set(range(1, V + 1)))


# --------------------------------------------------------------------------- reference comparisons


@pytest.mark.parametrize("shape,ties,neg_inf", CASES)
def test_topk_ids_matches_reference(shape, ties, neg_inf):
    x = make_logits(*shape, seed=1, ties=ties, neg_inf=neg_inf)
    for k in ks_for(shape[-1]):
        got = M.topk_ids(x, k)
        assert got.dtype == torch.int64 and got.shape == (*shape[:2], k)
        assert got.tolist() == ref_per_position_lists(lambda r, k=k: ref_ranked(r, k), x.tolist())


def test_topk_ids_ties_in_bfloat16_are_deterministic():
    x = torch.tensor([[[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0]]]).repeat(2, 3, 1).to(torch.bfloat16)
    assert M.topk_ids(x, 3).tolist() == [[[1, 2, 4]] * 3] * 2
    assert M.topk_ids(x, 6)[0, 0].tolist() == [1, 2, 4, 5, 6, 0]
    # Many rows with ties at the cut: the same as a full stable sort (a different algorithm).
    y = (torch.randn(4, 16, 257, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    stable = y.float().sort(dim=-1, descending=True, stable=True).indices
    for k in (1, 7, 32, 257):
        assert torch.equal(M.topk_ids(y, k), stable[..., :k])


@pytest.mark.parametrize("shape,ties,neg_inf", CASES)
def test_overlap_and_advantage_match_reference(shape, ties, neg_inf):
    s = make_logits(*shape, seed=2, ties=ties, neg_inf=neg_inf)
    t = make_logits(*shape, seed=3, ties=ties, neg_inf=neg_inf, like=s)
    mask = make_mask(*shape[:2], seed=4)
    for k in ks_for(shape[-1]):
        ov = ref_per_position(lambda a, b, k=k: ref_overlap(a, b, k), s.tolist(), t.tolist())
        got = M.topk_overlap_BT(s, t, k)
        torch.testing.assert_close(got, ov, rtol=0, atol=1e-12)
        torch.testing.assert_close(M.topk_overlap_BT(s, t, k, mask), ov * mask, rtol=0, atol=1e-12)
        expected = ref_masked_mean(ov, mask)
        assert M.topk_overlap_ratio(s, t, k, mask) == pytest.approx(expected, abs=1e-12)

        s_list, t_list = s.tolist(), t.tolist()
        adv_BT = ref_per_position(lambda a, b, k=k: ref_advantage(a, b, k)[0], s_list, t_list)
        nonempty_BT = ref_per_position(lambda a, b, k=k: ref_advantage(a, b, k)[1], s_list, t_list)
        got = M.overlap_token_advantage_BT(s, t, k, mask)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, adv_BT * mask, rtol=1e-9, atol=1e-12)
        expected = ref_masked_mean(adv_BT, mask & (nonempty_BT == 1))
        got = M.overlap_token_advantage(s, t, k, mask)
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def ref_overlap_mass(s, t, k):
    """Each model's full-softmax mass on the tokens in both top-k sets."""
    both = set(ref_topk_set(s, k)) & set(ref_topk_set(t, k))
    ls, lt = ref_log_softmax(s), ref_log_softmax(t)
    return sum(math.exp(ls[v]) for v in both), sum(math.exp(lt[v]) for v in both)


@pytest.mark.parametrize("shape,ties,neg_inf", CASES)
def test_overlap_mass_matches_reference(shape, ties, neg_inf):
    s = make_logits(*shape, seed=21, ties=ties, neg_inf=neg_inf)
    t = make_logits(*shape, seed=22, ties=ties, neg_inf=neg_inf, like=s)
    mask = make_mask(*shape[:2], seed=23)
    for k in ks_for(shape[-1]):
        for side in (0, 1):
            ref = ref_per_position(lambda a, b, k=k, side=side: ref_overlap_mass(a, b, k)[side], s.tolist(), t.tolist())
            got = M.overlap_mass_BT(s, t, k, mask)[side]
            torch.testing.assert_close(got, ref * mask, rtol=1e-10, atol=1e-12)
            assert M.overlap_mass(s, t, k, mask)[side] == pytest.approx(
                ref_masked_mean(ref, mask), rel=1e-10, abs=1e-12
            )
    # identical models with all of the mass in the top k: the overlap holds all of it
    x = torch.full((1, 2, 6), float("-inf"), dtype=torch.float64)
    x[..., :3] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert M.overlap_mass(x, x, 3, torch.ones(1, 2, dtype=torch.bool)) == pytest.approx((1.0, 1.0))


@pytest.mark.parametrize("shape,ties,neg_inf", CASES)
def test_entropy_and_gap_match_reference(shape, ties, neg_inf):
    s = make_logits(*shape, seed=5, ties=ties, neg_inf=neg_inf)
    t = make_logits(*shape, seed=6, ties=ties, neg_inf=neg_inf)
    mask = make_mask(*shape[:2], seed=7)
    h_s = ref_per_position(ref_entropy, s.tolist())
    h_t = ref_per_position(ref_entropy, t.tolist())
    torch.testing.assert_close(M.entropy_BT(s), h_s, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(M.entropy_BT(s, mask), h_s * mask, rtol=1e-10, atol=1e-12)
    gap = (h_t - h_s).abs()
    torch.testing.assert_close(M.entropy_gap_BT(s, t, mask), gap * mask, rtol=1e-10, atol=1e-12)
    assert M.entropy_gap(s, t, mask) == pytest.approx(ref_masked_mean(gap, mask), rel=1e-10)
    assert M.entropy(s, mask) == pytest.approx(ref_masked_mean(h_s, mask), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("shape,ties,neg_inf", CASES)
def test_support_mass_and_out_of_support_match_reference(shape, ties, neg_inf):
    B, T, V = shape
    g = torch.Generator().manual_seed(8)
    x = make_logits(*shape, seed=9, ties=ties, neg_inf=neg_inf)
    K = 5
    ids = torch.randint(0, V, (B, T, K), generator=g)  # with repeats
    valid = torch.rand(B, T, K, generator=g) < 0.6
    sampled = torch.randint(0, V, (B, T), generator=g)
    sampled[0, 0] = ids[0, 0, 0]  # at least one hit
    valid[0, 0, 0] = True
    mask = make_mask(B, T, seed=10)

    mass = ref_per_position(ref_support_mass, x.tolist(), ids.tolist(), valid.tolist())
    got = M.support_mass_BT(x, ids, valid, mask)
    torch.testing.assert_close(got, mass * mask, rtol=1e-10, atol=1e-12)
    all_valid = [[[True] * K] * T] * B
    mass_all = ref_per_position(ref_support_mass, x.tolist(), ids.tolist(), all_valid)
    torch.testing.assert_close(M.support_mass_BT(x, ids), mass_all, rtol=1e-10, atol=1e-12)
    expected = ref_masked_mean(mass, mask)
    assert M.support_mass(x, ids, mask, valid) == pytest.approx(expected, rel=1e-10)

    out = ref_per_position(
        lambda y, i, ok: float(not any(a == y and o for a, o in zip(i, ok))),
        sampled.tolist(),
        ids.tolist(),
        valid.tolist(),
    )
    torch.testing.assert_close(M.out_of_support_BT(sampled, ids, valid, mask).double(), out * mask)
    expected = ref_masked_mean(out, mask)
    assert M.out_of_support_share(sampled, ids, mask, valid) == pytest.approx(expected)
    # Ids at invalid slots are not members, even when the query is a negative padding id.
    pad_ids = torch.full((B, T, K), -1)
    assert (M.out_of_support_BT(torch.full((B, T), -1), pad_ids, torch.zeros(B, T, K)) == 1).all()
    out_all = ref_per_position(lambda y, i: float(y not in i), sampled.tolist(), ids.tolist())
    torch.testing.assert_close(M.out_of_support_BT(sampled, ids).double(), out_all)


def test_negative_reward_matches_reference():
    g = torch.Generator().manual_seed(11)
    s = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 3
    t = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 3
    t[0, 0], s[0, 1], s[0, 2], t[0, 2], t[0, 3] = NEG, NEG, NEG, NEG, s[0, 3]
    mask = make_mask(4, 9, seed=12)
    neg = ref_per_position(lambda a, b: float(b - a < 0), s.tolist(), t.tolist())
    assert neg[0, :4].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(M.negative_reward_BT(s, t, mask), neg * mask)
    assert M.negative_reward_share(s, t, mask) == pytest.approx(ref_masked_mean(neg, mask))


# --------------------------------------------------------------------------- identities, by hand


def test_student_equals_teacher_identities():
    x = make_logits(3, 4, 17, seed=13, ties=True)
    x[0, 1, :5] = NEG  # some -inf, still >= k finite
    mask = torch.ones(3, 4, dtype=torch.bool)
    for k in (1, 4, 12):
        assert (M.topk_overlap_BT(x, x, k) == 1).all()
        assert M.topk_overlap_ratio(x, x, k, mask) == 1.0
        assert (M.overlap_token_advantage_BT(x, x, k) == 0).all()
        assert M.overlap_token_advantage(x, x, k, mask) == 0.0
    assert (M.entropy_gap_BT(x, x) == 0).all() and M.entropy_gap(x, x, mask) == 0.0


def test_disjoint_topk_gives_zero_overlap_and_empty_advantage():
    V, k = 10, 3
    s = torch.zeros(2, 3, V)
    t = torch.zeros(2, 3, V)
    s[..., :k] = torch.tensor([5.0, 4.0, 3.0])
    t[..., k : 2 * k] = torch.tensor([5.0, 4.0, 3.0])
    mask = torch.ones(2, 3)
    assert (M.topk_overlap_BT(s, t, k) == 0).all() and M.topk_overlap_ratio(s, t, k, mask) == 0.0
    assert (M.overlap_token_advantage_BT(s, t, k) == 0).all()
    assert M.overlap_token_advantage(s, t, k, mask) == 0.0


def test_hand_computed_overlap_and_advantage():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    s, t = p.log().view(1, 1, 3), q.log().view(1, 1, 3)
    # S_p = {0, 1}, S_q = {1, 2}, I = {1}; p-bar(1) = 0.3/0.8, q-bar(1) = 0.5/0.7.
    assert M.topk_overlap_BT(s, t, 2).item() == pytest.approx(0.5)
    expected = 0.375 * (math.log(0.5 / 0.7) - math.log(0.375))
    assert M.overlap_token_advantage_BT(s, t, 2).item() == pytest.approx(expected, rel=1e-12)
    # Positions with an empty intersection are skipped by the scalar, not averaged in as 0.
    pad = torch.full((1, 1, 2), NEG, dtype=torch.float64)
    s2 = torch.cat([torch.cat([s, pad], -1), torch.tensor([[[9.0, 8, 0, 0, 0]]]).double()], 1)
    t2 = torch.cat([torch.cat([t, pad], -1), torch.tensor([[[0.0, 0, 0, 9, 8]]]).double()], 1)
    assert M.overlap_token_advantage_BT(s2, t2, 2)[0, 1].item() == 0.0
    got = M.overlap_token_advantage(s2, t2, 2, torch.ones(1, 2))
    assert got == pytest.approx(expected, rel=1e-12)


def test_support_mass_full_vocab_is_one_and_empty_support_is_zero():
    x = make_logits(2, 3, 13, seed=14, neg_inf=True)[:, :, :]
    x[0, 0, 0] = 1.0  # give the all -inf row one finite logit
    ids = torch.arange(13).expand(2, 3, 13)
    torch.testing.assert_close(M.support_mass_BT(x, ids), torch.ones(2, 3, dtype=torch.float64))
    assert (M.support_mass_BT(x, ids, torch.zeros(2, 3, 13)) == 0).all()
    doubled = torch.cat([ids, ids], -1)  # repeated ids count once
    torch.testing.assert_close(M.support_mass_BT(x, doubled), torch.ones(2, 3, dtype=torch.float64))


# --------------------------------------------------------------------------- masks, NaN, dtypes


def all_scalars(s, t, mask, k=3):
    B, T, V = s.shape
    ids = torch.arange(k).expand(B, T, k)
    sampled = torch.zeros(B, T, dtype=torch.long)
    lp_s, lp_t = torch.log_softmax(s, -1)[..., 0], torch.log_softmax(t, -1)[..., 0]
    return [
        M.topk_overlap_ratio(s, t, k, mask),
        M.overlap_token_advantage(s, t, k, mask),
        M.entropy_gap(s, t, mask),
        M.entropy(s, mask),
        M.support_mass(s, ids, mask),
        M.out_of_support_share(sampled, ids, mask),
        M.negative_reward_share(lp_s, lp_t, mask),
        M.repetition_rate(sampled, mask, ngram=1, min_repeats=2),
    ]


def test_all_masked_gives_zero_and_all_inf_rows_give_no_nan():
    s = make_logits(2, 4, 9, seed=15, neg_inf=True)
    t = make_logits(2, 4, 9, seed=16, neg_inf=True)
    s[1], t[1, 2] = NEG, NEG  # whole sequence / single position with no finite logit
    assert all_scalars(s, t, torch.zeros(2, 4)) == [0.0] * 8
    assert all(math.isfinite(v) for v in all_scalars(s, t, torch.ones(2, 4)))
    ids = torch.arange(3).expand(2, 4, 3)
    zero_on_empty = [
        M.topk_overlap_BT(s, t, 3),
        M.overlap_token_advantage_BT(s, t, 3),
        M.support_mass_BT(s, ids),
        M.entropy_BT(s),
    ]
    for out in zero_on_empty + [M.entropy_gap_BT(s, t)]:
        assert torch.isfinite(out).all()
    for out in zero_on_empty:
        assert (out[1] == 0).all()
    assert (M.entropy_gap_BT(s, t)[1] == M.entropy_BT(t)[1]).all()
    nan_BT = torch.full((2, 4), float("nan"))
    assert M.masked_mean(nan_BT, torch.zeros(2, 4)) == 0.0
    nan_BT[0, 0] = 2.0
    assert M.masked_mean(nan_BT, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])) == 2.0


def test_bool_float_and_int_masks_agree():
    s = make_logits(3, 6, 12, seed=17)
    t = make_logits(3, 6, 12, seed=18, like=s)
    mask = make_mask(3, 6, seed=19)
    ref = all_scalars(s, t, mask)
    assert ref != [0.0] * 8
    assert all_scalars(s, t, mask.float()) == ref
    assert all_scalars(s, t, mask.long()) == ref


def test_dtypes_and_no_grad():
    s64 = make_logits(2, 3, 8, seed=20).requires_grad_()
    t64 = make_logits(2, 3, 8, seed=21)
    assert M.topk_overlap_BT(s64, t64, 2).dtype == torch.float64
    assert M.overlap_token_advantage_BT(s64, t64, 2).dtype == torch.float64
    assert M.entropy_gap_BT(s64, t64).dtype == torch.float64
    assert not M.entropy_BT(s64).requires_grad
    s16, t16 = s64.detach().to(torch.bfloat16), t64.to(torch.bfloat16)
    ids = torch.zeros(2, 3, 1, dtype=torch.long)
    for out in (
        M.topk_overlap_BT(s16, t16, 2),
        M.overlap_token_advantage_BT(s16, t16, 2),
        M.entropy_gap_BT(s16, t16),
        M.support_mass_BT(s16, ids),
    ):
        assert out.dtype == torch.float32
    torch.testing.assert_close(M.entropy_BT(s16), M.entropy_BT(s16.double()).float())


def test_invalid_arguments_raise():
    x = torch.zeros(1, 2, 5)
    for k in (0, 6):
        with pytest.raises(ValueError):
            M.topk_ids(x, k)
    with pytest.raises(ValueError):
        M.topk_overlap_ratio(x, x, 2, torch.ones(2, 1))
    with pytest.raises(ValueError):
        M.topk_overlap_BT(x, torch.zeros(1, 2, 6), 2)
    with pytest.raises(ValueError):
        M.by_position_bucket(torch.zeros(1, 2), torch.ones(1, 2), num_buckets=0)
    with pytest.raises(ValueError):
        M.has_repetition_loop_B(torch.zeros(1, 4).long(), torch.ones(1, 4), min_repeats=1)


# --------------------------------------------------------------------------- by_position_bucket


def test_by_position_bucket_hand_computed():
    values = torch.arange(10.0).view(1, 10)
    means, counts = M.by_position_bucket(values, torch.ones(1, 10), num_buckets=4)
    # Buckets [0, 2.5), [2.5, 5), [5, 7.5), [7.5, 10): t = 0-2 | 3-4 | 5-7 | 8-9.
    assert counts.tolist() == [3, 2, 3, 2]
    assert means.tolist() == [1.0, 3.5, 6.0, 8.5]

    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 0]])
    means, counts = M.by_position_bucket(values, mask, num_buckets=2)
    assert counts.tolist() == [3, 2]  # t=0: 1, 10; t=1: 2 | t=2: 30; t=3: 4
    assert means.tolist() == pytest.approx([13 / 3, 17.0])

    # horizon longer than T: trailing buckets are empty; shorter: positions >= horizon dropped.
    means, counts = M.by_position_bucket(values, mask, num_buckets=4, horizon=8)
    assert counts.tolist() == [3, 2, 0, 0]
    assert means.tolist() == pytest.approx([13 / 3, 17.0, 0.0, 0.0])
    means, counts = M.by_position_bucket(values, mask, num_buckets=2, horizon=2)
    assert counts.tolist() == [2, 1] and means.tolist() == [5.5, 2.0]

    means, counts = M.by_position_bucket(values, torch.zeros(2, 4), num_buckets=3)
    assert counts.tolist() == [0, 0, 0] and means.tolist() == [0.0, 0.0, 0.0]


def test_by_position_bucket_matches_reference():
    g = torch.Generator().manual_seed(22)
    values = torch.randn(3, 13, generator=g, dtype=torch.float64)
    mask = make_mask(3, 13, seed=23)
    for n, horizon in [(1, None), (4, None), (5, 7), (3, 20), (13, None)]:
        H = horizon or 13
        sums, cnts = [0.0] * n, [0] * n
        for b in range(3):
            for t in range(min(13, H)):
                if mask[b, t]:
                    i = next(i for i in range(n) if i * H / n <= t < (i + 1) * H / n)
                    sums[i] += values[b, t].item()
                    cnts[i] += 1
        means, counts = M.by_position_bucket(values, mask, n, horizon)
        assert counts.tolist() == cnts
        expected = torch.tensor([s / c if c else 0.0 for s, c in zip(sums, cnts)]).double()
        torch.testing.assert_close(means, expected)


# --------------------------------------------------------------------------- repetition


def seqs_to_batch(seqs, pad=0):
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    return ids, mask


@pytest.mark.parametrize(
    "seq,n,m,expected",
    [
        ([1, 2, 1, 2, 1, 2], 2, 3, True),  # "a b a b a b"
        ([1, 2, 1, 2, 1, 3], 2, 3, False),
        ([5, 1, 2, 1, 2, 1, 2, 7], 2, 3, True),  # loop in the middle
        ([1, 2, 1, 2, 9, 1, 2], 2, 3, False),  # not consecutive
        ([4] * 12, 4, 3, True),  # period 1 is also a 4-gram loop
        ([4] * 11, 4, 3, False),
        ([1, 2, 3, 4] * 3, 4, 3, True),
        ([1, 2, 3, 4] * 2 + [1, 2, 3], 4, 3, False),
        ([1, 2, 3] * 6, 4, 3, False),  # period 3 does not divide ngram 4
        ([1, 2, 3] * 3, 3, 3, True),
        ([7, 8], 1, 2, False),
        ([7, 7], 1, 2, True),
    ],
)
def test_repetition_hand_written(seq, n, m, expected):
    ids, mask = seqs_to_batch([seq, [9]])  # a padded short neighbour must not matter
    assert M.has_repetition_loop_B(ids, mask, n, m).tolist() == [expected, False]
    assert M.repetition_rate(ids, mask, n, m) == (0.5 if expected else 0.0)


def test_repetition_skips_masked_tokens_and_empty_sequences():
    ids = torch.tensor([[1, 2, 99, 1, 2, 1, 2], [1, 2, 1, 2, 1, 2, 1], [3, 3, 3, 3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1], [0] * 7])
    assert M.has_repetition_loop_B(ids, mask, 2, 3).tolist() == [True, False, False]
    assert M.repetition_rate(ids, mask, 2, 3) == 0.5  # the all-masked sequence is not counted
    assert M.repetition_rate(ids, mask.bool(), 2, 3) == 0.5


def test_repetition_matches_brute_force():
    g = torch.Generator().manual_seed(24)
    ids = torch.randint(0, 2, (40, 15), generator=g)
    mask = torch.rand(40, 15, generator=g) < 0.85
    for n, m in [(1, 3), (2, 3), (3, 2), (4, 3)]:
        kept = [[tok for tok, ok in zip(r, mk) if ok] for r, mk in zip(ids.tolist(), mask.tolist())]
        expected = [ref_has_loop(seq, n, m) for seq in kept]
        assert M.has_repetition_loop_B(ids, mask, n, m).tolist() == expected
        assert 0 < sum(expected) < 40 or (n, m) == (4, 3)
        assert M.repetition_rate(ids, mask, n, m) == pytest.approx(sum(expected) / 40)


# --------------------------------------------------------------------------- tail mass, format tokens


def ref_tail_mass(row_logits, k):
    """1 - the mass of the top-k (ties to the lower id), from a full row: the reference the top-K
    log-probs alone must reproduce."""
    lp = ref_log_softmax(row_logits)
    return 1.0 - sum(math.exp(lp[v]) for v in ref_topk_set(row_logits, k))


@pytest.mark.parametrize("shape,k", [((2, 3, 7), 3), ((1, 5, 4), 4), ((3, 1, 9), 1)])
def test_tail_mass_from_topk_logprobs_matches_full_row_reference(shape, k):
    g = torch.Generator().manual_seed(sum(shape) + k)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
    x[0, 0, 0] = NEG  # a token of probability 0
    x[..., 1] = x[..., 2]  # ties
    topk_lp = torch.log_softmax(x, -1).topk(k, dim=-1).values
    mask = torch.rand(shape[:2], generator=g) > 0.3
    mask[0, 0] = True
    expected = [[ref_tail_mass(x[b, t].tolist(), k) for t in range(shape[1])] for b in range(shape[0])]
    got = M.tail_mass_BT(topk_lp, mask)
    want = torch.tensor(expected, dtype=torch.float64) * mask
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    mean = sum(e for row, mrow in zip(expected, mask.tolist()) for e, m in zip(row, mrow) if m) / int(mask.sum())
    assert M.tail_mass(topk_lp, mask) == pytest.approx(mean, rel=1e-9)


def test_tail_mass_edge_cases():
    # the whole vocabulary as the top-K: no tail, even where rounding sums past 1; -inf padding adds nothing
    full = torch.log_softmax(torch.tensor([[[0.3, 0.3, -1.0]]], dtype=torch.float64), -1)
    assert M.tail_mass_BT(full).item() == pytest.approx(0.0, abs=1e-15)
    assert M.tail_mass_BT(full + 1e-12).item() == 0.0
    padded = torch.tensor([[[math.log(0.5), NEG, NEG]]])
    assert M.tail_mass_BT(padded).item() == pytest.approx(0.5)
    assert M.tail_mass(padded, torch.zeros(1, 1, dtype=torch.bool)) == 0.0  # all masked


def ref_format_share(ids, mask, fmt):
    """Segments = maximal runs of unmasked positions within a row, found by walking each row."""
    hits = segments = 0
    for row, mrow in zip(ids, mask):
        inside, has = False, False
        for tok, m in zip([*row, None], [*mrow, False]):
            if m and not inside:
                inside, has = True, False
            if m:
                has |= tok in fmt
            if not m and inside:
                segments, hits, inside = segments + 1, hits + has, False
    return hits, segments


def test_format_token_share_counts_segments_like_a_walk():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (4, 11), generator=g)
    mask = torch.rand(4, 11, generator=g) > 0.4
    mask[1] = True  # one segment spanning the row
    mask[2] = False  # no segment
    for fmt in ([4], [0, 5], [], [9]):
        assert M.format_token_share(ids, mask, fmt) == ref_format_share(ids.tolist(), mask.tolist(), set(fmt))
    # a format token in the masked gap between two actions counts for neither
    ids = torch.tensor([[1, 2, 7, 3, 7]])
    mask = torch.tensor([[True, True, False, True, True]])
    assert M.format_token_share(ids, mask, [7]) == (1, 2)
