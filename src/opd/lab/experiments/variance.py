"""``opd experiment variance``: the estimator study of arXiv:2603.25562 (its Fig. 1a and the T^2 / T^4 bounds).

A controlled synthetic problem small enough to measure the policy-gradient variance accurately:
a tabular autoregressive student p_theta(y_t | t, y_{t-1}) over V tokens (one softmax per
position and previous token) and a fixed random teacher q of the same form. Sampled-token OPD
with the discounted reward-to-go: r_t = log q(y_t) - log p(y_t), A_t = sum_{u>=t} gamma^(u-t) r_u
and the single-rollout estimate g = -sum_t A_t grad log p(y_t), computed with opd's own
:func:`opd.losses.sampled_token_advantages` and :func:`opd.losses.sampled_token_pg_loss`.

* **Variance**: at fixed parameters, M independent rollouts each give a gradient estimate g_i
  (per-rollout gradients through one backward pass over per-rollout parameter copies); the
  variance is the mean squared distance ``mean_i ||g_i - g_bar||^2`` (the trace of the
  covariance). Measured at several points of training, per gamma.
* **Horizon**: at initialisation, for T in a sweep; the exponent b of var ~ T^b is a least-squares
  fit on log-log axes, per seed. The paper's O(T^2) (gamma=0) and O(T^4) (gamma=1) are worst-case
  bounds for bounded rewards, so the measured exponent is checked against them as upper bounds.
* **Stability**: Adam on the batch-mean estimate at one learning rate for all gamma; the exact
  sequence-level KL(student || teacher) is computed in closed form (a forward pass over the
  previous-token marginals), so the curves carry no evaluation noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import cast

import torch

from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings, read_run_file
from opd.lab.experiments.plots import line_plot
from opd.lab.experiments.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    fit_power_law,
    mean_ci,
    verdict,
    worst_p,
)
from opd.losses import sampled_token_advantages, sampled_token_pg_loss

GAMMAS = (0.0, 0.5, 0.9, 1.0)
LRS = (0.05, 0.3)  # stability across learning rates: the smaller is smooth for every gamma
FULL = dict(
    vocab=8,
    horizon=16,
    iters=300,
    batch=64,
    rollouts=2000,
    measure_every=25,
    horizons=[4, 8, 16, 32, 64],
    teacher_scale=2.0,
    init_scale=1.0,
)
QUICK = dict(FULL, iters=40, rollouts=200, measure_every=10, horizons=[4, 8, 16])


# ----------------------------------------------------------------------------- the synthetic problem


def random_table(T: int, V: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Logits (T, V + 1, V): position t, previous token (index V = beginning of sequence), next token."""
    return torch.randn(T, V + 1, V, generator=gen, dtype=torch.float64) * scale


def sample(theta_TPV: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n rollouts of the tabular policy: tokens (n, T) and previous tokens (n, T)."""
    T, P, V = theta_TPV.shape
    prev = torch.full((n,), V, dtype=torch.long)
    ys, prevs = [], []
    with torch.no_grad():
        for t in range(T):
            probs = torch.softmax(theta_TPV[t, prev], -1)
            y = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            ys.append(y)
            prevs.append(prev)
            prev = y
    return torch.stack(ys, 1), torch.stack(prevs, 1)


def token_logprobs(theta: torch.Tensor, ys_NT: torch.Tensor, prev_NT: torch.Tensor) -> torch.Tensor:
    """log p(y_t | t, y_{t-1}); ``theta`` is (T, P, V) shared or (N, T, P, V) one copy per rollout."""
    N, T = ys_NT.shape
    t_idx = torch.arange(T).expand(N, T)
    logits = theta[t_idx, prev_NT] if theta.dim() == 3 else theta[torch.arange(N)[:, None], t_idx, prev_NT]
    return torch.log_softmax(logits, -1).gather(-1, ys_NT.unsqueeze(-1)).squeeze(-1)


def surrogate(theta, teacher, ys, prev, gamma: float) -> torch.Tensor:
    """Per-rollout sum over positions of opd's sampled-token PG loss: its gradient is the estimate g_i."""
    logp = token_logprobs(theta, ys, prev)
    logq = token_logprobs(teacher, ys, prev)
    mask = torch.ones_like(ys, dtype=torch.bool)
    adv = sampled_token_advantages(logp, logq, mask, gamma=gamma)
    return sampled_token_pg_loss(logp, adv, mask).sum(-1)


def gradient_variance(theta, teacher, gamma: float, m: int, gen: torch.Generator) -> dict:
    """Trace of the covariance of the single-rollout gradient estimate, from m independent rollouts."""
    ys, prev = sample(theta, m, gen)
    copies = theta.detach().unsqueeze(0).expand(m, *theta.shape).clone().requires_grad_(True)
    surrogate(copies, teacher, ys, prev, gamma).sum().backward()  # rollout i only touches copy i
    g = copies.grad.reshape(m, -1)
    mean = g.mean(0)
    return {"var": float(((g - mean) ** 2).sum(-1).mean()), "mean_sq_norm": float((mean**2).sum())}


def sequence_kl(theta: torch.Tensor, teacher: torch.Tensor) -> float:
    """Exact KL(p_theta || q) over whole sequences: sum_t E_{y_{t-1} ~ p}[KL(p_t || q_t)]."""
    T, P, V = theta.shape
    marg = torch.zeros(P, dtype=theta.dtype)
    marg[V] = 1.0
    total = 0.0
    with torch.no_grad():
        for t in range(T):
            logp, logq = torch.log_softmax(theta[t], -1), torch.log_softmax(teacher[t], -1)
            total += float(marg @ (logp.exp() * (logp - logq)).sum(-1))
            marg = torch.cat([marg @ logp.exp(), torch.zeros(1, dtype=theta.dtype)])
    return total


# ----------------------------------------------------------------------------- run steps


def _tables(p: dict, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    teacher = random_table(T, p["vocab"], p["teacher_scale"], gen)
    return random_table(T, p["vocab"], p["init_scale"], gen), teacher


def train_run(p: dict, run_dir: Path) -> dict:
    """Train with one gamma; log the exact KL every iteration and the variance every ``measure_every``."""
    theta, teacher = _tables(p, p["horizon"], p["seed"])
    theta.requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=p["lr"])
    gen = torch.Generator().manual_seed(p["seed"])
    mgen = torch.Generator().manual_seed(10_000 + p["seed"])
    records = []
    for it in range(p["iters"] + 1):
        rec = {"iter": it, "kl": sequence_kl(theta, teacher)}
        if it % p["measure_every"] == 0 or it == p["iters"]:
            rec.update(gradient_variance(theta, teacher, p["gamma"], p["rollouts"], mgen))
        if it < p["iters"]:
            ys, prev = sample(theta, p["batch"], gen)
            opt.zero_grad()
            loss = surrogate(theta, teacher, ys, prev, p["gamma"]).mean()
            loss.backward()
            rec["grad_norm"] = float(cast(torch.Tensor, theta.grad).norm())  # set by backward()
            opt.step()
        records.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"final_kl": records[-1]["kl"], "initial_kl": records[0]["kl"]}


def horizon_run(p: dict, run_dir: Path) -> dict:
    """Variance at initialisation for each horizon T and gamma (fresh random tables per T)."""
    out = []
    mgen = torch.Generator().manual_seed(20_000 + p["seed"])
    for T in p["horizons"]:
        theta, teacher = _tables(p, T, p["seed"])
        for gamma in GAMMAS:
            out.append({"T": T, "gamma": gamma, **gradient_variance(theta, teacher, gamma, p["rollouts"], mgen)})
    (run_dir / "horizon.json").write_text(json.dumps(out, indent=1) + "\n")
    return {"points": len(out)}


def plan(s: Settings) -> list[RunSpec]:
    base = QUICK if s.quick else FULL
    specs = []
    for seed in range(s.seeds):
        specs.append(
            RunSpec(
                f"horizon/seed{seed}",
                "python",
                {**base, "seed": seed},
                horizon_run,
                "variance vs horizon T at initialisation",
            )
        )
        for lr in LRS:
            for g in GAMMAS:
                specs.append(
                    RunSpec(
                        f"train/lr{lr}/gamma{g}/seed{seed}",
                        "python",
                        {**base, "seed": seed, "gamma": g, "lr": lr},
                        train_run,
                        "train the tabular student with sampled-token OPD at this gamma and lr",
                    )
                )
    return specs


# ----------------------------------------------------------------------------- analysis


def _read(s: Settings, name: str, file: str):
    return read_run_file(s, name, file)


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    seeds = range(s.seeds)
    p = QUICK if s.quick else FULL
    runs = {
        lr: {(g, k): _read(s, f"train/lr{lr}/gamma{g}/seed{k}", "metrics.jsonl") for g in GAMMAS for k in seeds}
        for lr in LRS
    }
    horizon = {k: _read(s, f"horizon/seed{k}", "horizon.json") for k in seeds}
    _variance_over_training(a, s, runs[LRS[0]], p)
    expo = _horizon_fits(a, s, horizon, p)
    for lr in LRS:
        _stability(a, s, runs[lr], p, lr)
    _claims(a, s, runs, expo, p)
    return a


def _measured(train, g, k):
    return [(r["iter"], r["var"]) for r in train[(g, k)] if "var" in r]


def _variance_over_training(a: Analysis, s: Settings, train, p) -> None:
    iters = [i for i, _ in _measured(train, 0.0, 0)]
    series, rows = {}, []
    for g in GAMMAS:
        per_iter = [mean_ci([math.log10(dict(_measured(train, g, k))[i]) for k in range(s.seeds)]) for i in iters]
        series[f"gamma={g}"] = (
            iters,
            [10**c.mean for c in per_iter],
            [10**c.lo for c in per_iter],
            [10**c.hi for c in per_iter],
        )
        rows.append([f"{g}"] + [per_iter[j].fmt(2) for j in (0, len(iters) // 2, len(iters) - 1)])
    a.table(
        f"Gradient variance (log10 of trace of covariance, {p['rollouts']} rollouts per point, T={p['horizon']}, "
        f"V={p['vocab']}), mean [95% CI] over seeds",
        ["gamma", f"iter {iters[0]}", f"iter {iters[len(iters) // 2]}", f"iter {iters[-1]}"],
        rows,
    )
    line_plot(
        s.out / "variance_over_training.png",
        series,
        "training iteration",
        "gradient variance (log scale)",
        f"Sampled-token OPD gradient variance during training (T={p['horizon']})",
        logy=True,
    )
    a.plots.append("variance_over_training.png")


def _horizon_fits(a: Analysis, s: Settings, horizon, p) -> dict:
    Ts = p["horizons"]
    expo, series, rows = {}, {}, []
    for g in GAMMAS:
        fits = []
        for k in range(s.seeds):
            pts = {r["T"]: r["var"] for r in horizon[k] if r["gamma"] == g}
            fits.append(fit_power_law(Ts, [pts[T] for T in Ts])[0])
        expo[g] = fits
        logs = [
            mean_ci(
                [
                    math.log10(next(r["var"] for r in horizon[k] if r["gamma"] == g and r["T"] == T))
                    for k in range(s.seeds)
                ]
            )
            for T in Ts
        ]
        series[f"gamma={g}"] = (Ts, [10**c.mean for c in logs], [10**c.lo for c in logs], [10**c.hi for c in logs])
        rows.append([f"{g}", mean_ci(fits).fmt(2)] + [f"{10**c.mean:.3g}" for c in logs])
    a.table(
        "Gradient variance at initialisation against the horizon T: fitted exponent b of var ~ T^b "
        "(mean [95% CI] over seeds) and the variance (geometric mean over seeds)",
        ["gamma", "exponent b"] + [f"T={T}" for T in Ts],
        rows,
    )
    line_plot(
        s.out / "variance_vs_horizon.png",
        series,
        "horizon T",
        "gradient variance",
        "Variance against horizon (log-log)",
        logy=True,
        logx=True,
    )
    a.plots.append("variance_vs_horizon.png")
    return expo


def _final_kl(train, g, k, frac: float = 0.1) -> float:
    kls = [r["kl"] for r in train[(g, k)]]
    tail = kls[-max(1, int(len(kls) * frac)) :]
    return sum(tail) / len(tail)


def _rises(train, g, k) -> float:
    recs = train[(g, k)]
    return sum(1 for x, y in zip(recs, recs[1:]) if y["kl"] > x["kl"]) / (len(recs) - 1)


def _stability(a: Analysis, s: Settings, train, p, lr: float) -> None:
    rows, series = [], {}
    for g in GAMMAS:
        finals = [_final_kl(train, g, k) for k in range(s.seeds)]
        rows.append(
            [
                f"{g}",
                mean_ci([train[(g, k)][0]["kl"] for k in range(s.seeds)]).fmt(3),
                mean_ci(finals).fmt(3),
                mean_ci([_rises(train, g, k) for k in range(s.seeds)]).fmt(2),
            ]
        )
        its = [r["iter"] for r in train[(g, 0)]]
        # On the log axis the band is the interval of log10 KL (a geometric mean and interval).
        cis = [mean_ci([math.log10(train[(g, k)][j]["kl"]) for k in range(s.seeds)]) for j in range(len(its))]
        series[f"gamma={g}"] = (its, *([10 ** getattr(c, f) for c in cis] for f in ("mean", "lo", "hi")))
    a.table(
        f"Training stability at Adam lr {lr}: exact sequence KL(student || teacher), batch {p['batch']}, "
        f"{p['iters']} iterations; final = mean of the last 10% of iterations; 'KL rises' = share of "
        "iterations where the exact KL went up",
        ["gamma", "initial KL", "final KL", "KL rises"],
        rows,
    )
    name = f"training_kl_lr{lr}.png"
    line_plot(
        s.out / name,
        series,
        "training iteration",
        "exact sequence KL(student || teacher)",
        f"Training curves per gamma, Adam lr {lr} (geometric mean, 95% CI over seeds)",
        logy=True,
    )
    a.plots.append(name)


def _all(verdicts: list[str]) -> str:
    if all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return NOT_REPRODUCED if any(v == NOT_REPRODUCED for v in verdicts) else INCONCLUSIVE


def _claims(a: Analysis, s: Settings, runs, expo, p) -> None:
    seeds, train = range(s.seeds), runs[LRS[0]]
    # Fig. 1a: gamma=1 above gamma=0 at every measured point of training.
    ratios: dict[int, list[float]] = {}
    for k in seeds:
        lo, hi = dict(_measured(train, 0.0, k)), dict(_measured(train, 1.0, k))
        for i in lo:
            ratios.setdefault(i, []).append(math.log10(hi[i]) - math.log10(lo[i]))
    per_point = {i: verdict(d) for i, d in ratios.items()}
    worst = min(per_point.items(), key=lambda kv: kv[1][1].lo if kv[1][1].n > 1 else kv[1][1].mean)
    mean_orders = sum(ci.mean for _, ci in per_point.values()) / len(per_point)
    a.claims.append(
        Claim(
            "2603.25562 Fig. 1a",
            "token-level (gamma=0) gradient variance stays below sequence-level (gamma=1) "
            f"throughout training (lr {LRS[0]})",
            "95% CI of log10(var gamma=1 / var gamma=0), paired by seed, above 0 at every measured iteration",
            _all([v for v, _ in per_point.values()]),
            f"mean gap {mean_orders:.2f} orders of magnitude; smallest at iter {worst[0]}: {worst[1][1].fmt(2)}",
            worst_p([ci for _, ci in per_point.values()], [v for v, _ in per_point.values()]),
        )
    )
    mono = []
    for g_lo, g_hi in zip(GAMMAS, GAMMAS[1:]):
        d = [
            math.log10(dict(_measured(train, g_hi, k))[0]) - math.log10(dict(_measured(train, g_lo, k))[0])
            for k in seeds
        ]
        mono.append((g_lo, g_hi, *verdict(d)))
    a.claims.append(
        Claim(
            "2603.25562 Sec. 3 (synthetic study)",
            "stronger future-reward coupling (larger gamma) increases gradient variance",
            "each step up in gamma: CI of the paired log10 variance ratio at initialisation above 0",
            _all([m[2] for m in mono]),
            "; ".join(f"{lo}->{hi}: {ci.fmt(2)}" for lo, hi, _, ci in mono),
            worst_p([m[3] for m in mono], [m[2] for m in mono]),
        )
    )
    for g, bound in ((0.0, 2.0), (1.0, 4.0)):
        v, tested = verdict([bound - e for e in expo[g]])  # the module's one rule, on "bound > exponent"
        a.claims.append(
            Claim(
                "2603.25562 Sec. 3 (bounds)",
                f"variance at gamma={g:g} grows at most like T^{bound:g}",
                f"95% CI of the fitted exponent entirely below {bound:g} (entirely above: not "
                f"reproduced; T in {p['horizons']})",
                v,
                f"exponent {mean_ci(expo[g]).fmt(2)}",
                tested.p,
            )
        )
    v, ci = verdict([b1 - b0 for b1, b0 in zip(expo[1.0], expo[0.0])])
    a.claims.append(
        Claim(
            "2603.25562 Sec. 3 (bounds)",
            "variance grows faster with T at gamma=1 than at gamma=0",
            "CI of the paired exponent difference (gamma=1 minus gamma=0) above 0",
            v,
            f"difference {ci.fmt(2)}",
            ci.p,
        )
    )
    for lr, train_lr in runs.items():
        v, ci = verdict([_final_kl(train_lr, 1.0, k) - _final_kl(train_lr, 0.0, k) for k in seeds])
        a.claims.append(
            Claim(
                "2603.25562 Sec. 3 (synthetic study)",
                f"the larger variance destabilizes (here: slows) "
                f"training: gamma=1 ends further from the teacher than gamma=0 (Adam lr {lr})",
                "CI of the paired difference in final exact KL (gamma=1 minus gamma=0) above 0",
                v,
                f"final KL difference {ci.fmt(4)}",
                ci.p,
            )
        )
        r1, r0 = (mean_ci([_rises(train_lr, g, k) for k in seeds]) for g in (1.0, 0.0))
        worse = sum(_final_kl(train_lr, g, k) > train_lr[(g, k)][0]["kl"] for g in GAMMAS for k in seeds)
        a.notes.append(
            f"Adam lr {lr}: share of iterations where the exact KL rose: gamma=1 {r1.fmt(3)}, gamma=0 "
            f"{r0.fmt(3)}; runs ending above their initial KL (diverged): {worse} of {len(GAMMAS) * s.seeds}. "
            "The share is not used as a verdict: a run that has reached its noise floor (gamma=0 first) "
            "fluctuates there, so it counts convergence as much as instability."
        )
    a.notes.append(
        "The T^2 / T^4 figures are worst-case bounds for bounded rewards; a measured exponent below them "
        "is consistent with the bound, and the typical growth can be slower than the worst case."
    )


EXPERIMENT = Experiment(
    name="variance",
    title="variance: sampled-token OPD gradient variance against gamma and horizon (2603.25562)",
    about=(
        "Tabular autoregressive student and fixed random teacher (V=8 tokens, one softmax per position and "
        "previous token); the single-rollout estimate of sampled-token OPD with the discounted reward-to-go, "
        "through opd.losses.sampled_token_advantages / sampled_token_pg_loss. Variance = trace of the covariance of "
        "the per-rollout gradient over 2,000 independent rollouts at fixed parameters (200 with --quick), measured "
        "every 25 iterations of training (T=16, Adam, batch 64, 300 iterations, at lr 0.05 and 0.3, one run per "
        "gamma, lr and seed) and at initialisation for T in {4, 8, 16, 32, 64}. Full size: 3-4 minutes on 2 CPU "
        "cores; --quick: 40 iterations, T up to 16, about 10 seconds."
    ),
    plan=plan,
    analyze=analyze,
)
