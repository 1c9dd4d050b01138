"""The losses from hidden states with a model's head (opd.losses.Head: bias, scale, soft-cap)
against the float64 loop reference (tests/reference.py: ``ref_head_logits``, ``ref_head_grads``).

Every from-hidden kernel computes its logits through the head and takes the gradient back through
the cap and the scale by hand; these check values and the gradients of the hidden states, the
weight and the bias on odd shapes, random / all-masked-row / all-masked batches, variable
supports with -inf teacher log-probs, banned tokens (-inf head entries), chunk sizes, and float32.
The reference's own chain rule is checked against finite differences first.

Run: python -m pytest tests/losses/test_losses_head.py -q
"""

import math

import pytest
import reference as R
import torch
from loss_checks import (
    F32,
    F64,
    OUT_DTYPE,
    D,
    check_grad,
    check_masked_exact,
    check_teacher_constant,
    close,
    gen,
    grads,
    hidden_inputs,
    make_mask,
    randn,
)

import opd.losses as L

# scale and cap sized against logits of about +-2 (weights 0.7 x sqrt(D)), so the cap bends them
HEADS = {
    "bias": {"bias": True},
    "scale": {"scale": 0.37},
    "cap": {"softcap": 2.5},
    "all": {"bias": True, "scale": 1.7, "softcap": 3.0},
}
SHAPES = [(1, 1, 5, 1), (3, 7, 47, 4), (2, 5, 31, 31)]  # B, T, V, K (K = V last)


def cases():
    """(shape, mask kind, dtype): float64 on each shape and mask, float32 on one."""
    return [(s, m, F64) for s in SHAPES for m in ("random", "row", "none")] + [(SHAPES[1], "row", F32)]


def make_head(w, kind, g, dtype, ban=False):
    """A Head over ``w`` of ``kind``; its bias (or None) requires grad. ``ban``: tokens 0 and V-1 get a
    -inf entry in the head's last column (the caller fixes that hidden coordinate at 1)."""
    spec = HEADS[kind]
    if ban:
        with torch.no_grad():
            w[[0, w.shape[0] - 1], -1] = -math.inf
    b = randn((w.shape[0],), g, 1.0, dtype).requires_grad_(True) if spec.get("bias") else None
    return L.Head(w, b, spec.get("scale", 1.0), spec.get("softcap")), b


def ref_parts(head):
    return head.weight_VD, head.bias_V, head.scale, head.softcap


def trained(h, head):
    """The inputs a loss's gradient reaches: hidden, weight and (when there is one) bias."""
    return [h, head.weight_VD] + ([] if head.bias_V is None else [head.bias_V])


def check_head_grads(out, h, head, ref_gl, gout, dtype):
    """Gradients of hidden, weight and bias against the reference chain rule through the head."""
    ref_gh, ref_gw, ref_gb = R.ref_head_grads(h, *ref_parts(head), ref_gl)
    got = grads(out, trained(h, head), gout)
    check_grad(got[0], ref_gh, h, dtype, "grad hidden")
    check_grad(got[1], ref_gw, head.weight_VD, dtype, "grad weight")
    if head.bias_V is not None:
        check_grad(got[2], ref_gb, head.bias_V, dtype, "grad bias")
    return got


# ---------------------------------------------------------------- the head and its reference


@pytest.mark.parametrize("kind", list(HEADS))
def test_reference_head_gradients_match_finite_differences(kind):
    g = gen(3)
    B, T, V = 2, 3, 6
    h, w = randn((B, T, D), g), randn((V, D), g, 0.7)
    head, b = make_head(w, kind, g, F64)
    gl = randn((B, T, V), g)
    gh, gw, gb = R.ref_head_grads(h, w, b, head.scale, head.softcap, gl)
    logits = lambda **kw: R.ref_head_logits(
        **{"hidden_BTD": h, "weight_VD": w, "bias_V": b, **kw}, scale=head.scale, softcap=head.softcap
    )
    torch.testing.assert_close(gh, R.finite_diff(lambda x: logits(hidden_BTD=x), h, gl), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw, R.finite_diff(lambda x: logits(weight_VD=x), w, gl), rtol=1e-6, atol=1e-7)
    if b is not None:
        torch.testing.assert_close(gb, R.finite_diff(lambda x: logits(bias_V=x), b, gl), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", list(HEADS))
def test_head_logits_equal_the_reference(kind):
    g = gen(4)
    h, w = randn((3, 4, D), g), randn((11, D), g, 0.7)
    head, _ = make_head(w, kind, g, F64)
    close(head.logits(h), R.ref_head_logits(h, *ref_parts(head)), F64)
    assert L.as_head(w).logits(h).sub(h @ w.T).abs().max() == 0, "a plain tensor is the plain head"


@pytest.mark.parametrize("kind", list(HEADS))
def test_a_bfloat16_head_cast_a_block_at_a_time_gives_the_same_bits(kind, monkeypatch):
    """A low-precision head is cast to float32 a vocabulary block at a time (no whole copy): the logits,
    top-K and query log-probs are bit-identical to those of the head copied whole to float32."""
    import opd.losses.head as head_module

    monkeypatch.setattr(head_module, "VOCAB_BLOCK", 16)  # several blocks, the last overlapping
    g = gen(5)
    w = randn((53, D), g, 0.7).to(torch.bfloat16)
    head, _ = make_head(w, kind, g, F32)
    head = L.Head(w, None if head.bias_V is None else head.bias_V.detach(), head.scale, head.softcap)
    whole = L.Head(w.float(), head.bias_V, head.scale, head.softcap)
    h = randn((2, 9, D), g, 1.0, F32)
    assert torch.equal(head_module.logits_no_grad(head, h[0]), whole.logits(h[0]))
    query = torch.randint(0, 53, (2, 9, 3), generator=g)
    for got, want in zip(
        L.topk_and_gather_from_hidden(h, head, 4, query, 4), L.topk_and_gather_from_hidden(h, whole, 4, query, 4)
    ):
        assert torch.equal(got, want)


def test_head_refuses_a_bias_of_another_size_and_a_cap_of_zero():
    w = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="bias"):
        L.Head(w, torch.zeros(4))
    with pytest.raises(ValueError, match="softcap"):
        L.Head(w, softcap=0.0)


# ---------------------------------------------------------------- every from-hidden kernel


@pytest.mark.parametrize("shape,mask_kind,dtype", cases())
@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("chunk_size", [1, 1000])
def test_token_logprobs_and_topk_from_hidden(shape, mask_kind, dtype, kind, chunk_size):
    B, T, V, K = shape
    g = gen(11)
    h = randn((B, T, D), g, 1.0, dtype).requires_grad_(True)
    w = randn((V, D), g, 0.7, dtype).requires_grad_(True)
    head, _ = make_head(w, kind, g, dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = make_mask(B, T, mask_kind, g)
    gout = randn((B, T), g) * mask  # masked positions reach the backward as zero gradients
    logits = R.ref_head_logits(h, *ref_parts(head))
    out = L.token_logprobs_from_hidden(h, head, ids, chunk_size=chunk_size)
    assert out.dtype == OUT_DTYPE[dtype]
    ref, ref_gl = R.ref_gather_logprobs(logits, ids, gout)
    close(out, ref, dtype, "value")
    check_head_grads(out, h, head, ref_gl, gout, dtype)
    tids, tlps, q = L.topk_and_gather_from_hidden(h, head, K, ids[..., None], chunk_size=chunk_size)
    close(tlps, R.ref_teacher_topk(logits, K)[1], dtype, "top-K log-probs")
    close(tlps, R.ref_log_softmax(logits).gather(-1, tids), dtype, "top-K ids' log-probs")
    close(q[..., 0], ref, dtype, "query log-probs")


@pytest.mark.parametrize("shape,mask_kind,dtype", cases())
@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("share,renormalize", [(0.0, True), (0.3, True), (0.0, False)])
@pytest.mark.parametrize("chunk_size", [1, 1000])
def test_local_support_kl_from_hidden(shape, mask_kind, dtype, kind, share, renormalize, chunk_size):
    """renormalize=False (the ablation) reads the whole head, so banned tokens (-inf entries) are in it."""
    h, w, ids, tlp, mask, sm, gout = hidden_inputs(shape, 12, dtype, mask_kind=mask_kind)
    if not renormalize:
        with torch.no_grad():
            h[..., -1] = 1.0  # against the banned entries' -inf
    head, _ = make_head(w, kind, gen(13), dtype, ban=not renormalize)
    out = L.local_support_kl_from_hidden(
        h, head, ids, tlp, mask, sm, chunk_size=chunk_size, forward_share=share, renormalize=renormalize
    )
    logits = R.ref_head_logits(h, *ref_parts(head))
    ref, ref_gl = R.ref_local_support_kl(logits, ids, tlp, mask, renormalize, sm, gout, share)
    close(out, ref, dtype, "value")
    gh = check_head_grads(out, h, head, ref_gl, gout, dtype)[0]
    check_teacher_constant(grads(out, [tlp], gout)[0])
    check_masked_exact(out, gh, mask)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases())
@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_local_support_kl_tail_from_hidden(shape, mask_kind, dtype, kind, direction):
    h, w, ids, tlp, mask, sm, gout = hidden_inputs(shape, 14, dtype, mask_kind=mask_kind)
    with torch.no_grad():
        h[..., -1] = 1.0  # against the banned entries' -inf
    head, _ = make_head(w, kind, gen(15), dtype, ban=True)
    out = L.local_support_kl_tail_from_hidden(h, head, ids, tlp, mask, sm, direction, chunk_size=3)
    logits = R.ref_head_logits(h, *ref_parts(head))
    ref, ref_gl = R.ref_local_support_kl_tail(logits, ids, tlp, mask, sm, direction, gout)
    close(out, ref, dtype, "value")
    gh = check_head_grads(out, h, head, ref_gl, gout, dtype)[0]
    check_masked_exact(out, gh, mask)


@pytest.mark.parametrize("shape,mask_kind,dtype", cases())
@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("chunk_size", [1, None])
def test_full_vocab_kl_from_hidden(shape, mask_kind, dtype, kind, direction, chunk_size):
    B, T, V, _ = shape
    g = gen(16)
    hs, ws = randn((B, T, D), g, 1.0, dtype), randn((V, D), g, 0.7, dtype)
    ht, wt = randn((B, T, 5), g, 1.0, dtype), randn((V, 5), g, 0.7, dtype)
    hs[..., -1] = ht[..., -1] = 1.0  # against the banned entries' -inf
    for x in (hs, ws, ht, wt):  # the teacher's too: it must get exactly zero gradient
        x.requires_grad_(True)
    s_head, _ = make_head(ws, kind, g, dtype, ban=True)
    t_head, _ = make_head(wt, "all" if kind != "all" else "bias", g, dtype, ban=True)  # the teacher's own head
    mask, gout = make_mask(B, T, mask_kind, g), randn((B, T), g)
    out = L.full_vocab_kl_from_hidden(hs, s_head, ht, t_head, mask, direction, chunk_size=chunk_size)
    assert torch.isfinite(out).all()
    s_logits = R.ref_head_logits(hs, *ref_parts(s_head))
    t_logits = R.ref_head_logits(ht, *ref_parts(t_head))
    ref, ref_gl = R.ref_full_vocab_kl(s_logits, t_logits, mask, direction, gout)
    close(out, ref, dtype, "value")
    gh = check_head_grads(out, hs, s_head, ref_gl, gout, dtype)[0]
    for x in grads(out, trained(ht, t_head), gout)[1:]:
        check_teacher_constant(x)
    check_masked_exact(out, gh, mask)


@pytest.mark.parametrize("kind", list(HEADS))
def test_a_frozen_head_trains_only_the_hidden_states(kind):
    """LoRA freezes the head: weight and bias without grad, and the kernels' backward skips them."""
    h, w, ids, tlp, mask, sm, gout = hidden_inputs((3, 7, 47, 4), 17, F64)
    head, _ = make_head(w.detach(), kind, gen(18), F64)
    head = head.detach()
    for out, ref_fn in (
        (
            L.local_support_kl_tail_from_hidden(h, head, ids, tlp, mask, sm),
            lambda z: R.ref_local_support_kl_tail(z, ids, tlp, mask, sm, "reverse", gout),
        ),
        (L.token_logprobs_from_hidden(h, head, ids[..., 0]), lambda z: R.ref_gather_logprobs(z, ids[..., 0], gout)),
    ):
        ref, ref_gl = ref_fn(R.ref_head_logits(h, *ref_parts(head)))
        close(out, ref, F64)
        (gh,) = torch.autograd.grad(out, [h], grad_outputs=gout)
        check_grad(gh, R.ref_head_grads(h, *ref_parts(head), ref_gl)[0], h, F64, "grad hidden")
