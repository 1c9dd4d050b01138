"""Float64 reference for opd.losses, written from the formulas below with explicit Python loops.

Independent of src/opd/losses/ on purpose: every function loops over batch, positions and
support slots with plain Python floats and `math`, and derives gradients by hand (the softmax
Jacobian: d/dz_j F(softmax(z)) = p_j (g_j - sum_i p_i g_i) with g = dF/dp). The hand gradients
are checked against central finite differences in tests/losses/test_losses.py (the tail bucket's in
tests/losses/test_losses_tail.py).

Formulas: LSM is lsm_blog_explainer.txt section 04 (renormalized reverse KL over the teacher's
top-K; the paper is arXiv:2603.25562, "Revisiting On-Policy Distillation: Empirical Failure Modes
and Simple Fixes"); full-vocab and sampled-token OPD are rethinking_opd_summary.txt eq. 3-4
(arXiv:2604.13016, "Rethinking On-Policy Distillation of Large Language Models"). The .txt files
are the project's development copies of the papers (not in this repository); the arXiv numbers find
them; generalized JSD
follows the TRL convention (beta=0 forward KL, beta=1 reverse KL); LSM's tail bucket is TRL's
``add_tail_bucket`` (K support tokens plus the mass outside them). Zero-probability tokens in
a KL: 0 log 0 = 0, and an infinite term (mass where the other distribution has none) is left
out of the sum (opd's documented rule, see ``_counted``).

Loss functions take an optional cotangent `gout_BT` (default all ones) and return
(value_BT, d sum(gout * value) / d input) as float64 torch tensors. Torch is only used for I/O.
"""

import math

import torch

INF = math.inf


def _f(x):
    return x.detach().to(torch.float64).tolist() if torch.is_tensor(x) else x


def _i(x):
    return x.detach().long().tolist() if torch.is_tensor(x) else x


def _b(x):
    return (x.detach() != 0).tolist() if torch.is_tensor(x) else x


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _ones_like_mask(mask):
    return [[1.0 for _ in row] for row in mask]


def log_softmax_row(z):
    """log softmax of a list; -inf entries stay -inf; None if every entry is -inf."""
    m = max(z)
    if m == -INF:
        return None
    lse = m + math.log(sum(math.exp(v - m) for v in z))
    return [v - lse for v in z]


def _softmax_vjp(lp, g):
    """d/dz of sum_i g_i p_i(z), p = exp(lp); entries with p = 0 get 0."""
    p = [math.exp(v) for v in lp]
    pbar = sum(pi * gi for pi, gi in zip(p, g) if pi > 0.0)
    return [pi * (gi - pbar) if pi > 0.0 else 0.0 for pi, gi in zip(p, g)]


def ref_log_softmax(logits_BTV):
    """(B,T,V) log softmax, loop over positions."""
    return _t([[log_softmax_row(row) for row in seq] for seq in _f(logits_BTV)])


def ref_logits(hidden_BTD, weight_VD):
    """hidden @ weight.T with explicit loops."""
    h, w = _f(hidden_BTD), _f(weight_VD)
    return _t([[[sum(a * b for a, b in zip(hv, wv)) for wv in w] for hv in seq] for seq in h])


def ref_hidden_grads(hidden_BTD, weight_VD, grad_logits_BTV):
    """Chain rule through logits = hidden @ W.T: returns (grad_hidden, grad_weight).

    A logit whose gradient is exactly 0 contributes nothing to grad_hidden, also where its
    weight row holds -inf (a token banned by the head: its logit is -inf whatever the hidden
    state, so 0 * inf is 0 here, not NaN).
    """
    h, w, g = _f(hidden_BTD), _f(weight_VD), _f(grad_logits_BTV)
    V, D = len(w), len(w[0])
    gw = [[0.0] * D for _ in range(V)]
    gh = []
    for b in range(len(h)):
        gh.append([])
        for t in range(len(h[b])):
            gh[b].append([sum(g[b][t][v] * w[v][d] for v in range(V) if g[b][t][v] != 0.0) for d in range(D)])
            for v in range(V):
                for d in range(D):
                    gw[v][d] += g[b][t][v] * h[b][t][d]
    return _t(gh), _t(gw)


def ref_teacher_topk(logits_BTV, k):
    """K largest log-probs per position, descending (ties broken by lower id)."""
    ids, lps = [], []
    for seq in _f(logits_BTV):
        ids.append([])
        lps.append([])
        for row in seq:
            lp = log_softmax_row(row)
            order = sorted(range(len(row)), key=lambda v: (-lp[v], v))[:k]
            ids[-1].append(order)
            lps[-1].append([lp[v] for v in order])
    return torch.tensor(ids, dtype=torch.long), _t(lps)


def _lsm_row(z, ids, tlp, smask, renormalize, forward_share=0.0):
    V = len(z)
    grad = [0.0] * V
    valid = [j for j in range(len(ids)) if smask[j] and tlp[j] > -INF]
    if not valid:
        return 0.0, grad
    if renormalize:
        lp = log_softmax_row([z[ids[j]] for j in valid])
        if lp is None:  # student -inf on every valid slot
            return 0.0, grad
        lq = log_softmax_row([tlp[j] for j in valid])
        kl = 0.0
        for a, c in zip(lp, lq):
            if a > -INF:
                kl += math.exp(a) * (a - c)
        for n, j in enumerate(valid):
            if lp[n] > -INF:
                grad[ids[j]] += math.exp(lp[n]) * (lp[n] - lq[n] - kl)
        if not forward_share:
            return kl, grad
        # Forward KL(q_hat || p_hat) on the same slots; a slot the student gives 0 would be an infinite
        # term and is left out. F = sum q (log q - log p)  =>  dF/dp_n = -q_n / p_n.
        fkl = sum(math.exp(c) * (c - a) for a, c in zip(lp, lq) if a > -INF)
        g_slots = _softmax_vjp(lp, [-math.exp(c - a) if a > -INF else 0.0 for a, c in zip(lp, lq)])
        b = forward_share
        for n, j in enumerate(valid):
            grad[ids[j]] = (1 - b) * grad[ids[j]] + b * g_slots[n]
        return (1 - b) * kl + b * fkl, grad
    lpf = log_softmax_row(z)
    g = [0.0] * V  # dL/dp over the full vocab
    kl = 0.0
    for j in valid:
        a = lpf[ids[j]]
        if a == -INF:
            continue
        kl += math.exp(a) * (a - tlp[j])
        g[ids[j]] += a - tlp[j] + 1.0
    return kl, _softmax_vjp(lpf, g)


def _per_support_row(row, student_BTV, ids_BTK, tlp_BTK, mask_BT, support_mask_BTK, gout_BT):
    """A support loss position by position: ``row(logits, ids, teacher log-probs, valid slots)`` gives
    (value, d value / d logits) of one unmasked position; masked ones are 0 with zero gradient."""
    z, ids, tlp, mask = _f(student_BTV), _i(ids_BTK), _f(tlp_BTK), _b(mask_BT)
    sm = _b(support_mask_BTK) if support_mask_BTK is not None else None
    gout = _f(gout_BT) if gout_BT is not None else _ones_like_mask(mask)
    out, grads = [], []
    for b in range(len(z)):
        out.append([])
        grads.append([])
        for t in range(len(z[b])):
            V, K = len(z[b][t]), len(ids[b][t])
            if not mask[b][t]:
                out[b].append(0.0)
                grads[b].append([0.0] * V)
                continue
            s = sm[b][t] if sm is not None else [True] * K
            kl, g = row(z[b][t], ids[b][t], tlp[b][t], s)
            out[b].append(kl)
            grads[b].append([gout[b][t] * x for x in g])
    return _t(out), _t(grads)


def ref_local_support_kl(
    student_BTV, ids_BTK, tlp_BTK, mask_BT, renormalize=True, support_mask_BTK=None, gout_BT=None, forward_share=0.0
):
    """Local support KL per position; returns (kl_BT, grad wrt student logits). ``forward_share`` b:
    (1 - b) KL(p_hat || q_hat) + b KL(q_hat || p_hat) on the renormalized support."""
    row = lambda z, ids, tlp, s: _lsm_row(z, ids, tlp, s, renormalize, forward_share)
    return _per_support_row(row, student_BTV, ids_BTK, tlp_BTK, mask_BT, support_mask_BTK, gout_BT)


def ref_build_support(kind, teacher_ids_BTK, student_ids_BTK=None, sampled_ids_BT=None):
    """(ids_BTM, valid_BTM) following the spec table, one position at a time."""
    tids = _i(teacher_ids_BTK)
    sids = _i(student_ids_BTK) if student_ids_BTK is not None else None
    samp = _i(sampled_ids_BT) if sampled_ids_BT is not None else None
    ids, valid = [], []
    for b in range(len(tids)):
        ids.append([])
        valid.append([])
        for t in range(len(tids[b])):
            tk = tids[b][t]
            sk = sids[b][t] if sids is not None else None
            if kind == "teacher_topk":
                row, ok = list(tk), [True] * len(tk)
            elif kind == "student_topk":
                row, ok = list(sk), [True] * len(sk)
            elif kind == "union":
                row = tk + sk
                ok = [True] * len(tk) + [v not in tk for v in sk]
            elif kind == "intersection":
                row, ok = list(tk), [v in sk for v in tk]
            elif kind == "symmetric_difference":
                row = tk + sk
                ok = [v not in sk for v in tk] + [v not in tk for v in sk]
            elif kind == "teacher_topk_plus_sampled":
                s = samp[b][t]
                row, ok = tk + [s], [True] * len(tk) + [s not in tk]
            else:
                raise ValueError(kind)
            ids[b].append(row)
            valid[b].append(ok)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(valid, dtype=torch.bool)


def ref_gather_logprobs(logits_BTV, ids_BT, gout_BT=None):
    """log_softmax(logits)[id] and its gradient wrt logits."""
    z, ids = _f(logits_BTV), _i(ids_BT)
    gout = _f(gout_BT) if gout_BT is not None else [[1.0] * len(r) for r in ids]
    out, grads = [], []
    for b in range(len(z)):
        out.append([])
        grads.append([])
        for t in range(len(z[b])):
            lp = log_softmax_row(z[b][t])
            i = ids[b][t]
            out[b].append(lp[i])
            grads[b].append([gout[b][t] * ((v == i) - math.exp(lp[v])) for v in range(len(lp))])
    return _t(out), _t(grads)


def ref_sampled_token_advantages(student_lp_BT, teacher_lp_BT, mask_BT, gamma, action_mask_BT=None):
    """A_t = sum_{u>=t, u unmasked} gamma**d(t, u) (teacher_u - student_u); 0 where masked.

    d(t, u) = u - t without an action mask; with one, the number of positions v in [t, u) that are
    in the action mask or the mask (environment tokens between an episode's turns add no distance).
    """
    s, q, mask = _f(student_lp_BT), _f(teacher_lp_BT), _b(mask_BT)
    action = _b(action_mask_BT) if action_mask_BT is not None else None
    out = []
    for b in range(len(s)):
        T = len(s[b])
        row = []
        for t in range(T):
            if not mask[b][t]:
                row.append(0.0)
                continue
            a = 0.0
            for u in range(t, T):
                if not mask[b][u]:
                    continue
                if action is None:
                    d = u - t
                else:
                    d = 0
                    for v in range(t, u):
                        if action[b][v] or mask[b][v]:
                            d += 1
                a += gamma**d * (q[b][u] - s[b][u])
            row.append(a)
        out.append(row)
    return _t(out)


def ref_sampled_token_pg_loss(student_lp_BT, adv_BT, mask_BT, old_lp_BT=None, clip_eps=None, gout_BT=None):
    """-ratio*A (optionally PPO-clipped); returns (loss_BT, grad wrt student log-probs)."""
    s, adv, mask = _f(student_lp_BT), _f(adv_BT), _b(mask_BT)
    old = _f(old_lp_BT) if old_lp_BT is not None else s
    gout = _f(gout_BT) if gout_BT is not None else _ones_like_mask(mask)
    out, grads = [], []
    for b in range(len(s)):
        out.append([])
        grads.append([])
        for t in range(len(s[b])):
            if not mask[b][t]:
                out[b].append(0.0)
                grads[b].append(0.0)
                continue
            r, a = math.exp(s[b][t] - old[b][t]), adv[b][t]
            if clip_eps is None:
                loss, dloss = -r * a, -r * a
            else:
                rc = min(max(r, 1.0 - clip_eps), 1.0 + clip_eps)
                in_range = 1.0 - clip_eps <= r <= 1.0 + clip_eps
                loss = -min(r * a, rc * a)
                dloss = -r * a if (in_range or r * a < rc * a) else 0.0
            out[b].append(loss)
            grads[b].append(gout[b][t] * dloss)
    return _t(out), _t(grads)


def ref_truncated_importance_weight(policy_lp_BT, behaviour_lp_BT, mask_BT, cap):
    """min(pi / mu, cap) at each unmasked position, 0 elsewhere (a constant: no gradient)."""
    pol, beh, mask = _f(policy_lp_BT), _f(behaviour_lp_BT), _b(mask_BT)
    out = []
    for b in range(len(pol)):
        out.append([min(math.exp(pol[b][t] - beh[b][t]), cap) if mask[b][t] else 0.0 for t in range(len(pol[b]))])
    return _t(out)


def ref_stale_sampled_loss(
    student_lp_BT, policy_lp_BT, behaviour_lp_BT, teacher_lp_BT, mask_BT, gamma, cap, action_mask_BT=None, gout_BT=None
):
    """Sampled-token OPD on rollouts an older policy mu sampled, one update per batch: the reward reads
    the updated policy pi (its log-probs before the update), the REINFORCE term is weighted by
    min(pi / mu, cap): loss_t = -w_t A_t exp(logp_t - pi_t). Returns (loss_BT, grad wrt logp); w is a
    constant, so the gradient is w times the unweighted one."""
    adv = ref_sampled_token_advantages(policy_lp_BT, teacher_lp_BT, mask_BT, gamma, action_mask_BT)
    w = ref_truncated_importance_weight(policy_lp_BT, behaviour_lp_BT, mask_BT, cap)
    gout = _t(_f(gout_BT) if gout_BT is not None else _ones_like_mask(_b(mask_BT)))
    loss, grad = ref_sampled_token_pg_loss(student_lp_BT, adv, mask_BT, policy_lp_BT, None, gout * w)
    return loss * w, grad


def _counted(la, lb):
    """Which terms of KL(a || b) count: a > 0 and log a - log b finite.

    opd's rule for zero-probability tokens: 0 log 0 = 0, and an infinite term (a > 0 where
    b = 0) is left out of the sum instead of making the divergence infinite.
    """
    return [x > -INF and math.isfinite(x - y) for x, y in zip(la, lb)]


def _kl_row(la, lb):
    """KL(a || b) from log-probs, summed over the counted terms."""
    return sum(math.exp(x) * (x - y) for x, y, c in zip(la, lb, _counted(la, lb)) if c)


def _divergence_row(ls, lt, kind, beta):
    """Divergence of one position and its gradient wrt the student logits."""
    if kind == "reverse" or (kind == "jsd" and beta == 1.0):
        kl = _kl_row(ls, lt)
        # F = sum_C p (log p - log q)  =>  dF/dp_i = log p_i - log q_i + 1 on C, else 0.
        # (The +1 cancels in the softmax Jacobian only when C holds all of p's mass.)
        g = [x - y + 1.0 if c else 0.0 for x, y, c in zip(ls, lt, _counted(ls, lt))]
        return kl, _softmax_vjp(ls, g)
    if kind == "forward" or (kind == "jsd" and beta == 0.0):
        kl = _kl_row(lt, ls)
        # dF/dp_i = -q_i / p_i on C  =>  dF/dz_j = p_j * (sum_C q) - q_j [j in C]
        # (p - q when C holds all of q's mass).
        counted = _counted(lt, ls)
        q_c = sum(math.exp(y) for y, c in zip(lt, counted) if c)
        return kl, [math.exp(x) * q_c - (math.exp(y) if c else 0.0) for x, y, c in zip(ls, lt, counted)]
    lm = []
    for x, y in zip(ls, lt):  # log(beta q + (1-beta) p), stable
        u = y + math.log(beta) if y > -INF else -INF
        w = x + math.log1p(-beta) if x > -INF else -INF
        hi = max(u, w)
        lm.append(hi + math.log(math.exp(u - hi) + math.exp(w - hi)) if hi > -INF else -INF)
    val = beta * _kl_row(lt, lm) + (1.0 - beta) * _kl_row(ls, lm)
    g = [(1.0 - beta) * (x - m) if x > -INF else 0.0 for x, m in zip(ls, lm)]
    return val, _softmax_vjp(ls, g)


def _divergence(student_BTV, teacher_BTV, mask_BT, kind, beta, gout_BT):
    zs, zt, mask = _f(student_BTV), _f(teacher_BTV), _b(mask_BT)
    gout = _f(gout_BT) if gout_BT is not None else _ones_like_mask(mask)
    out, grads = [], []
    for b in range(len(zs)):
        out.append([])
        grads.append([])
        for t in range(len(zs[b])):
            if not mask[b][t]:
                out[b].append(0.0)
                grads[b].append([0.0] * len(zs[b][t]))
                continue
            val, g = _divergence_row(log_softmax_row(zs[b][t]), log_softmax_row(zt[b][t]), kind, beta)
            out[b].append(val)
            grads[b].append([gout[b][t] * x for x in g])
    return _t(out), _t(grads)


def ref_full_vocab_kl(student_BTV, teacher_BTV, mask_BT, direction="reverse", gout_BT=None):
    """reverse: KL(p_student || q_teacher); forward: KL(q_teacher || p_student).

    Infinite terms are left out (see ``_counted``); the gradient is that of the truncated sum.
    """
    return _divergence(student_BTV, teacher_BTV, mask_BT, direction, None, gout_BT)


def ref_full_vocab_kl_from_hidden(hs_BTD, ws_VD, ht_BTE, wt_VE, mask_BT, direction="reverse", gout_BT=None):
    """ref_full_vocab_kl of both models' logits = hidden @ W.T, with the student's gradients.

    Returns (kl_BT, grad_student_hidden, grad_student_weight).
    """
    kl, g_logits = ref_full_vocab_kl(ref_logits(hs_BTD, ws_VD), ref_logits(ht_BTE, wt_VE), mask_BT, direction, gout_BT)
    return (kl, *ref_hidden_grads(hs_BTD, ws_VD, g_logits))


def ref_generalized_jsd(student_BTV, teacher_BTV, mask_BT, beta=0.5, gout_BT=None):
    """TRL generalized JSD with m = beta q + (1-beta) p."""
    return _divergence(student_BTV, teacher_BTV, mask_BT, "jsd", float(beta), gout_BT)


def ref_reduce(name, loss_BT, mask_BT, constant=None):
    """token_mean / sequence_mean / constant_sum; returns (scalar, grad wrt loss_BT)."""
    loss, mask = _f(loss_BT), _b(mask_BT)
    B, T = len(loss), len(loss[0])
    grad = [[0.0] * T for _ in range(B)]
    if name == "token_mean":
        n = sum(sum(row) for row in mask)
        if n == 0:
            return _t(0.0), _t(grad)
        total = 0.0
        for b in range(B):
            for t in range(T):
                if mask[b][t]:
                    total += loss[b][t]
                    grad[b][t] = 1.0 / n
        return _t(total / n), _t(grad)
    if name == "sequence_mean":
        counts = [sum(row) for row in mask]
        nseq = sum(1 for c in counts if c > 0)
        if nseq == 0:
            return _t(0.0), _t(grad)
        total = 0.0
        for b in range(B):
            if counts[b] == 0:
                continue
            total += sum(loss[b][t] for t in range(T) if mask[b][t]) / counts[b]
            for t in range(T):
                if mask[b][t]:
                    grad[b][t] = 1.0 / (counts[b] * nseq)
        return _t(total / nseq), _t(grad)
    if name == "constant_sum":
        total = 0.0
        for b in range(B):
            for t in range(T):
                if mask[b][t]:
                    total += loss[b][t]
                    grad[b][t] = 1.0 / constant
        return _t(total / constant), _t(grad)
    raise ValueError(name)


def ref_special_token_mask(token_ids_BT, special_ids):
    special = set(int(s) for s in special_ids)
    return torch.tensor([[v in special for v in row] for row in _i(token_ids_BT)], dtype=torch.bool)


def finite_diff(fn, x, gout, eps=1e-6):
    """Central differences of sum(gout * fn(x)) wrt every finite entry of x (float64)."""
    x = x.detach().to(torch.float64).clone()
    flat = x.view(-1)
    grad = torch.zeros_like(flat)
    for n in range(flat.numel()):
        if not math.isfinite(flat[n].item()):
            continue
        old = flat[n].item()
        flat[n] = old + eps
        fp = (fn(x) * gout).sum().item()
        flat[n] = old - eps
        fm = (fn(x) * gout).sum().item()
        flat[n] = old
        grad[n] = (fp - fm) / (2 * eps)
    return grad.view_as(x)


# --------------------------------------------------------------------------- LSM with a tail bucket

# opd's documented clamp (opd.losses.tail): the support's log-mass is at most -1e-7, so every tail
# holds at least 1 - e^-1e-7 (about 1e-7), and where that floor acts the tail is a constant.
TAIL_LOG_MASS_CAP = -1e-7


def _tail_row(z, ids, tlp, smask, direction):
    """K + 1 category KL of one position and its gradient wrt the student logits ``z``.

    The categories: each token v of S (valid slot, finite teacher log-prob) with the full-vocabulary
    probabilities p_v, q_v, and the tail: the student's mass on every token outside S (summed over
    those tokens here) and the teacher's 1 - sum_S q. dF/dp is written per token (a token outside S
    moves F through p_tail only), then the softmax Jacobian.
    """
    V = len(z)
    lp = log_softmax_row(z)
    teacher = {ids[j]: tlp[j] for j in range(len(ids)) if smask[j] and tlp[j] > -INF}
    if lp is None or not teacher:
        return 0.0, [0.0] * V
    floor = -math.expm1(TAIL_LOG_MASS_CAP)
    p_out = math.fsum(math.exp(lp[v]) for v in range(V) if v not in teacher)
    q_out = 1.0 - math.fsum(math.exp(c) for c in teacher.values())
    p_free = p_out > floor  # below the floor the student's tail is a constant
    p_tail, q_tail = max(p_out, floor), max(q_out, floor)
    g = [0.0] * V
    kl = 0.0
    for v, c in teacher.items():
        if lp[v] == -INF:  # reverse: 0 log 0 = 0; forward: an infinite term, left out
            continue
        if direction == "reverse":
            kl += math.exp(lp[v]) * (lp[v] - c)
            g[v] = lp[v] - c + 1.0
        else:
            kl += math.exp(c) * (c - lp[v])
            g[v] = -math.exp(c - lp[v])  # d(-q log p)/dp = -q/p
    if direction == "reverse":
        kl += p_tail * (math.log(p_tail) - math.log(q_tail))
        g_out = math.log(p_tail) - math.log(q_tail) + 1.0 if p_free else 0.0
    else:
        kl += q_tail * (math.log(q_tail) - math.log(p_tail))
        g_out = -q_tail / p_tail if p_free else 0.0
    for v in range(V):
        if v not in teacher:
            g[v] = g_out
    return kl, _softmax_vjp(lp, g)


def ref_local_support_kl_tail(
    student_BTV, ids_BTK, tlp_BTK, mask_BT, support_mask_BTK=None, direction="reverse", gout_BT=None
):
    """Tail-bucket KL per position; returns (kl_BT, grad wrt student logits)."""
    row = lambda z, ids, tlp, s: _tail_row(z, ids, tlp, s, direction)
    return _per_support_row(row, student_BTV, ids_BTK, tlp_BTK, mask_BT, support_mask_BTK, gout_BT)


def ref_local_support_kl_tail_from_hidden(
    hidden_BTD, weight_VD, ids_BTK, tlp_BTK, mask_BT, support_mask_BTK=None, direction="reverse", gout_BT=None
):
    """ref_local_support_kl_tail of logits = hidden @ W.T; returns (kl_BT, grad hidden, grad weight)."""
    kl, g_logits = ref_local_support_kl_tail(
        ref_logits(hidden_BTD, weight_VD), ids_BTK, tlp_BTK, mask_BT, support_mask_BTK, direction, gout_BT
    )
    return (kl, *ref_hidden_grads(hidden_BTD, weight_VD, g_logits))


# --------------------------------------------------------------------------- heads with a bias, scale and cap


def _capped(u, scale, softcap):
    """One logit from its raw value u = h . W_v + b_v: scale, then c tanh(z / c)."""
    z = scale * u
    return z if softcap is None else softcap * math.tanh(z / softcap)


def _capped_slope(u, scale, softcap):
    """d logit / du: scale, times 1 - tanh(z / c)^2 under a cap (0 at u = -inf: tanh is flat there)."""
    if softcap is None:
        return scale
    if not math.isfinite(u):
        return 0.0
    return scale * (1.0 - math.tanh(scale * u / softcap) ** 2)


def _raw_logits(h, w, b):
    """u[b][t][v] = h . W_v + b_v as Python floats, as ``ref_logits`` sums them."""
    V = len(w)
    return [
        [[sum(x * y for x, y in zip(hv, w[v])) + (b[v] if b is not None else 0.0) for v in range(V)] for hv in seq]
        for seq in h
    ]


def ref_head_logits(hidden_BTD, weight_VD, bias_V=None, scale=1.0, softcap=None):
    """softcap(scale * (hidden @ W.T + bias)) with explicit loops, float64 (B, T, V)."""
    b = None if bias_V is None else _f(bias_V)
    raw = _raw_logits(_f(hidden_BTD), _f(weight_VD), b)
    return _t([[[_capped(u, scale, softcap) for u in row] for row in seq] for seq in raw])


def ref_head_grads(hidden_BTD, weight_VD, bias_V, scale, softcap, grad_logits_BTV):
    """Chain rule through the head: (grad hidden, grad weight, grad bias) from d/d logits.

    d/du = d/dz * dz/du (``_capped_slope``), then u = h . W_v + b_v as in ``ref_hidden_grads``; the
    bias gets the sum over positions of d/du."""
    b = None if bias_V is None else _f(bias_V)
    raw = _raw_logits(_f(hidden_BTD), _f(weight_VD), b)
    g = _f(grad_logits_BTV)
    du = [
        [
            [gv * _capped_slope(u, scale, softcap) if gv != 0.0 else 0.0 for gv, u in zip(gr, ur)]
            for gr, ur in zip(gs, us)
        ]
        for gs, us in zip(g, raw)
    ]
    gh, gw = ref_hidden_grads(hidden_BTD, weight_VD, _t(du))
    V = len(raw[0][0]) if raw and raw[0] else 0
    gb = [sum(du[i][t][v] for i in range(len(du)) for t in range(len(du[i]))) for v in range(V)]
    return gh, gw, _t(gb)
