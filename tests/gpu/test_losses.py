"""Every opd loss on the device in float32 and bfloat16, values and gradients, against tests/reference.py's
float64 loops computed on the CPU from the same inputs rounded to the dtype (so the error measured is the
device's arithmetic alone), with tests/loss_checks.py's tolerances and checks: the CPU suite's standard.
The cases hold what a device kernel gets wrong first: an all-masked row, ties, -inf logits, slots outside
the teacher's support, variable-size supports. TF32 stays off (PyTorch's default): its ~1e-3 matmuls would
fail float32's 1e-5, as they should. Each records its worst error in tolerances (``tol_used``, pass <= 1).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import reference as R
import torch
from loss_checks import F64, TOL, check_grad, close, distinct_ids, gen, grads, make_mask, make_support_mask, randn

import opd.losses as L

pytestmark = pytest.mark.gpu
B, T, V, K, D, E = 3, 7, 50, 5, 16, 12
DTYPES = [torch.float32, torch.bfloat16]


class Case(NamedTuple):
    inputs: dict  # name -> float64 (or integer) CPU tensor
    grad_of: list  # the inputs that get gradients
    fn: object  # (device, **device inputs) -> (loss, {name: other output})
    ref: object  # (**rounded float64 inputs) -> (value, {input: grad}, {name: other output})
    mask: torch.Tensor
    gout: torch.Tensor


def rn(g, *shape, scale=1.0):
    return randn(shape, g, scale)


def distinct(g):
    return distinct_ids(B, T, K, V, g)


def bt_mask(g):
    m = make_mask(B, T, "row", g)  # sequence 0 all masked
    m[1, 0] = m[2, -1] = True
    return m


def prefix_support(g):  # variable-size supports, some empty
    return make_support_mask(B, T, K, "prefix", g)


def lsm(renormalize: bool, share: float = 0.0) -> Case:
    g = gen(1)
    zs, zt = rn(g, B, T, V, scale=2.0), rn(g, B, T, V, scale=2.0)
    ids = distinct(g)
    tlp = R.ref_log_softmax(zt).gather(-1, ids)
    zs[1, 2, ids[1, 2, 0]] = -math.inf  # a support slot the student gives no mass
    zs[2, 4, ids[2, 4]] = -math.inf  # the student -inf on every slot of a position
    zs[2, 3, 7] = zs[2, 3, 8]  # ties in the student
    tlp[2, 1, 2] = -math.inf  # a slot outside the teacher's support
    tlp[1, 3, 1] = tlp[1, 3, 0]  # ties in the teacher
    sm, mask, gout = torch.rand(B, T, K, generator=g) < 0.8, bt_mask(g), rn(g, B, T)

    def fn(dev, zs, tlp):
        return L.local_support_kl(zs, ids.to(dev), tlp, mask.to(dev), renormalize, sm.to(dev), forward_share=share), {}

    def ref(zs, tlp):
        v, gz = R.ref_local_support_kl(zs, ids, tlp, mask, renormalize, sm, gout, forward_share=share)
        return v, {"zs": gz}, {}

    return Case(dict(zs=zs, tlp=tlp), ["zs"], fn, ref, mask, gout)


def lsm_hidden(share: float = 0.0) -> Case:
    g = gen(2)
    h, w = rn(g, B, T, D), rn(g, V, D, scale=0.7)
    ids = distinct(g)
    tlp = R.ref_log_softmax(rn(g, B, T, V, scale=2.0)).gather(-1, ids)
    tlp[..., -1][torch.rand(B, T, generator=g) < 0.3] = -math.inf
    mask, sm, gout = bt_mask(g), prefix_support(g), rn(g, B, T)

    def fn(dev, h, w, tlp):
        out = L.local_support_kl_from_hidden(
            h, w, ids.to(dev), tlp, mask.to(dev), support_mask=sm.to(dev), chunk_size=4, forward_share=share
        )
        return out, {}

    def ref(h, w, tlp):
        v, gl = R.ref_local_support_kl(R.ref_logits(h, w), ids, tlp, mask, True, sm, gout, forward_share=share)
        gh, gw = R.ref_hidden_grads(h, w, gl)
        return v, {"h": gh, "w": gw}, {}

    return Case(dict(h=h, w=w, tlp=tlp), ["h", "w"], fn, ref, mask, gout)


def full_kl(kind: str) -> Case:
    g = gen(3)
    zs, zt = rn(g, B, T, V, scale=2.0), rn(g, B, T, V, scale=2.0)
    zs[..., V - 2 :] = zt[..., V - 2 :] = -math.inf  # a padded vocabulary
    if kind != "forward":
        zs[1, 1, :3] = -math.inf  # student zeros (0 log 0)
    if kind != "reverse":
        zt[2, 2, 3:5] = -math.inf  # teacher zeros
    zs[2, 5, 10] = zs[2, 5, 11]
    mask, gout = bt_mask(g), rn(g, B, T)
    chunk = None if kind == "forward" else 4

    def fn(dev, zs, zt):
        if kind == "jsd":
            return L.generalized_jsd(zs, zt, mask.to(dev), beta=0.5, chunk_size=chunk), {}
        return L.full_vocab_kl(zs, zt, mask.to(dev), direction=kind, chunk_size=chunk), {}

    def ref(zs, zt):
        if kind == "jsd":
            v, gz = R.ref_generalized_jsd(zs, zt, mask, 0.5, gout)
        else:
            v, gz = R.ref_full_vocab_kl(zs, zt, mask, kind, gout)
        return v, {"zs": gz}, {}

    return Case(dict(zs=zs, zt=zt), ["zs"], fn, ref, mask, gout)


def full_kl_hidden(direction: str) -> Case:
    g = gen(4)
    hs, ws = rn(g, B, T, D), rn(g, V, D, scale=0.7)
    ht, wt = rn(g, B, T, E), rn(g, V, E, scale=0.7)
    # banned tokens: a -inf head entry against a hidden coordinate fixed at 1 (tests/losses/test_losses.py)
    hs[..., -1] = ht[..., -1] = 1.0
    ws[[0, V - 2, V - 1], -1] = -math.inf
    wt[[1, V - 2, V - 1], -1] = -math.inf
    mask, gout = bt_mask(g), rn(g, B, T)

    def fn(dev, hs, ws, ht, wt):
        return L.full_vocab_kl_from_hidden(hs, ws, ht, wt, mask.to(dev), direction, chunk_size=3), {}

    def ref(hs, ws, ht, wt):
        v, gh, gw = R.ref_full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, gout)
        return v, {"hs": gh, "ws": gw}, {}

    return Case(dict(hs=hs, ws=ws, ht=ht, wt=wt), ["hs", "ws"], fn, ref, mask, gout)


def sampled() -> Case:
    g = gen(5)
    h, w = rn(g, B, T, D), rn(g, V, D, scale=0.7)
    y = torch.randint(0, V, (B, T), generator=g)
    lp0 = R.ref_gather_logprobs(R.ref_logits(h, w), y)[0]
    t_lp = lp0 + rn(g, B, T, scale=0.5)  # rewards of order 1, so the gradients are too (as in the tests)
    old = lp0 + rn(g, B, T, scale=0.3)
    mask, gout = bt_mask(g), rn(g, B, T)
    gamma, clip = 0.9, 0.2

    def fn(dev, h, w, t_lp, old):
        logp = L.token_logprobs_from_hidden(h, w, y.to(dev), chunk_size=4)
        adv = L.sampled_token_advantages(logp, t_lp, mask.to(dev), gamma=gamma)
        loss = L.sampled_token_pg_loss(logp, adv, mask.to(dev), old, clip_eps=clip)
        return loss, {"logprobs": logp, "advantages": adv}

    def ref(h, w, t_lp, old):
        logits = R.ref_logits(h, w)
        lp = R.ref_gather_logprobs(logits, y)[0]
        adv = R.ref_sampled_token_advantages(lp, t_lp, mask, gamma)
        loss, g_lp = R.ref_sampled_token_pg_loss(lp, adv, mask, old, clip, gout)
        gh, gw = R.ref_hidden_grads(h, w, R.ref_gather_logprobs(logits, y, g_lp)[1])
        return loss, {"h": gh, "w": gw}, {"logprobs": lp, "advantages": adv}

    return Case(dict(h=h, w=w, t_lp=t_lp, old=old), ["h", "w"], fn, ref, mask, gout)


def gather() -> Case:
    g = gen(6)
    z, y = rn(g, B, T, V, scale=2.0), torch.randint(0, V, (B, T), generator=g)
    gout = rn(g, B, T)

    def ref(z):
        v, gz = R.ref_gather_logprobs(z, y, gout)
        return v, {"z": gz}, {}

    return Case(dict(z=z), ["z"], lambda dev, z: (L.gather_logprobs(z, y.to(dev)), {}), ref, torch.ones(B, T) > 0, gout)


def tail(direction: str, hidden: bool) -> Case:
    g = gen(7)
    ids = distinct(g)
    mask, sm, gout = bt_mask(g), torch.rand(B, T, K, generator=g) < 0.8, rn(g, B, T)
    tlp = R.ref_log_softmax(rn(g, B, T, V, scale=2.0)).gather(-1, ids)
    tlp[2, 2, 1] = -math.inf
    if hidden:
        h, w = rn(g, B, T, D), rn(g, V, D, scale=0.7)

        def fn_h(dev, h, w, tlp):
            return L.local_support_kl_tail_from_hidden(
                h, w, ids.to(dev), tlp, mask.to(dev), support_mask=sm.to(dev), direction=direction, chunk_size=4
            ), {}

        def ref_h(h, w, tlp):
            v, gh, gw = R.ref_local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm, direction, gout)
            return v, {"h": gh, "w": gw}, {}

        return Case(dict(h=h, w=w, tlp=tlp), ["h", "w"], fn_h, ref_h, mask, gout)
    zs = rn(g, B, T, V, scale=2.0)
    zs[1, 4, ids[1, 4, 0]] = -math.inf  # a support slot with no student mass
    outside = [v for v in range(V) if v not in ids[2, 3].tolist()][0]
    zs[2, 3, outside] = -math.inf  # a token outside S with no student mass

    def fn(dev, zs, tlp):
        out = L.local_support_kl_tail(zs, ids.to(dev), tlp, mask.to(dev), support_mask=sm.to(dev), direction=direction)
        return out, {}

    def ref(zs, tlp):
        v, gz = R.ref_local_support_kl_tail(zs, ids, tlp, mask, sm, direction, gout)
        return v, {"zs": gz}, {}

    return Case(dict(zs=zs, tlp=tlp), ["zs"], fn, ref, mask, gout)


CASES = {
    "lsm": lambda: lsm(True),
    "lsm_no_renormalize": lambda: lsm(False),
    "lsm_from_hidden": lambda: lsm_hidden(),
    "lsm_forward_share_0.3": lambda: lsm(True, 0.3),
    "lsm_from_hidden_forward_share_0.3": lambda: lsm_hidden(0.3),
    "full_vocab_kl_reverse": lambda: full_kl("reverse"),
    "full_vocab_kl_forward": lambda: full_kl("forward"),
    "generalized_jsd_0.5": lambda: full_kl("jsd"),
    "full_vocab_kl_from_hidden_reverse": lambda: full_kl_hidden("reverse"),
    "full_vocab_kl_from_hidden_forward": lambda: full_kl_hidden("forward"),
    "sampled_token_from_hidden": sampled,
    "gather_logprobs": gather,
    "lsm_tail_reverse": lambda: tail("reverse", False),
    "lsm_tail_forward": lambda: tail("forward", False),
    "lsm_tail_from_hidden_reverse": lambda: tail("reverse", True),
    "lsm_tail_from_hidden_forward": lambda: tail("forward", True),
}


def tol_used(got, ref, dtype) -> float:
    """max |got - ref| / (atol + rtol |ref|) over the reference's finite entries (pass: <= 1)."""
    rtol, atol = TOL[dtype]
    g, r = got.detach().cpu().to(F64), ref.to(F64)
    fin = torch.isfinite(r)
    d = (g - r).abs()[fin] / (atol + rtol * r.abs()[fin])
    return float(d.max()) if d.numel() else 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_against_reference(name, dtype, device, record_property):
    case = CASES[name]()
    rounded = {k: (v.to(dtype).to(F64) if v.is_floating_point() else v) for k, v in case.inputs.items()}
    on_dev = {
        k: (v.to(dtype).to(device).requires_grad_(k in case.grad_of) if v.is_floating_point() else v.to(device))
        for k, v in rounded.items()
    }
    out, others = case.fn(device, **on_dev)
    got_grads = grads(out, [on_dev[k] for k in case.grad_of], case.gout.to(device))
    ref_val, ref_grads, ref_others = case.ref(**rounded)
    worst = {"value": tol_used(out, ref_val, dtype)}
    worst |= {f"grad_{k}": tol_used(gk, ref_grads[k], dtype) for k, gk in zip(case.grad_of, got_grads)}
    worst |= {k: tol_used(v, ref_others[k], dtype) for k, v in others.items()}
    record_property("tol_used", max(worst.values()))
    record_property("value_max_abs", float((out.detach().cpu().to(F64) - ref_val).abs().nan_to_num(0.0).max()))
    close(out.cpu(), ref_val, dtype, "value")
    mask = case.mask.to(device)
    assert (out.detach()[~mask] == 0).all(), "a masked position's loss is not exactly 0"
    for k, gk in zip(case.grad_of, got_grads):
        check_grad(gk.cpu(), ref_grads[k], on_dev[k].cpu(), dtype, f"grad {k}")
        if gk.dim() >= 2 and tuple(gk.shape[:2]) == tuple(mask.shape):
            assert (gk[~mask] == 0).all(), f"grad {k}: a masked position's gradient is not exactly 0"
    for k, v in others.items():
        close(v.cpu(), ref_others[k], dtype, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["teacher_topk", "topk_from_hidden"])
def test_topk_against_reference(name, dtype, device, record_property):
    """The top-K values and their own log-probs; sorted, distinct, no gradient. Ties may order the ids
    otherwise than the reference: recorded, not required."""
    g = gen(8)
    zt = rn(g, B, T, V, scale=3.0)
    zt[0, 0, 3] = zt[0, 0, 7] = zt[0, 0].max() + 0.5  # a tie at the top
    zt[1, 2, 10] = zt[1, 2, 11]
    h, w = rn(g, B, T, D), rn(g, V, D, scale=0.7)
    if name == "teacher_topk":
        logits = zt.to(dtype).to(F64)
        ids, lps = L.teacher_topk(zt.to(dtype).to(device), K, chunk_size=4)
    else:
        hq, wq = h.to(dtype), w.to(dtype)
        logits = R.ref_logits(hq.to(F64), wq.to(F64))
        ids, lps = L.topk_from_hidden(hq.to(device), wq.to(device), K, chunk_size=4)
    ref_ids, ref_lps = R.ref_teacher_topk(logits, K)
    ids, lps = ids.cpu(), lps.cpu()
    record_property("tol_used", tol_used(lps, ref_lps, dtype))
    record_property("ids_equal_reference", bool(torch.equal(ids, ref_ids)))
    close(lps, ref_lps, dtype, "values")
    close(lps, R.ref_log_softmax(logits).gather(-1, ids), dtype, "own log-probs")
    assert (lps[..., :-1] >= lps[..., 1:]).all(), "not sorted"
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all(), "ids repeat"
    assert not lps.requires_grad


@pytest.mark.parametrize("kind", list(L.SUPPORT_KINDS))
def test_build_support_against_reference(kind, device):
    g = gen(9)
    perms = torch.stack([torch.randperm(V, generator=g) for _ in range(B * T)]).view(B, T, V)
    tids, sids = perms[..., :K], perms[..., K - 2 : 2 * K - 2]  # two ids shared
    sampled_ids = torch.where(torch.rand(B, T, generator=g) < 0.5, perms[..., 0], perms[..., 3 * K])
    ids, valid = L.build_support(kind, tids.to(device), sids.to(device), sampled_ids.to(device))
    rids, rvalid = R.ref_build_support(kind, tids, sids, sampled_ids)
    assert torch.equal(ids.cpu(), rids) and torch.equal(valid.cpu(), rvalid)
