"""LSM's tail bucket (opd.losses.tail) against the float64 loop reference in tests/reference.py.

Values and gradients (student logits; hidden and weight from hidden states) on odd shapes, masks,
invalid slots, teacher ties, -inf logits, all-masked input, a support holding all the mass, and
float64 / float32 / bfloat16; properties (>= 0, 0 at the teacher, positive where renormalized
LSM is blind); the ``--tail`` option and a 2-step ``opd train --tail`` run.

Run: python -m pytest tests/losses/test_losses_tail.py -q
"""

import math

import pytest
import reference as R
import torch
from helpers import first_rollout, run_options, step_records
from loss_checks import (
    BF16,
    F32,
    F64,
    OUT_DTYPE,
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
    randn,
)

import opd.losses as L
from opd.config import ConfigError, TrainConfig

SHAPES = [(3, 5, 11, 7), (1, 1, 5, 1), (2, 4, 9, 9)]  # B, T, V, K; the last has K = V
DIRECTIONS = ["reverse", "forward"]
LOW_CASES = [(SHAPES[0], "row", d) for d in (F32, BF16, "bf16+fp32")]
CASES = [(s, m, F64) for s in SHAPES for m in ("random", "row", "none")] + LOW_CASES
HIDDEN_CASES = [(s, m, F64) for s in SHAPES for m in ("row", "none")] + LOW_CASES[:2]


def tail(zs, ids, tlp, mask, sm=None, direction="reverse"):
    return L.local_support_kl_tail(zs, ids, tlp, mask, support_mask=sm, direction=direction)


# ---------------------------------------------------------------- the reference itself


def _fd_case(full_support: bool):
    g = gen(20)
    B, T, V, K = 2, 3, 7, 3
    zs, zt = randn((B, T, V), g, 2.0), randn((B, T, V), g, 2.0)
    if full_support:  # S is the whole vocabulary: both tails sit on the clamp's floor
        ids, tlp = R.ref_teacher_topk(zt, V)
        return zs, ids, tlp, torch.ones(B, T, dtype=torch.bool), None, randn((B, T), g)
    ids = distinct_ids(B, T, K, V, g)
    zs[0, 1, ids[0, 1, 0]] = -math.inf  # a support slot the student gives no mass
    outside = [v for v in range(V) if v not in ids[1, 0].tolist()][0]
    zs[1, 0, outside] = -math.inf  # a token outside S with no student mass
    tlp = R.ref_log_softmax(zt).gather(-1, ids)
    tlp[1, 2, 1] = -math.inf  # outside the teacher's support: its student mass is tail mass
    sm = torch.ones(B, T, K, dtype=torch.bool)
    sm[0, 2, 2] = False
    mask = torch.tensor([[True, True, True], [True, False, True]])
    return zs, ids, tlp, mask, sm, randn((B, T), g)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("full_support", [False, True])
def test_reference_gradients_match_finite_differences(direction, full_support):
    zs, ids, tlp, mask, sm, gout = _fd_case(full_support)
    fn = lambda x: R.ref_local_support_kl_tail(x, ids, tlp, mask, sm, direction, gout)
    analytic = fn(zs)[1]
    numeric = R.finite_diff(lambda y: fn(y)[0], zs, gout)
    torch.testing.assert_close(analytic, numeric, rtol=1e-5, atol=1e-7)
    assert (analytic[~torch.isfinite(zs)] == 0).all()


def test_reference_tail_by_hand():
    """One position worked by hand: V = 3, S = {0}, p = (1/2, 1/4, 1/4), q_0 = 0.8."""
    zs = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]], dtype=F64))
    ids, tlp = torch.tensor([[[0]]]), torch.log(torch.tensor([[[0.8]]], dtype=F64))
    mask = torch.ones(1, 1, dtype=torch.bool)
    rev = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    fwd = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    for direction, expected in (("reverse", rev), ("forward", fwd)):
        assert R.ref_local_support_kl_tail(zs, ids, tlp, mask, None, direction)[0].item() == pytest.approx(expected)
        assert tail(zs, ids, tlp, mask, direction=direction).item() == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- from logits


@pytest.mark.parametrize("shape,mask_kind,dtype", CASES)
@pytest.mark.parametrize("support", [None, "prefix", "random"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_local_support_kl_tail(shape, mask_kind, dtype, support, direction):
    """'bf16+fp32': bf16 student logits with the float32 log-probs teacher_topk returns."""
    tdtype = F32 if dtype == "bf16+fp32" else dtype
    dtype = BF16 if dtype == "bf16+fp32" else dtype
    zs, ids, tlp, mask, sm, gout = lsm_inputs(shape, 21, dtype, support, mask_kind)
    zs, tlp = zs.requires_grad_(True), tlp.to(tdtype).requires_grad_(True)
    out = tail(zs, ids, tlp, mask, sm, direction)
    ref, ref_g = R.ref_local_support_kl_tail(zs, ids, tlp, mask, sm, direction, gout)
    assert out.shape == mask.shape and out.dtype == OUT_DTYPE[dtype]
    close(out, ref, dtype, "value")
    g, gt = grads(out, [zs, tlp], gout)
    check_teacher_constant(gt)
    check_grad(g, ref_g, zs, dtype, "grad student")
    check_masked_exact(out, g, mask)


def _neg_inf_case():
    g = gen(22)
    B, T, V, K = 2, 4, 8, 3
    zs, zt = randn((B, T, V), g, 2.0), randn((B, T, V), g, 2.0)
    ids = distinct_ids(B, T, K, V, g)
    tlp = R.ref_log_softmax(zt).gather(-1, ids)
    outside = lambda b, t: [v for v in range(V) if v not in ids[b, t].tolist()]

    zs[0, 0, ids[0, 0, 1]] = -math.inf  # one student -inf slot
    tlp[0, 1, 2] = -math.inf  # one teacher -inf slot: out of S, its student mass is tail mass
    zs[0, 2, ids[0, 2]] = -math.inf  # no student mass on S: the tail term alone (zero gradient)
    tlp[0, 3] = -math.inf  # S empty -> 0
    zs[1, 0] = -math.inf  # no student distribution -> 0
    zs[1, 1, outside(1, 1)] = -math.inf  # student tail 0: on the clamp's floor, finite
    zs[1, 2, ids[1, 2, 1]] = -math.inf
    tlp[1, 2, 1] = -math.inf  # student and teacher -inf on the same slot
    sm = torch.ones(B, T, K, dtype=torch.bool)
    sm[1, 3] = False  # no valid slot -> 0
    return zs, ids, tlp, torch.ones(B, T, dtype=torch.bool), sm, randn((B, T), g)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [F64, F32, BF16])
def test_local_support_kl_tail_neg_inf(direction, dtype):
    zs, ids, tlp, mask, sm, gout = _neg_inf_case()
    zs, tlp = zs.to(dtype).requires_grad_(True), tlp.to(dtype)
    out = tail(zs, ids, tlp, mask, sm, direction)
    ref, ref_g = R.ref_local_support_kl_tail(zs, ids, tlp, mask, sm, direction, gout)
    assert torch.isfinite(out).all(), out
    close(out, ref, dtype, "value")
    (g,) = grads(out, [zs], gout)
    check_grad(g, ref_g, zs, dtype, "grad student")
    for b, t in [(0, 3), (1, 0), (1, 3)]:
        assert out[b, t].item() == 0.0 and (g[b, t] == 0).all(), (b, t)
    # No student mass on S: all its mass is tail mass whatever the logits, so no gradient.
    assert out[0, 2].item() != 0.0 and (g[0, 2] == 0).all()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_teacher_ties(direction):
    B, T, V, K = 3, 5, 11, 7
    g = gen(23)
    zt = torch.randint(0, 3, (B, T, V), generator=g).to(F64)  # many exact ties in the teacher
    ids, tlp = L.teacher_topk(zt, K)
    zs = randn((B, T, V), g, 2.0).requires_grad_(True)
    mask, gout = make_mask(B, T, "random", g), randn((B, T), g)
    out = tail(zs, ids, tlp, mask, direction=direction)
    ref, ref_g = R.ref_local_support_kl_tail(zs, ids, tlp, mask, None, direction, gout)
    close(out, ref, F64, "value")
    check_grad(grads(out, [zs], gout)[0], ref_g, zs, F64, "grad student")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [F64, F32, BF16])
def test_support_holding_all_the_mass(direction, dtype):
    """K = V: both tails are ~0, clamped to the floor: finite, and the full-vocabulary KL."""
    B, T, V = 2, 3, 9
    g = gen(24)
    zs, zt = randn((B, T, V), g, 2.0, dtype).requires_grad_(True), randn((B, T, V), g, 2.0)
    mask, gout = make_mask(B, T, "all", g), randn((B, T), g)
    ids, tlp = L.teacher_topk(zt, V)
    over = tlp + 1e-6  # a teacher whose reported top-K sums past 1 (rounding): still finite
    for t_lp in (tlp, over):
        out = tail(zs, ids, t_lp.to(dtype), mask, direction=direction)
        (gs,) = grads(out, [zs], gout)
        assert torch.isfinite(out).all() and torch.isfinite(gs).all()
    out = tail(zs, ids, tlp.to(dtype), mask, direction=direction)
    ref, ref_g = R.ref_local_support_kl_tail(zs, ids, tlp, mask, None, direction, gout)
    close(out, ref, dtype, "value")
    check_grad(grads(out, [zs], gout)[0], ref_g, zs, dtype, "grad student")
    full = L.full_vocab_kl(zs.detach().to(F64), zt, mask, direction)
    close(out, full, dtype if dtype != F64 else F32, "full-vocabulary KL")


def test_float32_matches_float64():
    zs, ids, tlp, mask, sm, _ = lsm_inputs((3, 5, 11, 7), 25, F64, "random")
    for direction in DIRECTIONS:
        z64, z32 = fresh(zs, zs.to(F32))
        o64, o32 = tail(z64, ids, tlp, mask, sm, direction), tail(z32, ids, tlp.to(F32), mask, sm, direction)
        assert o32.dtype == F32
        close(o32, o64, F32, "value")
        g64, g32 = grads(o64, [z64], torch.ones(3, 5))[0], grads(o32, [z32], torch.ones(3, 5))[0]
        close(g32, g64, F32, "grad")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_float32_keeps_its_precision_when_s_holds_little_mass(direction):
    """S holds ~1e-6 of each model's mass, so the KL is ~1e-7 and is mostly the difference of two
    tails near 1: log(1 - e^x) must be log1p(-e^x) there (log(-expm1(x)) rounds it to 0)."""
    V, K = 40, 2
    zt = torch.zeros(1, 2, V, dtype=F64)
    zt[..., :K] = torch.tensor([-11.0, -12.0], dtype=F64)
    zs = zt.clone()
    zs[0, 0, :K] = torch.tensor([-12.0, -11.5], dtype=F64)
    zs[0, 1, :K] = torch.tensor([-10.0, -12.5], dtype=F64)
    ids = torch.arange(K).expand(1, 2, K)  # a support the models give little mass (a student's top-K)
    tlp = torch.log_softmax(zt, -1)[..., :K]
    mask = torch.ones(1, 2, dtype=torch.bool)
    ref, ref_g = R.ref_local_support_kl_tail(zs, ids, tlp, mask, None, direction)
    z32 = zs.to(F32).requires_grad_(True)
    out = tail(z32, ids, tlp.to(F32), mask, direction=direction)
    assert (ref > 1e-8).all() and (ref < 1e-5).all(), ref
    torch.testing.assert_close(out.detach().to(F64), ref, rtol=1e-3, atol=0.0)
    g = grads(out, [z32], torch.ones(1, 2))[0].to(F64)
    torch.testing.assert_close(g, ref_g, rtol=1e-3, atol=1e-10)


def test_bad_direction_is_refused():
    zs, ids, tlp, mask, _, _ = lsm_inputs((1, 2, 5, 2), 26)
    with pytest.raises(ValueError, match="direction"):
        tail(zs, ids, tlp, mask, direction="both")
    with pytest.raises(ValueError, match="direction"):
        L.local_support_kl_tail_from_hidden(torch.zeros(1, 2, 3), torch.zeros(5, 3), ids, tlp, mask, direction="x")


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_nonnegative_and_zero_at_the_teacher(direction):
    B, T, V, K = 3, 5, 13, 4
    for seed in range(6):
        g = gen(30 + seed)
        zs, zt = randn((B, T, V), g, 3.0), randn((B, T, V), g, 3.0)
        mask = make_mask(B, T, "all", g)
        for kind in L.SUPPORT_KINDS:
            tids, sids = L.teacher_topk(zt, K)[0], L.teacher_topk(zs, K)[0]
            ids, sm = L.build_support(kind, tids, sids, torch.randint(0, V, (B, T), generator=g))
            tlp = torch.log_softmax(zt, -1).gather(-1, ids)
            # >= 0 up to the clamp: the K + 1 masses may sum to 1 + 1e-7.
            assert (tail(zs, ids, tlp, mask, sm, direction) >= -1e-7).all(), (seed, kind)
            same = (zt + randn((B, T, 1), g, 5.0)).requires_grad_(True)  # the teacher's softmax
            out = tail(same, ids, tlp, mask, sm, direction)
            close(out, torch.zeros(B, T, dtype=F64), F64, f"student == teacher, {kind}")
            close(grads(out, [same], torch.ones(B, T))[0], torch.zeros(B, T, V, dtype=F64), F64, kind)


def _blind_spot(direction="reverse"):
    """A student equal to the teacher on S up to scale, with half its mass on a token outside S."""
    V, K, fmt = 12, 3, 11  # token 11: a format token the teacher never ranks
    zt = torch.full((1, 1, V), -2.0, dtype=F64)
    zt[..., :K] = torch.tensor([3.0, 2.0, 1.0], dtype=F64)
    ids, tlp = L.teacher_topk(zt, K)
    zs = zt.clone()
    zs[..., fmt] = torch.logsumexp(zt[0, 0], -1)  # p(fmt) ~ 1/2
    return zs.requires_grad_(True), ids, tlp, torch.ones(1, 1, dtype=torch.bool), fmt


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_the_blind_spot_renormalized_lsm_misses(direction):
    zs, ids, tlp, mask, fmt = _blind_spot()
    assert torch.softmax(zs[0, 0], -1)[fmt].item() == pytest.approx(0.5, abs=0.01)
    lsm = L.local_support_kl(zs, ids, tlp, mask)
    assert abs(lsm.item()) < 1e-12 and (grads(lsm, [zs], torch.ones(1, 1))[0].abs() < 1e-12).all()
    out = tail(zs, ids, tlp, mask, direction=direction)
    assert out.item() > 0.1, out
    assert grads(out, [zs], torch.ones(1, 1))[0][0, 0, fmt] > 0.1  # descent lowers the format token


def test_descent_on_the_tail_loss_takes_the_mass_outside_s_back():
    """A few gradient steps: renormalized LSM leaves the format token's half of the mass where it
    is; the tail loss brings it toward the teacher's (~1%)."""
    moved = {}
    for name in ("lsm", "tail"):
        zs, ids, tlp, mask, fmt = _blind_spot()
        opt = torch.optim.SGD([zs], lr=1.0)
        for _ in range(100):
            opt.zero_grad()
            loss = L.local_support_kl(zs, ids, tlp, mask) if name == "lsm" else tail(zs, ids, tlp, mask)
            loss.sum().backward()
            opt.step()
        moved[name] = torch.softmax(zs.detach()[0, 0], -1)[fmt].item()
    assert moved["lsm"] == pytest.approx(0.5, abs=0.01)
    assert moved["tail"] < 0.05, moved


# ---------------------------------------------------------------- from hidden states


@pytest.mark.parametrize("shape,mask_kind,dtype", HIDDEN_CASES)
@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_local_support_kl_tail_from_hidden(shape, mask_kind, dtype, chunk_size, direction):
    h, w, ids, tlp, mask, sm, gout = hidden_inputs(shape, 27, dtype, mask_kind=mask_kind)
    out = L.local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm, direction, chunk_size)
    assert out.dtype == OUT_DTYPE[dtype] and out.shape == mask.shape
    ref, ref_gh, ref_gw = R.ref_local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm, direction, gout)
    gh, gw = check_support_loss_from_hidden(out, ref, ref_gh, ref_gw, h, w, tlp, mask, gout, dtype)
    if dtype == F64:  # same as building the logits
        h2, w2 = fresh(h, w)
        out2 = tail(h2 @ w2.T, ids, tlp, mask, sm, direction)
        close(out, out2, F64)
        for a, b in zip((gh, gw), grads(out2, [h2, w2], gout)):
            close(a, b, F64)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_from_hidden_with_a_banned_token_in_the_head(direction):
    """A -inf head entry against a positive hidden coordinate: that token's logit is -inf
    (in S at some positions, outside at others); values and gradients stay finite and right."""
    h, w, ids, tlp, mask, sm, gout = hidden_inputs((2, 4, 9, 3), 28, F64, mask_kind="all")
    banned = int(ids[0, 0, 1])
    with torch.no_grad():
        h.abs_()
        w[banned, 0] = -math.inf
    out = L.local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm, direction, 3)
    ref, ref_gh, ref_gw = R.ref_local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm, direction, gout)
    close(out, ref, F64, "value")
    gh, gw = grads(out, [h, w], gout)
    check_grad(gh, ref_gh, h, F64, "grad hidden")
    finite = torch.isfinite(w.detach())
    close(gw[finite], ref_gw[finite], F64, "grad weight")


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_all_masked_input_is_zero_with_zero_gradients(dtype):
    h, w, ids, tlp, mask, sm, gout = hidden_inputs((2, 3, 7, 3), 29, dtype, mask_kind="none")
    assert not mask.any()
    for out, inputs in (
        (L.local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm), [h, w]),
        (tail(h @ w.T, ids, tlp, mask, sm), [h, w]),
    ):
        assert (out == 0).all()
        for g in grads(out, inputs, gout):
            assert (g == 0).all()
    L.token_mean(L.local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm), mask).backward()


# ---------------------------------------------------------------- the option and the trainer


def test_tail_option_defaults_off_and_refuses_what_it_cannot_do():
    assert TrainConfig.from_flat().objective.tail is False
    assert TrainConfig.from_flat(tail=True).objective.tail is True
    with pytest.raises(ConfigError, match="--objective lsm"):
        TrainConfig.from_flat(tail=True, objective="sampled")
    with pytest.raises(ConfigError, match="no-renormalize"):
        TrainConfig.from_flat(tail=True, renormalize=False)


def test_trainer_tail_loss_is_the_dense_one_on_rollouts(tiny_models, tmp_path):
    """objective_loss with --tail computes the tail loss from hidden states: the dense one."""
    from helpers import SMALL

    from opd.models.loading import head_weight
    from opd.rollout.forward import response_hidden
    from opd.training import loop as train_mod
    from opd.training.loss import loss_mask, objective_loss

    student, teacher = tiny_models
    cfg = TrainConfig.from_flat(
        student=str(student), teacher=str(teacher), out=str(tmp_path / "run"), **SMALL, tail=True
    )
    run = train_mod.setup(cfg)
    batch, _, _ = first_rollout(run)
    mask = loss_mask(batch, run.special_ids, run.cfg.objective.mask_special)
    scores = run.tasks[0].teacher.score(batch, run.cfg.objective.k)
    params = [p for p in run.student.parameters() if p.requires_grad]
    loss_NT, _ = objective_loss(run.cfg, run.student, run.tasks[0].teacher, batch, scores, mask)
    ids, smask = L.build_support("teacher_topk", scores.topk_ids_NTK)  # the default support
    t_lp = scores.topk_logprobs_NTK
    logits = response_hidden(run.student, batch) @ head_weight(run.student).T
    dense_NT = L.local_support_kl_tail(logits, ids, t_lp, mask, support_mask=smask)
    assert mask.any() and float(dense_NT.detach().sum()) > 0
    torch.testing.assert_close(loss_NT, dense_NT, rtol=1e-5, atol=1e-6)
    for g, d in zip(torch.autograd.grad(loss_NT.sum(), params), torch.autograd.grad(dense_NT.sum(), params)):
        torch.testing.assert_close(g, d, rtol=1e-4, atol=1e-6)


def test_opd_train_with_tail_logs_finite_losses(tiny_models, tmp_path):
    from helpers import QUICK_RUN
    from typer.testing import CliRunner

    from opd.cli import app

    student, teacher = tiny_models
    out = tmp_path / "run"
    cli = ["train", "--student", str(student), "--teacher", str(teacher), "--out", str(out)]
    for key, value in {**QUICK_RUN, "eval_samples": 0}.items():
        cli += [f"--{key.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(app, cli + ["--objective", "lsm", "--tail"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    steps = step_records(out)
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert math.isfinite(r["train/loss"]) and r["train/loss"] > 0.0
        assert math.isfinite(float(r["train/grad_norm"]))
    assert run_options(out)["tail"] is True
