"""Inputs and checks shared by the loss tests (losses/test_losses.py, losses/test_losses_tail.py): seeded
random inputs, the per-dtype tolerances, and the checks every loss meets (values and gradients against
tests/reference.py, no gradient to the teacher, masked positions exactly zero).
"""

import math

import reference as R
import torch

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
TOL = {F64: (1e-8, 1e-10), F32: (1e-5, 1e-5), BF16: (2e-2, 2e-2), F16: (2e-2, 2e-2)}
OUT_DTYPE = {F64: F64, F32: F32, BF16: F32, F16: F32}  # spec: low precision computes in fp32
D = 8  # the hidden width of the from-hidden inputs


def close(got, expected, dtype, msg=""):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        got.detach().to(F64), expected.to(F64), rtol=rtol, atol=atol, msg=lambda m: f"{msg}\n{m}"
    )


def gen(seed):
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def randn(shape, g, scale=1.0, dtype=F64):
    return (torch.randn(shape, generator=g, dtype=F64) * scale).to(dtype)


def make_mask(B, T, kind, g):
    m = torch.rand(B, T, generator=g) < 0.7
    m[: {"row": 1, "none": B}.get(kind, 0)] = False
    return m | (kind == "all")


def distinct_ids(B, T, K, V, g):
    return torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)


def make_support_mask(B, T, K, kind, g):
    if kind == "prefix":  # variable-size supports padded at the end, some empty
        return torch.arange(K) < torch.randint(0, K + 1, (B, T, 1), generator=g)
    return None if kind is None else torch.rand(B, T, K, generator=g) < 0.6


def grads(out, inputs, gout):
    """d sum(gout * out) / d inputs; unused inputs count as zero gradient."""
    assert out.requires_grad, "output must be differentiable (backward must not crash)"
    gs = torch.autograd.grad(out, inputs, grad_outputs=gout.to(out.dtype), allow_unused=True, retain_graph=True)
    return [torch.zeros_like(x) if gi is None else gi for x, gi in zip(inputs, gs)]


def check_grad(got, expected, x, dtype, msg):
    assert got.dtype == x.dtype, f"{msg}: grad dtype {got.dtype} != input dtype {x.dtype}"
    assert torch.isfinite(got).all(), f"{msg}: non-finite gradient"
    close(got, expected, dtype, msg)


def check_teacher_constant(grad_teacher):
    """The teacher is a constant: a teacher tensor that requires grad gets a zero gradient."""
    assert (grad_teacher == 0).all(), "teacher received a gradient"


def check_masked_exact(out, grad_BTX, mask):
    """Masked positions: exactly 0 and exactly zero gradient."""
    assert (out.detach()[~mask] == 0).all()
    assert (grad_BTX[~mask] == 0).all()


def check_support_loss_from_hidden(out, ref, ref_gh, ref_gw, h, w, tlp, mask, gout, dtype):
    """A support loss from hidden states against its reference: value, both gradients, none to the
    teacher's log-probs, and masked positions exactly 0. Returns the two gradients."""
    close(out, ref, dtype, "value")
    gh, gw, gt = grads(out, [h, w, tlp], gout)
    check_grad(gh, ref_gh, h, dtype, "grad hidden")
    check_grad(gw, ref_gw, w, dtype, "grad weight")
    check_teacher_constant(gt)
    check_masked_exact(out, gh, mask)
    return gh, gw


def lsm_inputs(shape, seed, dtype=F64, support=None, mask_kind="random"):
    B, T, V, K = shape
    g = gen(seed)
    zs, zt = randn((B, T, V), g, 2.0), randn((B, T, V), g, 2.0)
    ids = distinct_ids(B, T, K, V, g)
    tlp = R.ref_log_softmax(zt).gather(-1, ids).to(dtype)
    return (
        zs.to(dtype),
        ids,
        tlp,
        make_mask(B, T, mask_kind, g),
        make_support_mask(B, T, K, support, g),
        randn((B, T), g),
    )


def hidden_inputs(shape, seed, dtype, shared_ids=False, mask_kind="row"):
    B, T, V, K = shape
    g = gen(seed)
    h = randn((B, T, D), g, 1.0, dtype).requires_grad_(True)
    w = randn((V, D), g, 0.7, dtype).requires_grad_(True)
    ids = distinct_ids(B, T, K, V, g)
    if shared_ids:  # every position uses the same ids: weight grads accumulate across positions
        ids = ids[:1, :1].expand(B, T, K).contiguous()
    tlp = R.ref_log_softmax(randn((B, T, V), g, 2.0)).gather(-1, ids)
    tlp[..., -1][torch.rand(B, T, generator=g) < 0.3] = -math.inf
    return (
        h,
        w,
        ids,
        tlp.to(dtype).requires_grad_(True),
        make_mask(B, T, mask_kind, g),
        make_support_mask(B, T, K, "prefix", g),
        randn((B, T), g),
    )


def fresh(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]
