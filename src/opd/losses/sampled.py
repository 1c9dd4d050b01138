"""Sampled-token OPD: the per-token reward r_t = log q(y_t) - log p(y_t) and its policy gradient.

The reward and the discounted reward-to-go follow the OPD papers (gamma = 0 token level,
gamma = 1 sequence level); the surrogate adds an importance ratio and optional PPO clipping for
a batch reused by later updates, and a truncated importance weight for rollouts an older policy
sampled (``--max-staleness``), which the on-policy papers do not need. The student's log-probs
come from :func:`token_logprobs_from_hidden`, which never holds more than a chunk of logits.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable

from opd.losses._common import as_bool, chunk_buffers, compute_dtype, head_for_grad_h, position_chunks
from opd.losses.head import Head, HeadLike, as_head, cast_head, chunk_logits, head_dtype, raw_grad_


def gather_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``ids_BT`` under ``softmax(logits_BTV)``.

    Shapes:
        logits_BTV: (B, T, V); ids_BT: (B, T) -> logp_BT: (B, T)
    """
    logits = logits_BTV.to(compute_dtype(logits_BTV))
    picked = logits.gather(-1, ids_BT.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


class _TokenLogprobsFromHidden(torch.autograd.Function):
    """log_softmax(head(h))[id] a chunk of rows at a time, with a hand-written backward.

    The backward recomputes one chunk's (chunk, V) logits and accumulates the weight gradient
    into a single (V, D) buffer with addmm_: checkpointing each chunk instead would make autograd
    allocate (and later sum) a full V x D gradient per chunk.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        bias_V: torch.Tensor | None,
        head: Head,
        ids_N: torch.Tensor,
        chunk_size: int | None,
    ) -> torch.Tensor:
        lse_N = hidden_ND.new_empty(hidden_ND.shape[0])
        picked_N = torch.empty_like(lse_N)
        buf = chunk_buffers(1, hidden_ND.shape[0], chunk_size, weight_VD.shape[0], hidden_ND.dtype, hidden_ND.device)
        for sl in position_chunks(hidden_ND.shape[0], chunk_size):
            logits_cV = chunk_logits(hidden_ND[sl], weight_VD, bias_V, head, buf[0, : sl.stop - sl.start])
            picked_N[sl] = logits_cV.gather(-1, ids_N[sl].unsqueeze(-1)).squeeze(-1)
            lse_N[sl] = torch.logsumexp(logits_cV, dim=-1)
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, ids_N, lse_N)
        ctx.chunk_size, ctx.head = chunk_size, head
        return picked_N - lse_N

    @staticmethod
    @once_differentiable  # the backward writes into reused buffers; no graph of it is needed
    def backward(
        ctx: Any, grad_N: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden_ND, weight_VD, bias_V, ids_N, lse_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden_ND) if need_h else None
        grad_w = torch.zeros_like(weight_VD) if need_w else None
        grad_b = torch.zeros_like(bias_V) if need_b else None
        # Rows with a zero upstream gradient (masked positions) contribute nothing: skip them.
        rows = grad_N.nonzero().squeeze(-1)
        w_h = head_for_grad_h(weight_VD) if need_h else weight_VD
        bufs = chunk_buffers(2, rows.numel(), ctx.chunk_size, weight_VD.shape[0], hidden_ND.dtype, hidden_ND.device)
        for sl in position_chunks(rows.numel(), ctx.chunk_size):
            r = rows[sl]
            h_cD, g_c = hidden_ND[r], grad_N[r]
            z_cV = chunk_logits(h_cD, weight_VD, bias_V, ctx.head, bufs[0, : r.numel()])
            # d logp[id] / d logits = onehot(id) - softmax(logits), scaled by the upstream grad.
            d_cV = torch.sub(z_cV, lse_N[r].unsqueeze(-1), out=bufs[1, : r.numel()]).exp_().mul_(-g_c.unsqueeze(-1))
            d_cV.scatter_add_(-1, ids_N[r].unsqueeze(-1), g_c.unsqueeze(-1))
            raw_grad_(d_cV, z_cV, ctx.head)
            if grad_h is not None:  # need_h
                grad_h[r] = d_cV @ w_h
            if grad_w is not None:  # need_w
                grad_w.addmm_(d_cV.T, h_cD)
            if grad_b is not None:  # need_b
                grad_b.add_(d_cV.sum(0))
        return grad_h, grad_w, grad_b, None, None, None


def token_logprobs_from_hidden(
    hidden_BTD: torch.Tensor, lm_head_weight_VD: HeadLike, ids_BT: torch.Tensor, chunk_size: int = 256
) -> torch.Tensor:
    """Differentiable log-probs of ``ids_BT`` from hidden states, a chunk of logits at a time.

    ``lm_head_weight_VD`` is the model's :class:`~opd.losses.Head` (bias, scale, soft-cap) or a plain
    (V, D) weight. Only one chunk's (chunk, V) logits exist at a time, in the forward and in the
    backward (which recomputes them and skips positions whose upstream gradient is zero).
    Gradients reach the hidden states, the weight and the bias.

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D) or a Head; ids_BT: (B, T) -> logp_BT: (B, T)
    """
    head = as_head(lm_head_weight_VD)
    B, T, D = hidden_BTD.shape
    dtype = head_dtype(head, hidden_BTD)
    flat_ND = hidden_BTD.reshape(B * T, D).to(dtype)
    w_VD, b_V = cast_head(head, dtype)
    ids_N = ids_BT.reshape(-1)
    # torch's Function.apply is unannotated, hence the ignore; it returns forward's tensor
    logp_N = _TokenLogprobsFromHidden.apply(flat_ND, w_VD, b_V, head, ids_N, chunk_size)  # type: ignore[no-untyped-call]
    return cast(torch.Tensor, logp_N).view(B, T)


def sampled_token_advantages(
    student_logprobs_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float = 0.0,
    action_mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Discounted reward-to-go of the sampled-token OPD reward (detached).

    r_t = log q(y_t) - log p(y_t); A_t = sum over unmasked u >= t of gamma^d(t, u) r_u, where the
    distance d(t, u) counts the positions of ``action_mask_BT`` (the tokens the model wrote; a
    position of ``mask_BT`` always counts) in [t, u): environment tokens between the turns of an
    episode add no distance. Without an action mask every position counts, so d = u - t; a masked
    position inside the action mask (a special token) counts but adds no reward. gamma = 0 is
    token-level OPD, gamma = 1 the sequence-level reward-to-go.

    Shapes:
        student_logprobs_BT, teacher_logprobs_BT, mask_BT, action_mask_BT: (B, T) -> adv_BT: (B, T)
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must lie in [0, 1] (0: token-level OPD, 1: sequence level)")
    mask = as_bool(mask_BT)
    dtype = compute_dtype(student_logprobs_BT, teacher_logprobs_BT)
    r = teacher_logprobs_BT.detach().to(dtype) - student_logprobs_BT.detach().to(dtype)
    r = torch.where(mask, r, torch.zeros_like(r))
    if gamma == 0.0:
        return r
    steps = None if action_mask_BT is None else as_bool(action_mask_BT) | mask
    # Backward scan: A_t = r_t + gamma * A_{t+1} over counted positions; T is the response
    # length, so a loop is cheap. Positions that do not count carry the running sum past them.
    adv = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        stepped = r[:, t] + gamma * running
        running = stepped if steps is None else torch.where(steps[:, t], stepped, running)
        adv[:, t] = running
    return torch.where(mask, adv, torch.zeros_like(adv))


def sampled_token_pg_loss(
    student_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor | None = None,
    clip_eps: float | None = None,
) -> torch.Tensor:
    """Policy-gradient surrogate whose gradient is -A_t * grad log p(y_t).

    On policy (``old_logprobs_BT=None``) the ratio is exp(logp - logp.detach()) = 1 in value, so
    the loss equals -A_t and its gradient the REINFORCE gradient. For rollouts from an older
    policy the importance ratio exp(logp - old) is used, optionally PPO-clipped to
    [1 - clip_eps, 1 + clip_eps].

    Shapes:
        student_logprobs_BT, advantages_BT, mask_BT, old_logprobs_BT: (B, T) -> loss_BT: (B, T)
    """
    dtype = compute_dtype(student_logprobs_BT, advantages_BT)
    logp = student_logprobs_BT.to(dtype)
    old = logp.detach() if old_logprobs_BT is None else old_logprobs_BT.detach().to(dtype)
    adv = advantages_BT.detach().to(dtype)
    mask = as_bool(mask_BT)
    log_ratio = torch.where(mask, logp - old, torch.zeros_like(logp))
    ratio = log_ratio.exp()
    loss = -ratio * adv
    if clip_eps is not None:
        if clip_eps <= 0:
            raise ValueError(f"clip_eps={clip_eps} must be positive (e.g. 0.2), or None for no clipping")
        clipped = -ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
        loss = torch.maximum(loss, clipped)
    return torch.where(mask, loss, torch.zeros_like(loss))


def truncated_importance_weight(
    policy_logprobs_BT: torch.Tensor, behaviour_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(pi(y_t) / mu(y_t), cap): the weight that corrects a policy gradient for tokens an older
    policy mu sampled (truncated importance sampling, as TRL and verl apply to their engines'
    rollouts). Detached: it scales the gradient and is not trained; 0 outside the mask.

    ``policy_logprobs_BT``: log pi(y_t) of the policy being updated (as the batch's first update
    sees it); ``behaviour_logprobs_BT``: log mu(y_t), what the rollout engine sampled with.

    Shapes:
        policy_logprobs_BT, behaviour_logprobs_BT, mask_BT: (B, T) -> weight_BT: (B, T)
    """
    if not cap >= 1.0:
        raise ValueError(f"cap={cap} must be >= 1 (2 is the usual truncation; inf: none)")
    dtype = compute_dtype(policy_logprobs_BT, behaviour_logprobs_BT)
    mask = as_bool(mask_BT)
    log_w = policy_logprobs_BT.detach().to(dtype) - behaviour_logprobs_BT.detach().to(dtype)
    log_w = torch.where(mask, log_w, torch.zeros_like(log_w))
    return torch.where(mask, log_w.exp().clamp(max=cap), torch.zeros_like(log_w))
