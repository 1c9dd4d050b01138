"""What each chart of the report is fed: plain-JSON chart specs built from loaded runs.

One spec per chart, read by both renderers -- the page's inline JavaScript (``report.js``) and
matplotlib for the PNGs (:mod:`opd.report.png`) -- so the two always show the same numbers.
Kinds: ``line`` (runs overlaid over steps; a thin raw line with an exponential moving average on
top when a run has many steps; ``marks`` flag steps such as clipped gradients; ``hlines`` are
reference levels; a share's axis starts at 0, ``ymin``/``ymax``, and ``none`` says a share was 0
throughout), ``bar`` (the eval chart when every run was evaluated once: its values, not one point on a
step axis), ``heatmap`` (a value by position bucket over steps), ``scatter`` (student vs teacher
probability of sampled tokens, split by the sign of the reward).

A multi-task run (``tasks`` in its config) logs each task's metrics under the task's name
(``math/train/loss``, ``eval/math/accuracy``): its line charts draw one series per task ("run ·
task", a colour of its own) in place of the overall one where the tasks log their own, and its
depth heatmaps one per task.

Usage::

    from opd.report.charts import build_charts
    charts = build_charts(load_runs([...]))   # [{"id": "loss", "kind": "line", "series": [...]}, ...]
"""

from __future__ import annotations

import math

from opd.evaluation.estimators import gap_recovery
from opd.report.load import RunData

# (id, title, [(metric key, series label suffix, dashed)], y label, what it shows)
TRAINING = [
    ("loss", "Training loss", [("train/loss", "", False)], "loss", "Objective loss per step (token mean)."),
    (
        "kl",
        "Reverse KL to the teacher",
        [("train/kl_to_teacher", "", False)],
        "KL (nats)",
        "KL(student || teacher) over the full vocabulary at sampled response positions.",
    ),
    (
        "rollout-accuracy",
        "Rollout accuracy (training batch)",
        [("rollout/accuracy", "", False)],
        "accuracy",
        "Share of the step's sampled rollouts graded correct.",
    ),
    (
        "grad-norm",
        "Gradient norm",
        [("train/grad_norm", "", False)],
        "norm",
        "Before clipping; crosses mark steps whose gradient was clipped.",
    ),
    (
        "response-len",
        "Response length",
        [("rollout/response_len", "", False)],
        "tokens",
        "Mean generated tokens per rollout.",
    ),
    ("eos-rate", "EOS rate", [("rollout/eos_rate", "", False)], "share", "Share of rollouts that ended with EOS."),
    (
        "format-tokens",
        "Format tokens in responses and actions",
        [("rollout/format_token_rate", "", False)],
        "share",
        "Share of responses (in a game, of actions) holding a special token other than the end of turn "
        "(<think>, </think>): expected in a task that thinks, another task's format leaking into a game.",
    ),
    (
        "repetition",
        "Repetition rate",
        [("rollout/repetition_rate", "", False)],
        "share",
        "Share of rollouts caught repeating themselves.",
    ),
]
# Agentic runs (config "env" set): how the episodes of the training batch went.
EPISODES = [
    ("turns", "Turns per episode", [("rollout/turns", "", False)], "turns", "Mean actions per training episode."),
    (
        "invalid-actions",
        "Invalid-action rate",
        [("rollout/invalid_action_rate", "", False)],
        "share",
        "Share of the training episodes' actions outside the game's admissible commands (where it lists them).",
    ),
    (
        "truncated",
        "Truncated episodes",
        [("rollout/truncated_rate", "", False)],
        "share",
        "Share of training episodes cut by the turn limit or the token budget before the game ended.",
    ),
]
DIAGNOSTICS = [
    (
        "overlap",
        "Top-K overlap ratio",
        [("diag/overlap", "", False)],
        "ratio",
        "|top-K(student) ∩ top-K(teacher)| / K: how much of the teacher's support the student already shares.",
    ),
    (
        "overlap-advantage",
        "Overlap-token advantage",
        [("diag/overlap_advantage", "", False)],
        "advantage",
        "Teacher minus student log-probability on the shared top-K tokens.",
    ),
    ("entropy-gap", "Entropy gap", [("diag/entropy_gap", "", False)], "nats", "Student entropy minus teacher entropy."),
    (
        "tail-mass",
        "Mass outside the teacher's top-K (the tail)",
        [("diag/student_tail_mass", " student", False), ("diag/teacher_tail_mass", " teacher", True)],
        "mass",
        "Probability mass each model puts outside the teacher's top-K (solid: student, at the diagnostic "
        "positions; dashed: teacher, at every position). Teacher top-K LSM gives the student's tail no "
        "loss; --tail does.",
    ),
    (
        "out-of-support",
        "Sampled tokens outside the teacher's top-K",
        [("diag/out_of_support", "", False)],
        "share",
        "Share of sampled tokens the teacher does not rank in its top-K.",
    ),
    (
        "negative-reward",
        "Negative sampled-token rewards",
        [("diag/negative_reward", "", False)],
        "share",
        "Share of sampled tokens with log q - log p < 0: the student likes them more than the teacher.",
    ),
]
# Cross-tokenizer runs (a teacher with its own tokenizer): how well the two tokenizations align.
CROSS_TOKENIZER = [
    (
        "cross-alignment",
        "Cross-tokenizer alignment",
        [("cross/one_to_one", " one-to-one", False), ("cross/dropped", " dropped", True)],
        "share of response positions",
        "Solid: positions whose bytes are one teacher token exactly (LSM compares the two there); dashed: "
        "positions left out of the loss (inside a many-to-many group, an unpaired special token, bytes read "
        "differently).",
    ),
    (
        "cross-mapped-mass",
        "Teacher top-K mass that maps to student tokens",
        [("cross/mapped_mass", "", False)],
        "mass",
        "Share of the teacher's top-K probability on tokens with the same bytes in the student's vocabulary: "
        "the part of the teacher's advice LSM can use.",
    ),
]
# (key, title, colour-bar label, sign): sign -1 flips the colours so that red always means bad for the
# student (a negative reward, a high loss).
DEPTH = [
    ("depth/reward", "Sampled-token reward by depth", "log q - log p (mean per bucket)", 1),
    ("depth/loss", "Per-token loss by depth", "loss (mean per bucket)", -1),
]
# Run colours (Okabe-Ito, readable with colour blindness) and reward-sign colours, shared by both renderers.
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"]
NEGATIVE, POSITIVE = "#d62728", "#1f9e4a"
SCATTER_POINTS = 3000  # per run: enough to show the cloud, small enough to stay light in the page


def ema(values: list[float], alpha: float) -> list[float]:
    """Exponential moving average, debiased at the start like TensorBoard's smoothing."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = alpha * acc + (1 - alpha) * v
        weight = alpha * weight + (1 - alpha)
        out.append(acc / weight)
    return out


def _series(run: RunData, color: int, key: str, suffix: str, dashed: bool, records: list[dict]) -> dict | None:
    pts = [
        (r["step"], r[key])
        for r in records
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
    ]
    if not pts:
        return None
    x, y = [p[0] for p in pts], [float(p[1]) for p in pts]
    s = {"run": run.name, "label": run.name + suffix, "color": color, "dashed": dashed, "x": x, "y": y}
    if len(y) >= 20:
        s["smooth"] = ema(y, alpha=min(0.9, 1 - 4 / len(y)))
    return s


def task_names(run: RunData) -> list[str]:
    """A multi-task run's task names, from its config (empty for a single-task run)."""
    tasks = run.config.get("tasks")
    if not isinstance(tasks, list):
        return []
    return [t["name"] for t in tasks if isinstance(t, dict) and isinstance(t.get("name"), str)]


def run_series(runs: list[RunData], i: int, key: str, suffix: str, dashed: bool, records: list[dict]) -> list[dict]:
    """Run ``i``'s series of a metric in ``records``: one per task where its tasks log their own
    (``math/KEY``, ``eval/math/...``), else the overall one. A multi-task run's overall series jumps
    between its tasks' steps (a math step, then a game step) or averages tasks unlike each other;
    its tasks' series take the run's colour (the first task) and then colours after every run's,
    so four runs of two tasks fit the palette without a repeat."""
    run = runs[i]
    own = []
    for j, name in enumerate(task_names(run)):
        scoped = f"eval/{name}/{key[5:]}" if key.startswith("eval/") else f"{name}/{key}"
        own.append(_series(run, i + len(runs) * j, scoped, f" · {name}{suffix}", dashed, records))
    kept = [s for s in own if s is not None]
    if kept:
        return kept
    overall = _series(run, i, key, suffix, dashed, records)
    return [overall] if overall else []


def line_chart(runs: list[RunData], cid: str, title: str, keys, ylabel: str, note: str, group: str) -> dict:
    series = []
    for i, run in enumerate(runs):
        for key, suffix, dashed in keys:
            for s in run_series(runs, i, key, suffix, dashed, run.steps):
                if cid == "grad-norm":
                    s["marks"] = [r["step"] for r in run.steps if r.get("train/clipped") is True]
                series.append(s)
    hlines = []
    if cid == "grad-norm":
        limits = sorted({r.config["max_grad_norm"] for r in runs if r.config.get("max_grad_norm")})
        hlines = [{"y": v, "label": f"clip at {v:g}"} for v in limits]
    return {
        "id": cid,
        "kind": "line",
        "group": group,
        "title": title,
        "xlabel": "step",
        "ylabel": ylabel,
        "note": note,
        "keys": [k for k, _, _ in keys],
        "series": series,
        "hlines": hlines,
        **share_axis(series, ylabel),
    }


def share_axis(series: list[dict], ylabel: str) -> dict:
    """A share's axis starts at 0 (``ymin``), and a share that is 0 at every logged step of every run says
    "none" (``none``) on a 0..1 axis (``ymax``): not a flat line on an axis padded to -1..1."""
    if ylabel != "share":
        return {}
    if any(y for s in series for y in s["y"]):
        return {"ymin": 0.0}
    return {"ymin": 0.0, "ymax": 1.0, "none": "none: 0 at every logged step"}


def _plays_games(run: RunData) -> set[bool]:
    """Whether the run's tasks are environments (one answer per task of a multi-task run)."""
    tasks = run.config.get("tasks")
    if isinstance(tasks, list) and tasks:
        return {
            bool(t.get("env", run.config.get("env") if "task" not in t else "")) for t in tasks if isinstance(t, dict)
        }
    return {bool(run.config.get("env"))}


def rate_word(runs: list[RunData]) -> str:
    """What "correct" is called: an agentic run's episode is won, so its accuracy is a success rate."""
    agentic = set().union(*(_plays_games(r) for r in runs))
    return {frozenset({True}): "success rate", frozenset({True, False}): "accuracy / success rate"}.get(
        frozenset(agentic), "accuracy"
    )


def rollout_rate_chart(runs: list[RunData]) -> dict:
    """The training batch's share correct, worded for the runs (see :func:`rate_word`)."""
    word = rate_word(runs)
    if word == "accuracy":
        return line_chart(runs, *TRAINING[2], group="training")
    note = (
        "Share of the step's training episodes won."
        if word == "success rate"
        else "Share of the step's rollouts graded correct, or of its episodes won (agentic runs)."
    )
    keys = [("rollout/accuracy", "", False)]
    return line_chart(runs, "rollout-accuracy", f"Training {word} (rollouts)", keys, word, note, group="training")


def eval_chart(runs: list[RunData]) -> dict:
    """Eval accuracy (an agentic run's success rate) over steps (greedy solid, avg@k dashed), with the
    teacher and the start as references."""
    series, greedy_keys = [], set()
    for i, run in enumerate(runs):
        # a game's accuracy is its success rate; a multi-task run's overall is the mean over its tasks
        greedy = "eval/success_rate" if run.config.get("env") and not task_names(run) else "eval/accuracy"
        greedy_keys.add(greedy)
        for key, suffix, dashed in ((greedy, " greedy", False), ("eval/avg_at_k", " avg@k", True)):
            for s in run_series(runs, i, key, suffix, dashed, run.evals):
                s.pop("smooth", None)  # few points, each an evaluation over many prompts
                series.append(s)
    hlines, seen = [], set()
    for run in runs:
        for key, label in (("teacher_acc", "teacher"), ("student_init_acc", "student before")):
            v = run.summary.get(key)
            if v is not None and (label, v) not in seen:
                seen.add((label, v))
                hlines.append({"y": v, "label": label})
    word = rate_word(runs)
    held_out = "Held-out accuracy" if word == "accuracy" else f"Held-out {word} (games won)"
    chart = {
        "id": "eval-accuracy",
        "kind": "line",
        "group": "training",
        "title": f"Eval {word}",
        "xlabel": "step",
        "ylabel": word,
        "keys": [*sorted(greedy_keys), "eval/avg_at_k"],
        "note": f"{held_out}: greedy (solid) and avg@k sampled (dashed); grey lines: teacher and the "
        "student before OPD.",
        "series": series,
        "hlines": hlines,
    }
    return once_as_bars(chart) if series and all(len(s["x"]) == 1 for s in series) else chart


def once_as_bars(chart: dict) -> dict:
    """A line chart whose every series has one point (each run evaluated once, at its end) as bars with
    their values: one point on a step axis padded around it shows neither the value nor a trend."""
    bars = [
        {k: s[k] for k in ("run", "label", "color", "dashed")} | {"value": s["y"][0], "step": s["x"][0]}
        for s in chart["series"]
    ]
    steps = sorted({b["step"] for b in bars})
    at = f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))
    return {
        **chart,
        "kind": "bar",
        "xlabel": f"evaluated once, at {at}",
        "note": chart["note"].replace("(solid)", "(solid bars)").replace("(dashed)", "(hatched)"),
        "bars": bars,
    }


def depth_heatmap(
    run: RunData, color: int, key: str, title: str, zlabel: str, sign: int, task: str = ""
) -> dict | None:
    """A run's depth buckets over steps; with ``task``, that task's (its own steps and horizon)."""
    scoped = f"{task}/{key}" if task else key
    rows = [(r["step"], r[scoped]) for r in run.steps if isinstance(r.get(scoped), list)]
    if not rows:
        return None
    width = max(len(z) for _, z in rows)
    rows = [(s, z) for s, z in rows if len(z) == width]  # a record with another bucket count cannot share the grid
    slug = key.split("/")[1] + (f"-{task}" if task else "")
    name = f"{run.name} · {task}" if task else run.name
    flat = sorted(abs(float(v)) for _, z in rows for v in z)
    # The colour scale ends at the 98th percentile of |value|, so one wild step does not wash out the rest.
    bound = flat[min(len(flat) - 1, int(0.98 * len(flat)))] or (flat[-1] or 1.0)
    return {
        "id": f"depth-{slug}-{run.name}".replace("/", "-"),
        "kind": "heatmap",
        "group": "depth",
        "run": run.name,
        "color": color,
        "key": scoped,
        "title": f"{title}: {name}",
        "xlabel": "step",
        "ylabel": "depth bucket (0 = start of response)",
        "zlabel": zlabel,
        "x": [s for s, _ in rows],
        "buckets": width,
        "bound": bound,
        "sign": sign,
        "z": [[float(v) for v in z] for _, z in rows],
    }


def scatter_chart(run: RunData, color: int) -> dict | None:
    """Student vs teacher probability of every logged sampled token (loss-masked ones included)."""
    pts = [
        (s, t)
        for r in run.rollouts
        for s, t in zip(r["student_logprobs"], r["teacher_logprobs"])
        if isinstance(s, (int, float)) and isinstance(t, (int, float))
    ]
    if not pts:
        return None
    total = len(pts)
    stride = max(1, math.ceil(total / SCATTER_POINTS))
    pts = pts[::stride]
    # reward = log q - log p: positive where the teacher likes the token more than the student does.
    prob = lambda s, t: [round(math.exp(s), 4), round(math.exp(t), 4)]
    pos = [prob(s, t) for s, t in pts if t > s]
    neg = [prob(s, t) for s, t in pts if t <= s]
    return {
        "id": f"scatter-{run.name}".replace("/", "-"),
        "kind": "scatter",
        "group": "scatter",
        "run": run.name,
        "color": color,
        "title": f"Sampled tokens: {run.name}",
        "xlabel": "student probability",
        "ylabel": "teacher probability",
        "positive": pos,
        "negative": neg,
        "stride": stride,
        "tokens": total,
    }


def build_charts(runs: list[RunData]) -> list[dict]:
    """Every chart of the report, in page order; charts with no data at all are left out."""
    charts = [line_chart(runs, *spec, group="training") for spec in TRAINING]
    charts[2] = rollout_rate_chart(runs)
    charts[3:3] = [line_chart(runs, *spec, group="training") for spec in EPISODES]
    charts.insert(2, eval_chart(runs))
    charts += [line_chart(runs, *spec, group="diagnostics") for spec in DIAGNOSTICS + CROSS_TOKENIZER]
    for spec in DEPTH:
        for color, run in enumerate(runs):
            charts += [h for task in ["", *task_names(run)] if (h := depth_heatmap(run, color, *spec, task=task))]
    charts += [s for color, run in enumerate(runs) if (s := scatter_chart(run, color))]
    return [c for c in charts if c["kind"] != "line" or c["series"]]


def _graded_keys(record: dict, suffix: str) -> bool:
    """Whether ``record`` holds ``suffix`` (``rollout/accuracy``) for the run or one of its tasks."""
    return any(k == suffix or k.endswith("/" + suffix) for k in record)


def _nothing_graded(run: RunData) -> bool:
    """A run with steps and no accuracy anywhere: its prompts had no reference answers."""
    return bool(run.steps) and not run.evals and not any(_graded_keys(r, "rollout/accuracy") for r in run.steps)


def grading_notes(runs: list[RunData]) -> list[tuple[str, str]]:
    """(run name, note) for each run whose prompts lack reference answers: with none graded it has no
    accuracy to show; with some, its accuracies are over the graded prompts only."""
    notes = []
    for run in runs:
        if not run.steps:
            continue
        if _nothing_graded(run):
            notes.append(
                (
                    run.name,
                    "no accuracy to show: its prompts have no reference answers, so nothing was graded and there is "
                    "no evaluation (the loss and the diagnostics still show how the distillation went)",
                )
            )
        elif any(_graded_keys(r, "rollout/ungraded") for r in run.steps):
            notes.append(
                (
                    run.name,
                    "some of its prompts have no reference answer: rollout accuracy is over the graded rollouts only "
                    "(rollout/ungraded counts the others), and evaluation over the graded held-out prompts",
                )
            )
    return notes


def _fmt_pct(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m {s:02d}s" if m else f"{s}s"


def _settings(cfg: dict) -> str:
    if not cfg:
        return "unknown (no config.json)"
    parts = []
    if cfg.get("objective") == "lsm":
        parts.append(
            f"K={cfg.get('k')} {cfg.get('support', '')}"
            + ("" if cfg.get("renormalize", True) else " no-renorm")
            + (" tail" if cfg.get("tail") else "")
        )
    elif cfg.get("objective") == "sampled":
        parts.append(f"γ={cfg.get('gamma')}")
    elif cfg.get("objective") == "full_kl":
        parts.append(str(cfg.get("kl_direction", "")))
    for key, label in (("lr", "lr"), ("batch_size", "batch"), ("top_p", "top-p"), ("mask_special", "mask special")):
        if key in cfg and cfg[key] is not None:
            value = {True: "on", False: "off"}.get(cfg[key], cfg[key]) if isinstance(cfg[key], bool) else cfg[key]
            parts.append(f"{label} {value}")
    return ", ".join(parts)


def summary_rows(runs: list[RunData]) -> list[dict]:
    """One row of display strings per run for the page's summary table."""
    rows = []
    for run in runs:
        last_eval = run.evals[-1] if run.evals else {}
        after = last_eval.get("eval/accuracy")
        teacher, before = run.summary.get("teacher_acc"), run.summary.get("student_init_acc")
        recovery = (
            gap_recovery(before, after, teacher)
            if after is not None and teacher is not None and before is not None
            else None
        )
        wall = run.summary.get("wall_s")
        if wall is None and run.steps:
            wall = sum(r.get("time/step", 0.0) for r in run.steps)
        planned = run.planned_steps
        steps = (
            f"{len(run.steps)}" + (f" / {planned}" if planned else "") + (" (in progress)" if run.in_progress else "")
        )
        k = last_eval.get("eval/k", run.summary.get("k"))
        per_task = [
            f"{n} {_fmt_pct(last_eval[f'eval/{n}/accuracy'])}"
            for n in task_names(run)
            if f"eval/{n}/accuracy" in last_eval
        ]
        rows.append(
            {
                "run": run.name,
                "objective": run.config.get("objective", "?"),
                "settings": _settings(run.config),
                "steps": steps,
                "wall": _fmt_duration(wall),
                "teacher": _fmt_pct(teacher),
                "before": _fmt_pct(before),
                "after": ("none: no reference answers" if _nothing_graded(run) else _fmt_pct(after))
                + (f" (step {last_eval['step']})" if last_eval else "")
                + (f"; {', '.join(per_task)}" if per_task else ""),
                "avg_at_k": _fmt_pct(last_eval.get("eval/avg_at_k")) + (f" (k={k})" if last_eval and k else ""),
                "gap_recovery": "–" if recovery is None or math.isnan(recovery) else f"{100 * recovery:.0f}%",
            }
        )
    return rows
