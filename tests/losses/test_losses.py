"""opd.losses against the float64 loop reference in tests/reference.py (values and gradients).

Covers odd shapes, masks (random, an all-masked row, an all-masked batch), ties, -inf logits,
variable-size supports, every support kind, chunked == unchunked, from-hidden == from-logits,
dtypes (float64 tight; float32 / bfloat16 / float16 with their own tolerances) and bad inputs.
Every float64 case is also run at low precision on one shape, see `cases`. The inputs and the checks
every loss meets are in tests/loss_checks.py.

Run: python -m pytest tests/losses/test_losses.py -q
"""

import math

import pytest
import reference as R
import torch
from loss_checks import (
    BF16,
    F16,
    F32,
    F64,
    OUT_DTYPE,
    D,
    check_grad,
    check_masked_exact,
    check_support_loss_from_hidden,
    check_teacher_constant,
    close,
    distinct_ids,
    fresh,
    gen,
    grads,
    hidden_inputs,
    lsm_inputs,
    make_mask,
    make_support_mask,
    randn,
)

import opd.losses as L
import opd.losses._row_kernels as RK

SHAPES = [(1, 1, 5, 1), (3, 7, 47, 4), (2, 5, 31, 31)]  # B, T, V, K (the last has K = V)
MASKS = ["random", "row", "none"]  # "row": sequence 0 fully masked; "none": whole batch masked
LOW = [F32, BF16, F16]


def cases(shapes=SHAPES, masks=MASKS, low=LOW):
    """(shape, mask_kind, dtype): float64 on every shape and mask, low precision on one."""
    return [(s, m, F64) for s in shapes for m in masks] + [(shapes[1], "row", d) for d in low]


# ---------------------------------------------------------------- reference self-check


def _fd_cases():
    g = gen(0)
    B, T, V, K = 2, 3, 7, 3
    zs, zt = randn((B, T, V), g, 2.0), randn((B, T, V), g, 2.0)
    ids = distinct_ids(B, T, K, V, g)
    zs[0, 1, ids[0, 1, 0]] = -math.inf  # a support slot where the student is -inf
    zs[1, 0, 0] = -math.inf
    tlp = R.ref_log_softmax(zt).gather(-1, ids)
    tlp[1, 2, 1] = -math.inf
    mask = torch.tensor([[True, True, False], [True, True, True]])
    lp, adv = randn((B, T), g) - 1.0, randn((B, T), g)
    old = lp + randn((B, T), g, 0.3)
    h, w = randn((B, T, 4), g), randn((V, 4), g)
    ids_bt, gout = torch.randint(0, V, (B, T), generator=g), randn((B, T), g)

    def via_hidden(hh, ww, which):
        val, gl = R.ref_gather_logprobs(R.ref_logits(hh, ww), ids_bt, gout)
        return val, R.ref_hidden_grads(hh, ww, gl)[which]

    cases = {
        "gather": (zt, lambda x: R.ref_gather_logprobs(x, ids_bt, gout)),
        "pg_clip": (lp, lambda x: R.ref_sampled_token_pg_loss(x, adv, mask, old, 0.2, gout)),
        "hidden": (h, lambda x: via_hidden(x, w, 0)),
        "weight": (w, lambda x: via_hidden(h, x, 1)),
    }
    for ren in (True, False):
        cases[f"lsm_{ren}"] = (zs, lambda x, ren=ren: R.ref_local_support_kl(x, ids, tlp, mask, ren, None, gout))
    cases["lsm_forward_0.3"] = (zs, lambda x: R.ref_local_support_kl(x, ids, tlp, mask, True, None, gout, 0.3))
    for d in ("reverse", "forward"):  # forward KL needs p > 0 wherever q > 0
        x0 = zs if d == "reverse" else zs.clamp(min=-30)
        cases[d] = (x0, lambda x, d=d: R.ref_full_vocab_kl(x, zt, mask, d, gout))
    for beta in (0.0, 0.3, 1.0):
        x0 = zs if beta else zs.clamp(min=-30)
        cases[f"jsd_{beta}"] = (x0, lambda x, b=beta: R.ref_generalized_jsd(x, zt, mask, b, gout))
    # Truncated sums: teacher -inf where the student has mass (reverse) and student -inf where
    # the teacher has mass (forward, zs as it is): those infinite terms are left out.
    zt_ban = zt.clone()
    zt_ban[0, 0, 2] = zt_ban[1, 1, 4] = -math.inf
    cases["reverse_trunc"] = (zs, lambda x: R.ref_full_vocab_kl(x, zt_ban, mask, "reverse", gout))
    cases["forward_trunc"] = (zs, lambda x: R.ref_full_vocab_kl(x, zt, mask, "forward", gout))
    return cases, gout


@pytest.mark.parametrize(
    "case",
    [
        "lsm_True",
        "lsm_False",
        "lsm_forward_0.3",
        "reverse",
        "forward",
        "jsd_0.0",
        "jsd_0.3",
        "jsd_1.0",
        "gather",
        "pg_clip",
        "hidden",
        "weight",
        "reverse_trunc",
        "forward_trunc",
    ],
)
def test_reference_gradients_match_finite_differences(case):
    cases, gout = _fd_cases()
    x, fn = cases[case]
    analytic = fn(x)[1]
    numeric = R.finite_diff(lambda y: fn(y)[0], x, gout)
    torch.testing.assert_close(analytic, numeric, rtol=1e-5, atol=1e-7)
    assert (analytic[~torch.isfinite(x)] == 0).all()


# ---------------------------------------------------------------- teacher_topk


def check_topk(ids, lps, logits, k, dtype):
    """Tie-aware: the sorted values match, and each returned id carries its own log-prob."""
    ref_ids, ref_lps = R.ref_teacher_topk(logits, k)
    assert ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    assert lps.dtype == OUT_DTYPE[dtype] and lps.shape == ref_lps.shape
    close(lps, ref_lps, dtype, "top-k log-prob values")
    assert (lps[..., :-1] >= lps[..., 1:]).all(), "not sorted descending"
    assert ((ids >= 0) & (ids < logits.shape[-1])).all()
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all(), "repeated id in a top-k list"
    close(lps, R.ref_log_softmax(logits).gather(-1, ids), dtype, "returned ids' log-probs")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [F64] + LOW)
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 1000])
def test_teacher_topk(shape, dtype, chunk_size):
    B, T, V, K = shape
    logits = randn((B, T, V), gen(1), 3.0, dtype)
    ids, lps = L.teacher_topk(logits, K, chunk_size=chunk_size)
    check_topk(ids, lps, logits.to(F64), K, dtype)


@pytest.mark.parametrize("dtype", [F64, BF16])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_teacher_topk_ties(dtype, k):
    logits = torch.randint(0, 3, (3, 5, 6), generator=gen(2)).to(dtype)  # many exact ties
    for chunk in (None, 2):
        ids, lps = L.teacher_topk(logits, k, chunk_size=chunk)
        check_topk(ids, lps, logits.to(F64), k, dtype)


def test_teacher_topk_neg_inf():
    logits = randn((2, 3, 6), gen(3), 2.0)
    logits[0, 0, :4] = -math.inf  # only 2 finite entries, k = 4 reaches into -inf
    logits[1, 2, 5] = -math.inf
    ids, lps = L.teacher_topk(logits, 4)
    check_topk(ids, lps, logits, 4, F64)
    assert torch.isinf(lps[0, 0, 2:]).all() and torch.isfinite(lps[0, 0, :2]).all()


# ---------------------------------------------------------------- local_support_kl


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(low=LOW + ["bf16+fp32"]))
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("support", [None, "prefix", "random"])
def test_local_support_kl(shape, mask_kind, dtype, renormalize, support):
    """'bf16+fp32': bf16 student logits with the float32 log-probs teacher_topk returns."""
    tdtype = F32 if dtype == "bf16+fp32" else dtype
    dtype = BF16 if dtype == "bf16+fp32" else dtype
    zs, ids, tlp, mask, sm, gout = lsm_inputs(shape, 5, dtype, support, mask_kind)
    zs, tlp = zs.requires_grad_(True), tlp.to(tdtype).requires_grad_(True)
    out = L.local_support_kl(zs, ids, tlp, mask, renormalize=renormalize, support_mask=sm)
    ref, ref_g = R.ref_local_support_kl(zs, ids, tlp, mask, renormalize, sm, gout)
    assert out.shape == mask.shape and out.dtype == OUT_DTYPE[dtype]
    close(out, ref, dtype, "value")
    g, gt = grads(out, [zs, tlp], gout)
    check_teacher_constant(gt)
    check_grad(g, ref_g, zs, dtype, "grad student")
    check_masked_exact(out, g, mask)


def _neg_inf_case(renormalize):
    g = gen(8)
    B, T, V, K = 2, 4, 7, 3
    zs, zt = randn((B, T, V), g, 2.0), randn((B, T, V), g, 2.0)
    ids = distinct_ids(B, T, K, V, g)
    tlp = R.ref_log_softmax(zt).gather(-1, ids)

    def student_inf(b, t, slots):
        zs[b, t, ids[b, t, slots]] = -math.inf

    student_inf(0, 0, [1])  # one student -inf slot
    tlp[0, 1, 2] = -math.inf  # one teacher -inf slot: dropped
    student_inf(0, 2, [0, 1, 2])  # student -inf on every slot -> 0
    tlp[0, 3] = -math.inf  # no valid slot -> 0
    keep = [v for v in range(V) if v not in ids[1, 0].tolist()][0]
    zs[1, 0] = -math.inf  # renormalize: whole student row -inf -> 0
    if not renormalize:  # full softmax: one non-support entry finite, p = 0 on every slot -> 0
        zs[1, 0, keep] = 1.0
    student_inf(1, 1, [0])
    tlp[1, 1, 2] = -math.inf  # student -inf on one slot, teacher -inf on another
    student_inf(1, 2, [1])
    tlp[1, 2, 1] = -math.inf  # both -inf on the same slot
    sm = torch.ones(B, T, K, dtype=torch.bool)
    student_inf(1, 3, [0, 1])
    sm[1, 3, 2] = False  # the only finite student slot is masked out -> 0
    return zs, ids, tlp, torch.ones(B, T, dtype=torch.bool), sm, randn((B, T), g)


@pytest.mark.parametrize("renormalize,share", [(True, 0.0), (False, 0.0), (True, 0.4)])
@pytest.mark.parametrize("dtype", [F64, F32, BF16])
def test_local_support_kl_neg_inf(renormalize, share, dtype):
    """-inf student or teacher slots, rows with nothing to compare: finite, the reference's, 0 where empty
    (``share``: with forward KL mixed in, whose term at a student -inf slot is left out)."""
    zs, ids, tlp, mask, sm, gout = _neg_inf_case(renormalize)
    zs, tlp = zs.to(dtype).requires_grad_(True), tlp.to(dtype)
    out = L.local_support_kl(zs, ids, tlp, mask, renormalize=renormalize, support_mask=sm, forward_share=share)
    ref, ref_g = R.ref_local_support_kl(zs, ids, tlp, mask, renormalize, sm, gout, share)
    assert torch.isfinite(out).all(), out
    close(out, ref, dtype, "value")
    (g,) = grads(out, [zs], gout)
    check_grad(g, ref_g, zs, dtype, "grad student")
    for b, t in [(0, 2), (0, 3), (1, 0), (1, 3)]:
        assert out[b, t].item() == 0.0 and (g[b, t] == 0).all(), (b, t)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(low=LOW))
@pytest.mark.parametrize("share", [0.25, 1.0])
@pytest.mark.parametrize("support", [None, "random"])
def test_local_support_kl_forward_share(shape, mask_kind, dtype, share, support):
    """(1 - b) reverse + b forward KL on the renormalized support, values and gradients."""
    zs, ids, tlp, mask, sm, gout = lsm_inputs(shape, 15, dtype, support, mask_kind)
    zs, tlp = zs.requires_grad_(True), tlp.requires_grad_(True)
    out = L.local_support_kl(zs, ids, tlp, mask, support_mask=sm, forward_share=share)
    ref, ref_g = R.ref_local_support_kl(zs, ids, tlp, mask, True, sm, gout, share)
    close(out, ref, dtype, "value")
    g, gt = grads(out, [zs, tlp], gout)
    check_teacher_constant(gt)
    check_grad(g, ref_g, zs, dtype, "grad student")
    check_masked_exact(out, g, mask)


@pytest.mark.parametrize("shape", [(1, 1, 5, 5), (3, 4, 7, 7)])
def test_forward_share_one_with_k_equal_v_is_full_forward_kl(shape):
    B, T, V, K = shape
    g = gen(16)
    zs, zt = randn((B, T, V), g, 2.0).requires_grad_(True), randn((B, T, V), g, 2.0)
    ids = torch.stack([torch.randperm(V, generator=g) for _ in range(B * T)]).view(B, T, V)
    tlp = R.ref_log_softmax(zt).gather(-1, ids)
    mask = make_mask(B, T, "random", g)
    out = L.local_support_kl(zs, ids, tlp, mask, forward_share=1.0)
    ref, _ = R.ref_full_vocab_kl(zs, zt, mask, "forward")
    close(out, ref, F64, "value")


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(masks=["row", "none"], low=[F32]))
@pytest.mark.parametrize("chunk_size", [1, 1000])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "gather"])
def test_local_support_kl_from_hidden_forward_share(shape, mask_kind, dtype, chunk_size, fused, monkeypatch):
    row_dots_path(monkeypatch, fused)
    h, w, ids, tlp, mask, sm, gout = hidden_inputs(shape, 17, dtype, False, mask_kind)
    out = L.local_support_kl_from_hidden(
        h, w, ids, tlp, mask, support_mask=sm, chunk_size=chunk_size, forward_share=0.3
    )
    ref, ref_gl = R.ref_local_support_kl(R.ref_logits(h, w), ids, tlp, mask, True, sm, gout, 0.3)
    ref_gh, ref_gw = R.ref_hidden_grads(h, w, ref_gl)
    check_support_loss_from_hidden(out, ref, ref_gh, ref_gw, h, w, tlp, mask, gout, dtype)


def test_forward_share_needs_the_renormalized_support():
    zs, ids, tlp, mask, sm, _ = lsm_inputs((2, 3, 7, 3), 18)
    with pytest.raises(ValueError, match="renormalize=True"):
        L.local_support_kl(zs, ids, tlp, mask, renormalize=False, forward_share=0.5)
    h, w, ids, tlp, mask, sm, _ = hidden_inputs((2, 3, 7, 3), 18, F64)
    with pytest.raises(ValueError, match="renormalize=True"):
        L.local_support_kl_from_hidden(h, w, ids, tlp, mask, sm, forward_share=0.5, renormalize=False)


@pytest.mark.parametrize("shape", [(1, 1, 5, 5), (3, 4, 7, 7), (2, 5, 31, 31)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_lsm_with_k_equal_v_is_full_reverse_kl(shape, renormalize):
    B, T, V, _ = shape
    g = gen(10)
    zs = randn((B, T, V), g, 2.0).requires_grad_(True)
    zt, mask, gout = randn((B, T, V), g, 2.0), make_mask(B, T, "random", g), randn((B, T), g)
    ids, tlp = L.teacher_topk(zt, V)
    out = L.local_support_kl(zs, ids, tlp, mask, renormalize=renormalize)
    full = L.full_vocab_kl(zs, zt, mask, direction="reverse")
    close(out, full, F64)
    close(out, R.ref_full_vocab_kl(zs, zt, mask, "reverse")[0], F64)
    close(grads(out, [zs], gout)[0], grads(full, [zs], gout)[0], F64)


@pytest.mark.parametrize("kind", list(L.SUPPORT_KINDS))
def test_lsm_zero_when_student_equals_teacher(kind):
    B, T, V, K = 3, 5, 11, 4
    g = gen(11)
    zt = randn((B, T, V), g, 2.0)
    zs = (zt + randn((B, T, 1), g, 5.0)).requires_grad_(True)  # same softmax, shifted logits
    mask = make_mask(B, T, "all", g)
    tids, sids = R.ref_teacher_topk(zt, K)[0], R.ref_teacher_topk(zs, K)[0]
    ids, sm = L.build_support(kind, tids, sids, torch.randint(0, V, (B, T), generator=g))
    tlp = R.ref_log_softmax(zt).gather(-1, ids)
    for ren in (True, False):
        out = L.local_support_kl(zs, ids, tlp, mask, renormalize=ren, support_mask=sm)
        close(out, torch.zeros(B, T, dtype=F64), F64, f"renormalize={ren}")
    out = L.local_support_kl(zs, ids, tlp, mask, renormalize=True, support_mask=sm)
    close(grads(out, [zs], torch.ones(B, T))[0], torch.zeros(B, T, V, dtype=F64), F64)


# ---------------------------------------------------------------- from hidden


def row_dots_path(monkeypatch, fused):
    """Force the private-kernel path (fused) or the public fallback; record which one ran."""
    real_op, real_gather = RK.row_dots_kernel(), RK.gathered_support_logits
    assert real_op is not None, "the private row-dot kernel failed its probe on this torch"
    calls = {"fused": False, "gather": False}

    def op(*args):
        calls["fused"] = True
        return real_op(*args)

    def gather(*args):
        calls["gather"] = True
        return real_gather(*args)

    monkeypatch.setattr(RK, "row_dots_kernel", lambda: op if fused else None)
    monkeypatch.setattr(RK, "gathered_support_logits", gather)
    return calls


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(masks=["row", "none"], low=[F32, BF16]))
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("shared_ids", [False, True])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "gather"])
def test_local_support_kl_from_hidden(shape, mask_kind, dtype, chunk_size, shared_ids, fused, monkeypatch):
    calls = row_dots_path(monkeypatch, fused)
    h, w, ids, tlp, mask, sm, gout = hidden_inputs(shape, 12, dtype, shared_ids, mask_kind)
    out = L.local_support_kl_from_hidden(h, w, ids, tlp, mask, support_mask=sm, chunk_size=chunk_size)
    if mask.any():  # the path under test is the one that ran
        took_fused = fused and dtype in (F64, F32)  # the private kernel needs one dtype throughout
        assert calls == {"fused": took_fused, "gather": not took_fused}, calls
    assert out.dtype == OUT_DTYPE[dtype] and out.shape == mask.shape
    ref, ref_gl = R.ref_local_support_kl(R.ref_logits(h, w), ids, tlp, mask, True, sm, gout)
    ref_gh, ref_gw = R.ref_hidden_grads(h, w, ref_gl)
    gh, gw = check_support_loss_from_hidden(out, ref, ref_gh, ref_gw, h, w, tlp, mask, gout, dtype)
    if dtype == F64:  # same as building the logits
        h2, w2 = fresh(h, w)
        out2 = L.local_support_kl(h2 @ w2.T, ids, tlp, mask, renormalize=True, support_mask=sm)
        close(out, out2, F64)
        for a, b in zip((gh, gw), grads(out2, [h2, w2], gout)):
            close(a, b, F64)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(low=[F32, BF16]))
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_truncated_local_support_kl_from_hidden(shape, mask_kind, dtype, chunk_size):
    """The --no-renormalize ablation from hidden states (its normalizer a chunk of positions at a time): the
    reference's values and gradients, and in float64 the same as building the logits."""
    h, w, ids, tlp, mask, sm, gout = hidden_inputs(shape, 19, dtype, mask_kind=mask_kind)
    out = L.local_support_kl_from_hidden(h, w, ids, tlp, mask, sm, chunk_size=chunk_size, renormalize=False)
    assert out.dtype == OUT_DTYPE[dtype] and out.shape == mask.shape
    ref, ref_gl = R.ref_local_support_kl(R.ref_logits(h, w), ids, tlp, mask, False, sm, gout)
    ref_gh, ref_gw = R.ref_hidden_grads(h, w, ref_gl)
    gh, gw = check_support_loss_from_hidden(out, ref, ref_gh, ref_gw, h, w, tlp, mask, gout, dtype)
    if dtype == F64:
        h2, w2 = fresh(h, w)
        out2 = L.local_support_kl(h2 @ w2.T, ids, tlp, mask, renormalize=False, support_mask=sm)
        close(out, out2, F64)
        for a, b in zip((gh, gw), grads(out2, [h2, w2], gout)):
            close(a, b, F64)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(masks=["all"], low=[F32, BF16]))
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_token_logprobs_and_topk_from_hidden(shape, mask_kind, dtype, chunk_size):
    B, T, V, K = shape
    g = gen(14)
    h = randn((B, T, D), g, 1.0, dtype).requires_grad_(True)
    w = randn((V, D), g, 0.7, dtype).requires_grad_(True)
    ids = torch.randint(0, min(V, 3), (B, T), generator=g)  # ids repeat across positions
    gout = randn((B, T), g)
    logits = R.ref_logits(h, w)
    out = L.token_logprobs_from_hidden(h, w, ids, chunk_size=chunk_size)
    assert out.dtype == OUT_DTYPE[dtype] and out.shape == (B, T)
    ref, ref_gl = R.ref_gather_logprobs(logits, ids, gout)
    ref_gh, ref_gw = R.ref_hidden_grads(h, w, ref_gl)
    close(out, ref, dtype, "value")
    gh, gw = grads(out, [h, w], gout)
    check_grad(gh, ref_gh, h, dtype, "grad hidden")
    check_grad(gw, ref_gw, w, dtype, "grad weight")
    tids, tlps = L.topk_from_hidden(h, w, K, chunk_size=chunk_size)
    assert not tlps.requires_grad, "topk_from_hidden must not build a graph"
    if dtype == F64:
        check_topk(tids, tlps, logits, K, dtype)
        h2, w2 = fresh(h, w)
        ids2, lps2 = L.teacher_topk(h2.detach() @ w2.detach().T, K)
        assert torch.equal(tids, ids2)
        close(tlps, lps2, dtype)
        out2 = L.gather_logprobs(h2 @ w2.T, ids)
        close(out, out2, F64)
        for a, b in zip((gh, gw), grads(out2, [h2, w2], gout)):
            close(a, b, F64)
    else:  # low-precision logits may reorder near-ties: compare values only
        assert tlps.dtype == F32
        close(tlps, R.ref_teacher_topk(logits, K)[1], dtype)
        close(tlps, R.ref_log_softmax(logits).gather(-1, tids), dtype)


@pytest.mark.parametrize("which", ["hidden", "weight"])
@pytest.mark.parametrize("chunk_size", [1, 4])
def test_token_logprobs_from_hidden_masked_rows_and_one_input(which, chunk_size):
    # Masked positions reach the backward as zero upstream gradients (skipped rows); only one of
    # hidden / weight may require a gradient (a frozen head, or a detached hidden state).
    B, T, V = 3, 5, 13
    g = gen(41)
    h, w = randn((B, T, D), g), randn((V, D), g, 0.7)
    (h if which == "hidden" else w).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    gout = randn((B, T), g) * make_mask(B, T, "row", g)
    out = L.token_logprobs_from_hidden(h, w, ids, chunk_size=chunk_size)
    ref, ref_gl = R.ref_gather_logprobs(R.ref_logits(h, w), ids, gout)
    close(out, ref, F64, "value")
    ref_gh, ref_gw = R.ref_hidden_grads(h, w, ref_gl)
    x, ref_g = (h, ref_gh) if which == "hidden" else (w, ref_gw)
    (got,) = torch.autograd.grad(out, [x], grad_outputs=gout)
    check_grad(got, ref_g, x, F64, f"grad {which}")
    if which == "hidden":
        assert (got[0] == 0).all(), "a fully masked row must get exactly zero gradient"


@pytest.mark.parametrize("chunk_size", [2, 5, 10_000])
def test_from_hidden_chunk_sizes_agree(chunk_size):
    h, w, ids, tlp, mask, sm, gout = hidden_inputs((3, 7, 47, 4), 26, F64)
    a = L.local_support_kl_from_hidden(h, w, ids, tlp, mask, support_mask=sm, chunk_size=1)
    b = L.local_support_kl_from_hidden(h, w, ids, tlp, mask, support_mask=sm, chunk_size=chunk_size)
    close(b, a, F64)
    for x, y in zip(grads(b, [h, w], gout), grads(a, [h, w], gout)):
        close(x, y, F64)
    t1 = L.token_logprobs_from_hidden(h, w, ids[..., 0], chunk_size=1)
    t2 = L.token_logprobs_from_hidden(h, w, ids[..., 0], chunk_size=chunk_size)
    close(t2, t1, F64)
    for x, y in zip(grads(t2, [h, w], gout), grads(t1, [h, w], gout)):
        close(x, y, F64)
    i1, l1 = L.topk_from_hidden(h, w, 4, chunk_size=1)
    i2, l2 = L.topk_from_hidden(h, w, 4, chunk_size=chunk_size)
    assert torch.equal(i1, i2)
    close(l2, l1, F64)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(masks=["all"]))
def test_gather_logprobs(shape, mask_kind, dtype):
    B, T, V, _ = shape
    g = gen(15)
    z = randn((B, T, V), g, 2.0, dtype).requires_grad_(True)
    ids, gout = torch.randint(0, V, (B, T), generator=g), randn((B, T), g)
    out = L.gather_logprobs(z, ids)
    assert out.dtype == OUT_DTYPE[dtype]
    ref, ref_g = R.ref_gather_logprobs(z, ids, gout)
    close(out, ref, dtype)
    check_grad(grads(out, [z], gout)[0], ref_g, z, dtype, "grad logits")


# ---------------------------------------------------------------- build_support


@pytest.mark.parametrize("shape", SHAPES + [(2, 6, 9, 3)])
@pytest.mark.parametrize("kind", list(L.SUPPORT_KINDS))
def test_build_support(shape, kind):
    assert set(L.SUPPORT_KINDS) == {
        "teacher_topk",
        "student_topk",
        "union",
        "intersection",
        "teacher_topk_plus_sampled",
        "symmetric_difference",
    }
    B, T, V, K = shape
    g = gen(16)
    tids, sids = distinct_ids(B, T, K, V, g), distinct_ids(B, T, K, V, g)
    sids[0, 0] = tids[0, 0].flip(-1)  # same set, other order
    sampled = torch.randint(0, V, (B, T), generator=g)
    sampled[0, 0] = tids[0, 0, -1]  # sampled token inside the teacher's top-K
    ids, sm = L.build_support(kind, tids, sids, sampled)
    ref_ids, ref_valid = R.ref_build_support(kind, tids, sids, sampled)
    assert ids.dtype == torch.int64 and ids.shape == ref_ids.shape and sm.shape == ids.shape
    assert torch.equal(ids, ref_ids), "ids must be the spec's concatenation"
    assert torch.equal(sm.bool(), ref_valid), "validity"
    assert ((ids >= 0) & (ids < V)).all(), "every slot holds a real vocab id"
    for row, ok in zip(ids.view(-1, ids.shape[-1]).tolist(), sm.bool().view(-1, ids.shape[-1])):
        valid_ids = [v for v, o in zip(row, ok.tolist()) if o]
        assert len(valid_ids) == len(set(valid_ids)), "repeated id on valid slots"


def test_build_support_expected_validity_by_hand():
    t, s, samp = torch.tensor([[[3, 1, 4]]]), torch.tensor([[[1, 5, 9]]]), torch.tensor([[4]])
    expect = {
        "teacher_topk": ([3, 1, 4], [1, 1, 1]),
        "student_topk": ([1, 5, 9], [1, 1, 1]),
        "union": ([3, 1, 4, 1, 5, 9], [1, 1, 1, 0, 1, 1]),
        "intersection": ([3, 1, 4], [0, 1, 0]),
        "symmetric_difference": ([3, 1, 4, 1, 5, 9], [1, 0, 1, 0, 1, 1]),
        "teacher_topk_plus_sampled": ([3, 1, 4, 4], [1, 1, 1, 0]),
    }
    for kind, (eids, evalid) in expect.items():
        ids, sm = L.build_support(kind, t, s, samp)
        assert ids[0, 0].tolist() == eids, kind
        assert sm[0, 0].bool().tolist() == [bool(v) for v in evalid], kind


@pytest.mark.parametrize(
    "kind", ["nonsense", "student_topk", "union", "intersection", "symmetric_difference", "teacher_topk_plus_sampled"]
)
def test_build_support_errors(kind):
    """Unknown kind, or a kind whose required input is missing: ValueError naming the kind."""
    with pytest.raises(ValueError, match=kind):
        L.build_support(kind, torch.tensor([[[0, 1]]]), None, None)


# ---------------------------------------------------------------- sampled-token OPD


def test_advantages_masked_gap_by_hand():
    s = torch.zeros(1, 4, dtype=F64)
    q = torch.tensor([[1.0, 10.0, 2.0, 3.0]], dtype=F64)
    m = torch.tensor([[True, False, True, True]])
    out = L.sampled_token_advantages(s, q, m, gamma=0.5)
    # A_0 = 1 + 0.5**2 * 2 + 0.5**3 * 3: distance counted in positions, the gap included
    close(out, torch.tensor([[1.875, 0.0, 3.5, 3.0]], dtype=F64), F64)


BTS = [(1, 1), (3, 7), (2, 5)]


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(BTS, MASKS + ["all"], [F32, BF16]))
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 1.0])
def test_sampled_token_advantages(shape, mask_kind, dtype, gamma):
    B, T = shape[:2]
    g = gen(17)
    s = (randn((B, T), g) - 1.0).to(dtype).requires_grad_(True)
    q = (randn((B, T), g) - 1.0).to(dtype)
    mask = make_mask(B, T, mask_kind, g)
    out = L.sampled_token_advantages(s, q, mask, gamma=gamma)
    assert not out.requires_grad, "advantages must be detached"
    assert out.dtype == OUT_DTYPE[dtype]
    close(out, R.ref_sampled_token_advantages(s, q, mask, gamma), dtype)
    assert (out[~mask] == 0).all()


def interleaved_masks(B, T, g):
    """An action mask of turns separated by environment tokens (runs of random lengths, a row with
    no action at all) and a loss mask inside it that also drops some action tokens (special tokens)."""
    action = torch.zeros(B, T, dtype=torch.bool)
    for b in range(1, B):
        t, writing = 0, True
        while t < T:
            n = int(torch.randint(1, 5, (1,), generator=g))
            action[b, t : t + n] = writing
            t, writing = t + n, not writing
    loss = action & (torch.rand(B, T, generator=g) < 0.8)
    return action, loss


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (4, 13), (5, 2)])
@pytest.mark.parametrize("dtype", [F64, F32, BF16])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 1.0])
def test_sampled_token_advantages_count_distance_in_action_tokens(shape, dtype, gamma):
    """Multi-turn episodes: the discount skips environment tokens; values against the float64 loop
    reference, and the policy gradient (-A at each trained position, 0 elsewhere)."""
    B, T = shape
    g = gen(18 + T)
    s = (randn((B, T), g) - 1.0).to(dtype).requires_grad_(True)
    q = (randn((B, T), g) - 1.0).to(dtype)
    action, mask = interleaved_masks(B, T, g)
    out = L.sampled_token_advantages(s, q, mask, gamma=gamma, action_mask_BT=action)
    assert not out.requires_grad and out.dtype == OUT_DTYPE[dtype]
    ref = R.ref_sampled_token_advantages(s, q, mask, gamma, action)
    close(out, ref, dtype)
    assert (out[~mask] == 0).all()
    loss = L.sampled_token_pg_loss(s, out, mask)
    gout = randn((B, T), g)
    (gl,) = grads(loss, [s], gout)
    ref_loss, ref_g = R.ref_sampled_token_pg_loss(s, ref, mask, gout_BT=gout)
    close(loss, ref_loss, dtype, "value")
    check_grad(gl, ref_g, s, dtype, "grad logprobs")
    check_masked_exact(loss, gl, mask)


def test_advantages_skip_environment_tokens_by_hand():
    s = torch.zeros(1, 6, dtype=F64)
    q = torch.tensor([[1.0, 2.0, 100.0, 100.0, 3.0, 4.0]], dtype=F64)
    action = torch.tensor([[True, True, False, False, True, True]])
    mask = action & torch.tensor([[True, False, True, True, True, True]])  # position 1: EOS, not trained
    out = L.sampled_token_advantages(s, q, mask, gamma=0.5, action_mask_BT=action)
    # A_0 = 1 + 0.5**2 * 3 + 0.5**3 * 4: the EOS counts one step, the two observation tokens none
    close(out, torch.tensor([[1.0 + 0.75 + 0.5, 0.0, 0.0, 0.0, 3.0 + 2.0, 4.0]], dtype=F64), F64)


def test_advantages_with_a_prefix_action_mask_are_the_positional_ones():
    """Single-turn rollouts: the action mask is a prefix, so counting in action tokens changes nothing."""
    g = gen(20)
    s, q = randn((4, 9), g), randn((4, 9), g)
    lengths = [9, 4, 0, 6]
    action = torch.tensor([[t < n for t in range(9)] for n in lengths])
    mask = action & (torch.rand(4, 9, generator=g) < 0.8)
    for gamma in (0.3, 1.0):
        plain = L.sampled_token_advantages(s, q, mask, gamma=gamma)
        assert torch.equal(L.sampled_token_advantages(s, q, mask, gamma=gamma, action_mask_BT=action), plain)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases(BTS, MASKS, [F32, BF16]))
@pytest.mark.parametrize("use_old", [False, True])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_sampled_token_pg_loss(shape, mask_kind, dtype, use_old, clip_eps):
    BT = shape[:2]
    g = gen(19)
    lp = (randn(BT, g) - 1.0).to(dtype).requires_grad_(True)
    adv, gout = randn(BT, g, 1.0, dtype), randn(BT, g)
    old = (lp.detach().to(F64) + randn(BT, g, 0.4)).to(dtype) if use_old else None
    mask = make_mask(*BT, mask_kind, g)
    out = L.sampled_token_pg_loss(lp, adv, mask, old, clip_eps=clip_eps)
    ref, ref_g = R.ref_sampled_token_pg_loss(lp, adv, mask, old, clip_eps, gout)
    assert out.dtype == OUT_DTYPE[dtype]
    close(out, ref, dtype, "value")
    (gl,) = grads(out, [lp], gout)
    check_grad(gl, ref_g, lp, dtype, "grad logprobs")
    check_masked_exact(out, gl, mask)
    if not use_old:  # on-policy: ratio == 1, loss = -A (and d loss / d logp = -A)
        close(out, torch.where(mask, -adv.to(F64), 0.0), dtype)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases())
@pytest.mark.parametrize("cap", [1.0, 2.0, math.inf])
def test_truncated_importance_weight(shape, mask_kind, dtype, cap):
    BT = shape[:2]
    g = gen(23)
    pol = (randn(BT, g) - 1.0).to(dtype).requires_grad_(True)
    beh = (pol.detach().to(F64) + randn(BT, g, 1.5)).to(dtype)  # ratios on both sides of every cap
    mask = make_mask(*BT, mask_kind, g)
    w = L.truncated_importance_weight(pol, beh, mask, cap)
    close(w, R.ref_truncated_importance_weight(pol, beh, mask, cap), dtype, "weight")
    assert not w.requires_grad  # a constant of the update: it scales the gradient, is not trained
    assert bool((w[~mask] == 0).all()) and bool((w <= cap).all())


def test_truncated_importance_weight_refuses_a_cap_below_one():
    with pytest.raises(ValueError, match="cap"):
        L.truncated_importance_weight(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.5)


@pytest.mark.parametrize("shape,mask_kind", [(s, m) for s in SHAPES for m in MASKS])
@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_stale_sampled_objective_against_reference(shape, mask_kind, gamma):
    """The sampled objective on stale rollouts (the trainer's composition in opd.objectives) against the
    reference's: reward from the policy being updated, REINFORCE weighted by min(pi / mu, 2)."""
    from types import SimpleNamespace

    from opd.objectives import ObjectiveInputs, ObjectiveOptions, lookup

    B, T, V, _ = shape
    g = gen(29)
    h = randn((B, T, D), g).requires_grad_(True)
    W = randn((V, D), g, 0.5)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = make_mask(B, T, mask_kind, g)
    now = L.token_logprobs_from_hidden(h.detach(), W, ids)  # the policy before the update
    beh = now + randn((B, T), g, 1.0)
    teacher = randn((B, T), g) - 2.0
    gout = randn((B, T), g)
    x = ObjectiveInputs(
        hidden_NTD=h,
        head_VD=W,
        response_ids_NT=ids,
        behaviour_logprobs_NT=beh,
        action_mask_NT=mask,
        mask_NT=mask,
        teacher_topk_ids_NTK=ids[..., None],
        teacher_topk_logprobs_NTK=teacher[..., None],
        teacher_sampled_logprobs_NT=teacher,
        policy_logprobs_NT=now,
    )
    out = lookup("sampled").loss(
        x, ObjectiveOptions("sampled", gamma=gamma), SimpleNamespace(clip_eps=0.2, stale_weight_cap=2.0)
    )
    lp = L.token_logprobs_from_hidden(h, W, ids)
    ref, ref_g_lp = R.ref_stale_sampled_loss(lp, now, beh, teacher, mask, gamma, 2.0, mask, gout)
    close(out, ref, F64, "value")
    (gh,) = grads(out, [h], gout)
    (ref_gh,) = grads(lp, [h], ref_g_lp)  # the chain rule through the log-probs, from the reference's d/dlogp
    close(gh, ref_gh, F64, "grad hidden")


# ---------------------------------------------------------------- full vocab KL and JSD


DIVERGENCES = ["reverse", "forward", "jsd0", "jsd0.3", "jsd0.5", "jsd1"]


def divergence(fn, zs, zt, mask, chunk_size=None, gout=None):
    """(opd.losses value, reference (value, grad)) for full_vocab_kl / generalized_jsd."""
    if fn.startswith("jsd"):
        beta = float(fn[3:])
        return (
            L.generalized_jsd(zs, zt, mask, beta=beta, chunk_size=chunk_size),
            R.ref_generalized_jsd(zs, zt, mask, beta, gout),
        )
    return (
        L.full_vocab_kl(zs, zt, mask, direction=fn, chunk_size=chunk_size),
        R.ref_full_vocab_kl(zs, zt, mask, fn, gout),
    )


@pytest.mark.parametrize("shape,mask_kind,dtype", cases())
@pytest.mark.parametrize("fn", DIVERGENCES)
def test_divergences(shape, mask_kind, dtype, fn):
    """full_vocab_kl reverse / forward and generalized_jsd (jsd<beta>)."""
    B, T, V, _ = shape
    g = gen(21)
    zs = randn((B, T, V), g, 2.0, dtype).requires_grad_(True)
    zt = randn((B, T, V), g, 2.0, dtype).requires_grad_(True)
    mask, gout = make_mask(B, T, mask_kind, g), randn((B, T), g)
    out, (ref, ref_g) = divergence(fn, zs, zt, mask, gout=gout)
    assert out.dtype == OUT_DTYPE[dtype] and out.shape == (B, T)
    close(out, ref, dtype, "value")
    gs, gt = grads(out, [zs, zt], gout)
    if not fn.startswith("jsd"):  # the spec makes the teacher a constant for full_vocab_kl
        check_teacher_constant(gt)
    check_grad(gs, ref_g, zs, dtype, "grad student")
    check_masked_exact(out, gs, mask)
    if fn in ("jsd0", "jsd1") and dtype == F64:  # TRL endpoints are the two KLs
        close(out, divergence("forward" if fn == "jsd0" else "reverse", zs, zt, mask)[0], F64)


@pytest.mark.parametrize("fn", DIVERGENCES)
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_divergences_chunked_equal_unchunked(fn, chunk_size):
    g = gen(23)
    zs = randn((3, 7, 47), g, 2.0).requires_grad_(True)
    zt, mask, gout = randn((3, 7, 47), g, 2.0), make_mask(3, 7, "row", g), randn((3, 7), g)
    a, b = divergence(fn, zs, zt, mask)[0], divergence(fn, zs, zt, mask, chunk_size)[0]
    close(b, a, F64)
    close(grads(b, [zs], gout)[0], grads(a, [zs], gout)[0], F64)


@pytest.mark.parametrize("fn", DIVERGENCES)
def test_divergences_zero_when_equal(fn):
    g = gen(24)
    zt = randn((2, 5, 31), g, 2.0)
    zs = (zt + randn((2, 5, 1), g, 3.0)).requires_grad_(True)  # same softmax
    out = divergence(fn, zs, zt, make_mask(2, 5, "all", g))[0]
    close(out, torch.zeros(2, 5, dtype=F64), F64)
    close(grads(out, [zs], torch.ones(2, 5))[0], torch.zeros(2, 5, 31, dtype=F64), F64)


@pytest.mark.parametrize("fn", ["reverse", "forward", "jsd0.3", "jsd0.5"])
def test_divergences_neg_inf_well_defined(fn):
    """-inf where the divergence is still finite: padded vocab entries (both -inf), and the
    student (reverse / JSD) or teacher (forward / JSD) -inf on a few entries (0 log 0 = 0)."""
    g = gen(25)
    zs, zt = randn((2, 3, 9), g, 2.0), randn((2, 3, 9), g, 2.0)
    zs[..., 7:] = zt[..., 7:] = -math.inf
    if fn != "forward":
        zs[0, 1, :3] = -math.inf
    if fn != "reverse":
        zt[1, 2, 3:5] = -math.inf
    zs.requires_grad_(True)
    mask, gout = make_mask(2, 3, "all", g), randn((2, 3), g)
    out, (ref, ref_g) = divergence(fn, zs, zt, mask, gout=gout)
    assert torch.isfinite(out).all(), out
    close(out, ref, F64)
    check_grad(grads(out, [zs], gout)[0], ref_g, zs, F64, "grad student")


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_full_vocab_kl_leaves_out_infinite_terms(direction):
    """A token with mass under one model and none under the other makes the KL infinite; opd
    leaves that term out (and differentiates the truncated sum), as documented."""
    g = gen(26)
    zs, zt = randn((2, 3, 9), g, 2.0), randn((2, 3, 9), g, 2.0)
    banned = zt if direction == "reverse" else zs  # the model whose zero makes the term infinite
    banned[0, 1, 2] = banned[1, 0, 5:7] = -math.inf
    zs.requires_grad_(True)
    mask, gout = make_mask(2, 3, "all", g), randn((2, 3), g)
    out = L.full_vocab_kl(zs, zt, mask, direction=direction)
    ref, ref_g = R.ref_full_vocab_kl(zs, zt, mask, direction, gout)
    assert torch.isfinite(out).all(), out
    close(out, ref, F64, "value")
    check_grad(grads(out, [zs], gout)[0], ref_g, zs, F64, "grad student")


# ---------------------------------------------------------------- full vocab KL from hidden


def kl_hidden_inputs(shape, seed, dtype, mask_kind, E, ban=False):
    """Student (D wide) and teacher (E wide) hidden states and heads; ``ban`` adds -inf logits.

    Banned tokens come from a -inf entry in the head's last column against a hidden coordinate
    fixed at 1: token 0 for the student, token 1 for the teacher, the last two for both (a
    padded vocabulary).
    """
    B, T, V, _ = shape
    g = gen(seed)
    hs, ws = randn((B, T, D), g, 1.0), randn((V, D), g, 0.7)
    ht, wt = randn((B, T, E), g, 1.0), randn((V, E), g, 0.7)
    if ban:
        hs[..., -1] = ht[..., -1] = 1.0
        ws[[0, V - 2, V - 1], -1] = -math.inf
        wt[[1, V - 2, V - 1], -1] = -math.inf
    hs, ws, ht, wt = (x.to(dtype).requires_grad_(True) for x in (hs, ws, ht, wt))
    return hs, ws, ht, wt, make_mask(B, T, mask_kind, g), randn((B, T), g)


def check_kl_from_hidden(out, hs, ws, ht, wt, mask, gout, direction, dtype):
    """Value and student gradients against the loop reference; teacher constant; masks exact."""
    assert out.dtype == OUT_DTYPE[dtype] and out.shape == mask.shape
    ref, ref_gh, ref_gw = R.ref_full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, gout)
    close(out, ref, dtype, "value")
    gh, gw, ght, gwt = grads(out, [hs, ws, ht, wt], gout)
    check_grad(gh, ref_gh, hs, dtype, "grad student hidden")
    check_grad(gw, ref_gw, ws, dtype, "grad student head")
    check_teacher_constant(ght)
    check_teacher_constant(gwt)
    check_masked_exact(out, gh, mask)
    return gh, gw


@pytest.mark.parametrize("shape,mask_kind,dtype", cases())
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("E", [D, 5], ids=["same_width", "narrower_teacher"])
def test_full_vocab_kl_from_hidden(shape, mask_kind, dtype, direction, chunk_size, E):
    hs, ws, ht, wt, mask, gout = kl_hidden_inputs(shape, 31, dtype, mask_kind, E)
    out = L.full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, chunk_size=chunk_size)
    gh, gw = check_kl_from_hidden(out, hs, ws, ht, wt, mask, gout, direction, dtype)
    if dtype == F64:  # the same as building both models' logits
        hs2, ws2 = fresh(hs, ws)
        out2 = L.full_vocab_kl(hs2 @ ws2.T, ht @ wt.T, mask, direction)
        close(out, out2, F64)
        for a, b in zip((gh, gw), grads(out2, [hs2, ws2], gout)):
            close(a, b, F64)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("dtype", [F64, F32, BF16])
def test_full_vocab_kl_from_hidden_neg_inf(direction, chunk_size, dtype):
    """-inf logits in either model: 0 log 0 = 0, and the infinite terms (student mass on the
    teacher's banned token in reverse, teacher mass on the student's in forward) left out."""
    hs, ws, ht, wt, mask, gout = kl_hidden_inputs((2, 4, 9, 0), 32, dtype, "random", 6, ban=True)
    out = L.full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, chunk_size=chunk_size)
    assert torch.isfinite(out).all(), out
    gh, gw = check_kl_from_hidden(out, hs, ws, ht, wt, mask, gout, direction, dtype)
    if dtype == F64:
        # full_vocab_kl agrees on values and the head's gradient; its hidden gradient is NaN
        # (autograd's 0 * -inf through h @ W.T), which is why the reference is used for it.
        hs2, ws2 = fresh(hs, ws)
        out2 = L.full_vocab_kl(hs2 @ ws2.T, ht @ wt.T, mask, direction)
        close(out, out2, F64)
        close(gw, grads(out2, [ws2], gout)[0], F64)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_full_vocab_kl_from_hidden_ties_and_equal_models(direction):
    """Tied logits (repeated head rows) and a teacher equal to the student up to a constant
    logit shift (a wider teacher with a bias column): KL 0 and gradient 0."""
    B, T, V = 3, 5, 13
    g = gen(33)
    hs, ws = randn((B, T, D), g), randn((V, D), g, 0.7)
    ws[5:9] = ws[4]  # five tokens tie at every position
    ht = torch.cat([hs, torch.ones(B, T, 1, dtype=F64)], -1)
    wt = torch.cat([ws, torch.full((V, 1), 2.5, dtype=F64)], -1)
    hs.requires_grad_(True)
    ws.requires_grad_(True)
    mask = make_mask(B, T, "row", g)
    for chunk_size in (1, 4, None):
        out = L.full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, chunk_size=chunk_size)
        close(out, torch.zeros(B, T, dtype=F64), F64)
        for x in grads(out, [hs, ws], torch.ones(B, T)):
            close(x, torch.zeros_like(x), F64)
    wt2 = wt.clone()
    wt2[6, :D] += 0.3  # break one tie in the teacher only: the tied student rows still match
    ht, wt2, gout = ht.requires_grad_(True), wt2.requires_grad_(True), randn((B, T), g)
    out = L.full_vocab_kl_from_hidden(hs, ws, ht, wt2, mask, direction, chunk_size=3)
    check_kl_from_hidden(out, hs, ws, ht, wt2, mask, gout, direction, F64)


@pytest.mark.parametrize("chunk_size", [2, 5, 10_000])
def test_full_vocab_kl_from_hidden_chunk_sizes_agree(chunk_size):
    """Any chunking gives the same values and gradients; active positions whose upstream
    gradient is zero are skipped in the backward and get exactly zero gradient."""
    hs, ws, ht, wt, mask, gout = kl_hidden_inputs((3, 7, 47, 0), 34, F64, "row", 6)
    gout[1:, ::2] = 0.0
    for direction in ("reverse", "forward"):
        a = L.full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, chunk_size=1)
        b = L.full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, chunk_size=chunk_size)
        close(b, a, F64)
        gb = grads(b, [hs, ws], gout)
        for x, y in zip(gb, grads(a, [hs, ws], gout)):
            close(x, y, F64)
        assert (gb[0][1:, ::2] == 0).all()
        check_kl_from_hidden(b, hs, ws, ht, wt, mask, gout, direction, F64)


@pytest.mark.parametrize("which", ["hidden", "head"])
def test_full_vocab_kl_from_hidden_all_masked_and_one_input(which):
    """An all-masked batch is exactly 0 and still differentiable (zero gradients, no
    allow_unused needed); with only one of hidden / head requiring a gradient it still works."""
    hs, ws, ht, wt, mask, gout = kl_hidden_inputs((2, 3, 11, 0), 35, F64, "random", 4)
    hs2, ws2 = hs.detach().requires_grad_(which == "hidden"), ws.detach().requires_grad_(which == "head")
    x = hs2 if which == "hidden" else ws2
    none = torch.zeros_like(mask)
    out = L.full_vocab_kl_from_hidden(hs2, ws2, ht, wt, none, "reverse")
    assert (out == 0).all() and out.requires_grad
    (gx,) = torch.autograd.grad(L.token_mean(out, none), [x])
    assert (gx == 0).all()
    out = L.full_vocab_kl_from_hidden(hs2, ws2, ht, wt, mask, "forward", chunk_size=2)
    ref, ref_gh, ref_gw = R.ref_full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, "forward", gout)
    close(out, ref, F64)
    (gx,) = torch.autograd.grad(out, [x], grad_outputs=gout)
    close(gx, ref_gh if which == "hidden" else ref_gw, F64)


def test_full_vocab_kl_from_hidden_mixed_dtypes():
    """A float64 teacher makes the loss float64; bfloat16 student gradients come back bfloat16."""
    hs, ws, ht, wt, mask, gout = kl_hidden_inputs((2, 5, 31, 0), 36, F64, "random", 6)
    hs16, ws16 = (x.detach().to(BF16).requires_grad_(True) for x in (hs, ws))
    out = L.full_vocab_kl_from_hidden(hs16, ws16, ht, wt, mask, "reverse", chunk_size=4)
    assert out.dtype == F64
    ref, ref_gh, ref_gw = R.ref_full_vocab_kl_from_hidden(hs16, ws16, ht, wt, mask, "reverse", gout)
    close(out, ref, F64)  # computed in float64 from the bfloat16 values
    gh, gw = grads(out, [hs16, ws16], gout)
    check_grad(gh, ref_gh, hs16, BF16, "grad hidden")
    check_grad(gw, ref_gw, ws16, BF16, "grad head")


KL_HIDDEN_BAD = {
    "direction": dict(direction="sideways"),
    "vocabulary": dict(wt=torch.zeros(6, 4)),
    "student width": dict(ws=torch.zeros(5, 4)),
    "teacher width": dict(wt=torch.zeros(5, 3)),
    "positions": dict(ht=torch.zeros(1, 3, 4)),
    "mask": dict(mask=torch.ones(2, 2, dtype=torch.bool)),
}


@pytest.mark.parametrize("case", list(KL_HIDDEN_BAD))
def test_full_vocab_kl_from_hidden_bad_inputs(case):
    args = dict(
        hs=torch.zeros(1, 2, 3),
        ws=torch.zeros(5, 3),
        ht=torch.zeros(1, 2, 4),
        wt=torch.zeros(5, 4),
        mask=torch.ones(1, 2, dtype=torch.bool),
        direction="reverse",
    )
    args.update(KL_HIDDEN_BAD[case])
    with pytest.raises(ValueError):
        L.full_vocab_kl_from_hidden(args["hs"], args["ws"], args["ht"], args["wt"], args["mask"], args["direction"])


# ---------------------------------------------------------------- the private row-dot kernel


def test_private_row_dot_kernel_still_works():
    """LSM from hidden states relies on torch.ops.aten._embedding_bag_per_sample_weights_backward.
    If a torch upgrade removes or changes it, opd falls back to a slower public path with a
    warning; this test makes CI fail loudly instead, so the change is noticed and handled."""
    op = getattr(torch.ops.aten, RK.ROW_DOTS_OP, None)
    assert RK.probe_row_dots(op) is None, RK.probe_row_dots(op)
    assert RK.row_dots_kernel() is op
    g = gen(37)
    for dtype in (F64, F32):
        h, w = randn((11, 9), g, 1.0, dtype), randn((23, 9), g, 1.0, dtype)
        rows = torch.tensor([0, 3, 4, 9, 10])
        ids = torch.randint(0, 23, (5, 6), generator=g)
        got = RK.support_logits(h, w, rows, ids, dtype, 2)
        expected = torch.einsum("akd,ad->ak", w.to(F64)[ids], h.to(F64)[rows])
        close(got, expected, dtype, str(dtype))


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_row_dot_fallback_matches_private_kernel(dtype, chunk_size, monkeypatch):
    """The public fallback gives the private kernel's logits, and LSM from hidden states the
    same values and gradients, on either path."""
    h, w, ids, tlp, mask, sm, gout = hidden_inputs((3, 7, 47, 4), 38, dtype, mask_kind="random")
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    ids_AK = ids.reshape(-1, 4)[rows]
    fused = RK.support_logits(h.detach().reshape(-1, D), w.detach(), rows, ids_AK, dtype, chunk_size)
    public = RK.gathered_support_logits(h.detach().reshape(-1, D), w.detach(), rows, ids_AK, dtype, chunk_size)
    close(public, fused, dtype)
    results = []
    for use_fused in (True, False):
        calls = row_dots_path(monkeypatch, use_fused)
        out = L.local_support_kl_from_hidden(h, w, ids, tlp, mask, support_mask=sm, chunk_size=chunk_size or 1000)
        assert calls["fused"] == use_fused and calls["gather"] != use_fused
        results.append([out, *grads(out, [h, w], gout)])
    for a, b in zip(*results):
        close(b, a, dtype)


def test_row_dot_kernel_probe_rejects_a_changed_op(monkeypatch):
    """A missing op, a changed signature or a wrong answer each disable the kernel, with one
    warning that says why; LSM from hidden states then still gives the right answer."""
    assert "does not exist" in RK.probe_row_dots(None)
    assert "failed" in RK.probe_row_dots(lambda grad, weight, indices: grad)
    assert "returned" in RK.probe_row_dots(lambda *args: torch.zeros(args[2].shape, dtype=args[0].dtype))
    assert "returned" in RK.probe_row_dots(
        lambda *args: getattr(torch.ops.aten, RK.ROW_DOTS_OP)(*args).to(torch.float16)
    )
    RK.row_dots_kernel.cache_clear()
    monkeypatch.setattr(RK, "ROW_DOTS_OP", "embedding_bag")  # a real op with another schema
    try:
        with pytest.warns(RuntimeWarning, match="embedding_bag"):
            assert RK.row_dots_kernel() is None
        h, w, ids, tlp, mask, sm, gout = hidden_inputs((2, 5, 31, 4), 39, F64)
        out = L.local_support_kl_from_hidden(h, w, ids, tlp, mask, support_mask=sm)
        ref, ref_gl = R.ref_local_support_kl(R.ref_logits(h, w), ids, tlp, mask, True, sm, gout)
        close(out, ref, F64)
        check_grad(grads(out, [h], gout)[0], R.ref_hidden_grads(h, w, ref_gl)[0], h, F64, "grad")
    finally:
        RK.row_dots_kernel.cache_clear()  # the next caller probes the real op again


# ---------------------------------------------------------------- the package's import paths


PUBLIC_NAMES = [  # the public API before the package split, then the names added since
    "SUPPORT_KINDS",
    "build_support",
    "constant_sum",
    "full_vocab_kl",
    "gather_logprobs",
    "generalized_jsd",
    "local_support_kl",
    "local_support_kl_from_hidden",
    "sampled_token_advantages",
    "sampled_token_pg_loss",
    "sequence_mean",
    "special_token_mask",
    "teacher_topk",
    "teacher_topk_from_hidden",
    "token_logprobs_from_hidden",
    "topk_and_gather_from_hidden",
    "token_mean",
] + [
    "full_vocab_kl_from_hidden",
    "topk_from_hidden",
    "local_support_kl_tail",
    "local_support_kl_tail_from_hidden",
    "truncated_importance_weight",
    "Head",
    "HeadLike",
    "as_head",
]


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_public_names_import_from_opd_losses(name):
    namespace = {}
    exec(f"from opd.losses import {name}", namespace)  # the import statement users write
    assert namespace[name] is getattr(L, name)
    assert name in L.__all__


def test_package_layout():
    """__all__ is exactly the public API; the old top-K name is the neutral one; every file of
    the package stays under 600 lines; importing it pulls in no model library."""
    import pathlib
    import subprocess
    import sys

    assert sorted(L.__all__) == sorted(PUBLIC_NAMES)
    assert L.teacher_topk_from_hidden is L.topk_from_hidden
    for path in pathlib.Path(L.__file__).parent.glob("*.py"):
        assert len(path.read_text().splitlines()) < 600, path
    code = "import sys, opd.losses; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "opd.losses imports transformers"


# ---------------------------------------------------------------- reductions and masks


REDUCTIONS = {
    "token_mean": lambda x, m: L.token_mean(x, m),
    "sequence_mean": lambda x, m: L.sequence_mean(x, m),
    "constant_sum": lambda x, m: L.constant_sum(x, m, 7.0),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
@pytest.mark.parametrize("mask_kind", MASKS + ["all"])
@pytest.mark.parametrize("BT", [(1, 1), (3, 7), (2, 5)])
def test_reductions(name, mask_kind, BT):
    g = gen(27)
    loss = randn(BT, g, 3.0).requires_grad_(True)  # masked entries hold real values
    mask = make_mask(*BT, mask_kind, g)
    out = REDUCTIONS[name](loss, mask)
    ref, ref_g = R.ref_reduce(name, loss, mask, 7.0 if name == "constant_sum" else None)
    assert out.dim() == 0
    close(out, ref, F64, "value")
    (gl,) = grads(out, [loss], torch.ones(()))
    check_grad(gl, ref_g, loss, F64, "grad")
    if mask_kind == "none":
        assert out.item() == 0.0 and (gl == 0).all()


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32, torch.uint8])
def test_masks_accept_0_1_tensors(mask_dtype):
    g = gen(28)
    B, T, V, K = 2, 5, 11, 3
    zs, zt = randn((B, T, V), g), randn((B, T, V), g)
    ids = distinct_ids(B, T, K, V, g)
    tlp = R.ref_log_softmax(zt).gather(-1, ids)
    m, sm = make_mask(B, T, "row", g), make_support_mask(B, T, K, "random", g)
    s0, t0 = zs[..., 0], zt[..., 0]
    calls = [
        lambda m, sm: L.local_support_kl(zs, ids, tlp, m, support_mask=sm),
        lambda m, sm: L.full_vocab_kl(zs, zt, m),
        lambda m, sm: L.generalized_jsd(zs, zt, m, beta=0.3),
        lambda m, sm: L.sampled_token_advantages(s0, t0, m, gamma=0.5),
        lambda m, sm: L.sampled_token_pg_loss(s0, t0, m),
    ]
    calls += [lambda m, sm, f=f: f(s0, m) for f in REDUCTIONS.values()]
    for n, call in enumerate(calls):
        expected = call(m, sm)
        torch.testing.assert_close(
            call(m.to(mask_dtype), sm.to(mask_dtype)), expected, rtol=0, atol=0, msg=lambda s, n=n: f"call {n}: {s}"
        )
    close(calls[0](m, sm), R.ref_local_support_kl(zs, ids, tlp, m, True, sm)[0], F64)


def test_special_token_mask():
    g = gen(29)
    tok = torch.randint(0, 10, (3, 7), generator=g)
    special = [1, 3, 7]
    got = L.special_token_mask(tok, special)
    assert got.dtype == torch.bool and got.shape == tok.shape
    assert torch.equal(got, R.ref_special_token_mask(tok, special))
    assert got.any() and not got.all()
    assert not L.special_token_mask(tok, []).any()
    resp = make_mask(3, 7, "random", g)
    expected = [[r and v not in special for r, v in zip(rr, vv)] for rr, vv in zip(resp.tolist(), tok.tolist())]
    assert (resp & ~got).tolist() == expected


H, W = torch.zeros(1, 2, 3), torch.zeros(5, 3)
BAD_INPUTS = {
    "topk_k0": lambda: L.teacher_topk(torch.zeros(1, 2, 5), 0),
    "topk_k-1": lambda: L.teacher_topk(torch.zeros(1, 2, 5), -1),
    "topk_k>V": lambda: L.teacher_topk(torch.zeros(1, 2, 5), 6),
    "topk_hidden_k0": lambda: L.topk_from_hidden(H, W, 0),
    "topk_hidden_k>V": lambda: L.topk_from_hidden(H, W, 6),
    "gamma<0": lambda: L.sampled_token_advantages(*[torch.zeros(1, 3)] * 3, gamma=-0.1),
    "gamma>1": lambda: L.sampled_token_advantages(*[torch.zeros(1, 3)] * 3, gamma=1.5),
    "direction": lambda: L.full_vocab_kl(*[torch.zeros(1, 2, 5)] * 2, torch.ones(1, 2), direction="sideways"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_value_error(case):
    with pytest.raises(ValueError):
        BAD_INPUTS[case]()
