"""Experiments: statistics against hand/brute-force computations, the runner's skip/resume logic,
command lines that parse back to the same config, the variance estimator, and every experiment's
``--quick`` run (the model ones are marked slow)."""

from __future__ import annotations

import itertools
import json
import math
import random
import shlex
import time
from pathlib import Path

import pytest
import torch

from opd.config import TrainConfig, build_config, option_fields
from opd.errors import UserError
from opd.lab.experiments import NAMES, get_experiment, run
from opd.lab.experiments.core import DONE, STARTED, RunSpec, Settings, command_line, run_specs
from opd.lab.experiments.keys import Keys
from opd.lab.experiments.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    auroc,
    benjamini_hochberg,
    equivalence,
    fit_power_law,
    mean_ci,
    noninferior,
    t975,
    t_sf,
    verdict,
    worst_p,
)

# ----------------------------------------------------------------------------- statistics


def test_mean_ci_matches_hand_computation():
    ci = mean_ci([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)  # sample sd of 1..4
    assert ci.mean == pytest.approx(2.5)
    assert ci.hi - ci.mean == pytest.approx(3.182 * sd / 2)
    assert ci.mean - ci.lo == pytest.approx(3.182 * sd / 2)
    one = mean_ci([7.0])
    assert one.n == 1 and math.isnan(one.lo) and one.fmt() == "7.000 (n=1)"
    assert mean_ci([float("nan"), 2.0, 4.0]).n == 2  # a run without a number is dropped, not counted


def test_t_quantiles_are_conservative_between_rows():
    assert t975(1) == pytest.approx(12.706)
    assert t975(35) == t975(30) > t975(40)  # the next smaller df: a wider interval
    assert t975(500) == pytest.approx(1.980)  # beyond the table: the last row, never narrower
    # Student-t 0.975 quantiles from a printed table (scipy is not a dependency of opd).
    for df, q in ((1, 12.706), (2, 4.303), (5, 2.571), (10, 2.228), (30, 2.042), (120, 1.980)):
        assert t975(df) == pytest.approx(q, abs=1e-3)


def _auroc_brute(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("n,ties", [(7, False), (40, True), (101, True)])
def test_auroc_equals_pair_count(n, ties):
    rng = random.Random(n)
    scores = [rng.randint(0, 5) if ties else rng.random() for _ in range(n)]
    labels = [rng.random() < 0.4 for _ in range(n)]
    labels[0], labels[1] = True, False  # both classes present
    assert auroc(scores, labels) == pytest.approx(_auroc_brute(scores, labels))
    assert math.isnan(auroc([1.0, 2.0], [True, True]))
    assert auroc([1, 2, 3], [False, False, True]) == 1.0


def test_power_law_fit():
    xs = [4, 8, 16, 32, 64]
    b, c = fit_power_law(xs, [3.0 * x**2.5 for x in xs])
    assert b == pytest.approx(2.5) and c == pytest.approx(3.0)
    rng = random.Random(0)
    b_noisy, _ = fit_power_law(xs, [x**4 * math.exp(rng.gauss(0, 0.05)) for x in xs])
    assert abs(b_noisy - 4) < 0.1


def test_verdict_rules():
    assert verdict([1.0, 1.2, 0.9])[0] == REPRODUCED
    assert verdict([-1.0, -1.2, -0.9])[0] == NOT_REPRODUCED
    assert verdict([1.0, -1.0, 0.5])[0] == INCONCLUSIVE
    assert verdict([5.0])[0] == INCONCLUSIVE  # one seed decides nothing
    assert equivalence([0.001, -0.002, 0.0], 0.03)[0] == REPRODUCED
    assert equivalence([0.2, 0.21, 0.19], 0.03)[0] == NOT_REPRODUCED
    assert equivalence([0.0, 0.05, -0.04], 0.03)[0] == INCONCLUSIVE
    # "A at least as good as B" within a margin: a small loss is allowed, a sure one beyond it is not
    assert noninferior([-0.01, 0.0, -0.02], 0.05)[0] == REPRODUCED
    assert noninferior([-0.2, -0.21, -0.19], 0.05)[0] == NOT_REPRODUCED
    assert noninferior([-0.2, 0.1, 0.0], 0.05)[0] == INCONCLUSIVE
    assert noninferior([0.3], 0.05)[0] == INCONCLUSIVE  # one seed decides nothing


def _t_sf_by_integration(t: float, df: int, steps: int = 20_000) -> float:
    """P(T > t) by Simpson's rule over the t density, on u = atan(x) so the tail is finite."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    f = lambda u: c * (1 + math.tan(u) ** 2 / df) ** (-(df + 1) / 2) / math.cos(u) ** 2  # noqa: E731
    a, b = math.atan(t), math.pi / 2 - 1e-9
    h = (b - a) / steps
    return h / 3 * sum((1 if i in (0, steps) else 4 if i % 2 else 2) * f(a + i * h) for i in range(steps + 1))


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 9, 30])
def test_t_tail_matches_numerical_integration(df):
    for t in (0.0, 0.4, 1.0, 2.5, 4.0, 11.0):
        assert t_sf(t, df) == pytest.approx(_t_sf_by_integration(t, df), abs=1e-9)
        assert t_sf(-t, df) == pytest.approx(1 - t_sf(t, df), abs=1e-12)
    assert 2 * t_sf(t975(df), df) == pytest.approx(0.05, abs=1e-4)  # the table's quantiles, to its 3 digits


def test_a_verdicts_p_is_below_alpha_exactly_when_its_interval_decides():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice([3, 5, 10])
        diffs = [rng.gauss(rng.uniform(-2, 2), rng.uniform(0.1, 3)) for _ in range(n)]
        m = sum(diffs) / n
        se = math.sqrt(sum((x - m) ** 2 for x in diffs) / (n - 1) / n)
        for rule, margin, v, ci in (
            ("verdict", 0.0, *verdict(diffs)),
            ("noninferior", 0.5, *noninferior(diffs, 0.5)),
            ("equivalence", 1.0, *equivalence(diffs, 1.0)),
        ):
            # the p of a one-sample t-test against the nearest boundary the rule decides at
            bounds = {"verdict": [0.0], "noninferior": [-margin], "equivalence": [-margin, margin]}[rule]
            t = min(abs(m - b) for b in bounds) / se
            assert ci.p == pytest.approx(2 * _t_sf_by_integration(t, n - 1, 2000), abs=1e-6), rule
            if abs(ci.p - 0.05) > 1e-3:  # away from the table's rounding of the quantile
                assert (v != INCONCLUSIVE) == (ci.p < 0.05), (rule, diffs)
    assert verdict([5.0])[1].p == 1.0  # one seed decides nothing
    assert verdict([1.0, 1.0, 1.0])[1].p == 0.0 and verdict([0.0, 0.0])[1].p == 1.0  # no spread
    assert math.isnan(mean_ci([1.0, 2.0]).p)  # a plain interval tests nothing


def test_a_combined_verdict_takes_the_weakest_needed_part():
    parts = [verdict(d) for d in ([1.0, 1.1, 0.9], [0.5, 0.7, 0.6], [1.0, -0.2, 0.6])]
    cis, vs = [ci for _, ci in parts], [v for v, _ in parts]
    assert vs == [REPRODUCED, REPRODUCED, INCONCLUSIVE]
    assert worst_p(cis[:2], vs[:2]) == max(cis[0].p, cis[1].p)  # every part must hold: the largest p
    against = verdict([-1.0, -1.1, -0.8])
    assert worst_p([*cis, against[1]], [*vs, against[0]]) == against[1].p  # one part against decides it
    assert worst_p(cis, vs) == cis[2].p  # inconclusive: the largest


def _bh_by_definition(ps, q):
    """The survivors as Benjamini and Hochberg (1995) define them: the k smallest p, k the largest rank
    with p_(k) <= k q / m."""
    m = len(ps)
    ranked = sorted(ps)
    k = max([i for i in range(1, m + 1) if ranked[i - 1] <= i * q / m], default=0)
    return [p <= ranked[k - 1] if k else False for p in ps]


def test_benjamini_hochberg_keeps_the_tests_its_definition_keeps():
    assert benjamini_hochberg([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.0533333, 0.0533333, 0.5])
    rng = random.Random(1)
    for _ in range(500):
        ps = [rng.random() ** rng.choice([1, 3, 6]) for _ in range(rng.randint(1, 40))]
        ps += ps[: rng.randint(0, 3)]  # ties
        adjusted = benjamini_hochberg(ps)
        for q in (0.05, 0.1):
            assert [a <= q for a in adjusted] == _bh_by_definition(ps, q)
        assert all(p - 1e-12 <= a <= 1 for p, a in zip(ps, adjusted))  # up to float rounding


def test_curves_by_count_align_seeds_whose_tasks_took_other_steps(tmp_path):
    """Two multi-task seeds: one trains the game on even steps, the other on odd ones. By OPD step
    the seeds share no step (no curve, no plot); by the game's own count they align value by value."""
    from opd.lab.experiments.common import diagnostics_plots, mean_curve
    from opd.lab.experiments.core import Analysis

    s = Settings(tmp_path, seeds=2, quick=True)
    game = {"seed0": [0.1, 0.3, 0.5], "seed1": [0.3, 0.5, 0.9]}
    for name, values in game.items():
        first = 0 if name == "seed0" else 1
        records = [{"step": first + 2 * i, "alfworld/rollout/accuracy": v} for i, v in enumerate(values)]
        records += [{"step": 1 - first + 2 * i, "math/rollout/accuracy": 0.5} for i in range(3)]
        s.run_dir(name).mkdir(parents=True)
        (s.run_dir(name) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    key, names = "alfworld/rollout/accuracy", list(game)
    assert mean_curve(s, names, key)[0] == []
    steps, mean, lo, hi = mean_curve(s, names, key, by_count=True)
    assert steps == [0, 1, 2] and mean == pytest.approx([0.2, 0.4, 0.7])
    half = t975(1) * (0.4 / math.sqrt(2)) / math.sqrt(2)  # sd of 0.5 and 0.9, over sqrt(2 seeds)
    assert hi[2] - mean[2] == pytest.approx(half) and mean[2] - lo[2] == pytest.approx(half)
    by_step, by_count = Analysis(), Analysis()
    diagnostics_plots(by_step, s, {"lsm": names}, {key: "game success"}, "mt")
    diagnostics_plots(by_count, s, {"lsm": names}, {key: "game success"}, "mt", by_count=True)
    assert by_step.plots == [] and by_count.plots == ["mt_alfworld_rollout_accuracy.png"]
    assert (tmp_path / "mt_alfworld_rollout_accuracy.png").stat().st_size > 0


def test_made_at_names_the_commits_and_shortens_full_hashes():
    from opd.lab.experiments.core import made_at

    full = "68ae776d2d21095e1783849a06aadaf777e32768"
    made = [{"commit": full, "date": "2026-11-28"}, {"commit": "ea7af09-dirty", "date": ""}]
    assert made_at({"runs_made_at": made}) == "runs made at 68ae776 (2026-11-28), ea7af09-dirty (date not recorded)"
    assert made_at({"runs_made_at": [{"commit": "unknown", "date": ""}], "measured_at": "stamped"}) == "stamped"


# ----------------------------------------------------------------------------- runner


def test_rate_bands_stay_between_0_and_1(tmp_path, monkeypatch):
    import matplotlib.axes

    from opd.lab.experiments.plots import line_plot

    drawn = []
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", lambda ax, xs, lo, hi, **kw: drawn.append((lo, hi)))
    # three seeds at 0.9, 1.0, 1.0 and 0.0, 0.1, 0.0: t-intervals reach past both ends
    series = {"run": ([1, 2], [0.9667, 0.0333], [0.82, -0.11], [1.11, 0.18])}
    line_plot(tmp_path / "a.png", series, "step", "rate", "t", bounds=(0.0, 1.0))
    line_plot(tmp_path / "b.png", series, "step", "loss", "t")
    assert drawn[0] == ([0.82, 0.0], [1.0, 0.18])
    assert drawn[1] == ([0.82, -0.11], [1.11, 0.18])  # an unbounded quantity keeps its interval
    assert (tmp_path / "a.png").is_file() and (tmp_path / "b.png").is_file()


def test_unknown_experiment_lists_the_valid_names(tmp_path):
    with pytest.raises(UserError, match="variance, objectives"):
        get_experiment("nope")
    with pytest.raises(UserError, match="--seeds"):
        run("variance", tmp_path, seeds=0, quick=True)


def test_finished_runs_are_skipped(tmp_path):
    calls = []

    def fn(params, run_dir):
        calls.append(params["x"])
        (run_dir / "out.txt").write_text(str(params["x"]))
        return {"x": params["x"]}

    s = Settings(tmp_path, seeds=1, quick=True)
    specs = [RunSpec("a", "python", {"x": 1}, fn), RunSpec("b/c", "python", {"x": 2}, fn)]
    first = run_specs(specs, s, show_progress=False)
    assert [r["status"] for r in first] == ["ran", "ran"] and calls == [1, 2]
    assert json.loads((tmp_path / "runs/b/c/DONE.json").read_text())["result"] == {"x": 2}
    (tmp_path / "runs/a/DONE.json").unlink()  # "a" was interrupted: only it runs again
    second = run_specs(specs, s, show_progress=False)
    assert [r["status"] for r in second] == ["ran", "skipped (finished earlier)"] and calls == [1, 2, 1]
    specs[1] = RunSpec("b/c", "python", {"x": 3}, fn)  # the definition changed: made again from scratch
    third = run_specs(specs, s, show_progress=False)
    assert [r["status"] for r in third] == ["skipped (finished earlier)", "ran"] and calls == [1, 2, 1, 3]
    assert (tmp_path / "runs/b/c/out.txt").read_text() == "3"


def meet(params, run_dir):
    """A run that says it started, then waits (up to a minute) for its partner to start: both
    return met=True only if they ran at the same time."""
    (run_dir.parent / f"{params['me']}.started").write_text("")
    partner = run_dir.parent / f"{params['partner']}.started"
    deadline = time.time() + 60
    while not partner.exists() and time.time() < deadline:
        time.sleep(0.1)
    return {"met": partner.exists(), "end": time.time()}


def after(params, run_dir):
    """A run that reads what the runs it needs wrote: their DONE.json must already be there."""
    done = [json.loads((run_dir.parent / n / DONE).read_text())["result"]["end"] for n in params["reads"]]
    return {"start": time.time(), "last_needed_end": max(done), "end": time.time()}


def test_runs_side_by_side_respect_needs(tmp_path):
    s = Settings(tmp_path, seeds=1, quick=True)
    specs = [
        RunSpec("a", "python", {"me": "a", "partner": "b"}, meet),
        RunSpec("b", "python", {"me": "b", "partner": "a"}, meet, needs=()),  # free to start beside a
        RunSpec("c", "python", {"reads": ["a"]}, after, needs=("a",)),
        RunSpec("d", "python", {"reads": ["a", "b", "c"]}, after),  # needs=None: every run before it
    ]
    log = run_specs(specs, s, show_progress=False, workers=2)
    assert [r["run"] for r in log] == ["a", "b", "c", "d"] and all(r["status"] == "ran" for r in log)
    result = {n: json.loads((tmp_path / "runs" / n / DONE).read_text())["result"] for n in "abcd"}
    assert result["a"]["met"] and result["b"]["met"]  # a and b ran at the same time
    for n in "cd":
        assert result[n]["start"] >= result[n]["last_needed_end"]
    # Rerun: everything is finished, so nothing starts.
    assert {r["status"] for r in run_specs(specs, s, show_progress=False, workers=2)} == {"skipped (finished earlier)"}
    with pytest.raises(ValueError, match="not earlier in the plan"):
        run_specs([RunSpec("x", "python", {}, after, needs=("y",)), RunSpec("y", "python", {}, after)], s, workers=2)
    with pytest.raises(UserError, match="--workers 0"):
        run_specs(specs, s, workers=0)


def write_text(params, run_dir):
    (run_dir / "out.txt").write_text(params["text"])
    return {"wrote": params["text"]}


def read_text(params, run_dir):
    return {"read": Path(params["src"]).read_text() if Path(params["src"]).is_file() else None}


def _statuses(specs, s, capsys, workers=1) -> dict:
    log = run_specs(specs, s, show_progress=False, workers=workers)
    said = capsys.readouterr().out
    for r in log:  # a reused run says so; a run made again says why
        reused = any(line.startswith(f"{r['run']}: reused") for line in said.splitlines())
        assert reused == (r["status"] != "ran"), said
    return {r["run"]: r["status"] == "ran" for r in log}


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_is_reused_only_while_what_it_reads_is_unchanged(tmp_path, capsys, workers):
    """Runs keyed by their command and the files they read, chained through the runs they read from:
    a teacher replaced at the same path re-runs its readers (and theirs), nothing else."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "model.safetensors").write_bytes(b"weights v1")
    s = Settings(tmp_path / "exp", seeds=1, quick=True)

    def plan(text="a"):
        return [
            RunSpec("make", "python", {"text": text}, write_text),
            RunSpec("reads-make", "python", {"src": str(s.run_dir("make") / "out.txt")}, read_text),
            RunSpec("reads-teacher", "python", {"src": str(teacher / "model.safetensors")}, read_text, needs=()),
            RunSpec("reads-reader", "python", {"src": str(s.run_dir("reads-teacher") / DONE)}, read_text),
        ]

    ran = lambda *names: {n: n in names for n in ("make", "reads-make", "reads-teacher", "reads-reader")}  # noqa: E731
    assert _statuses(plan(), s, capsys, workers) == ran("make", "reads-make", "reads-teacher", "reads-reader")
    assert _statuses(plan(), s, capsys, workers) == ran()
    (teacher / "model.safetensors").write_bytes(b"weights v2")  # replaced at the same path
    assert _statuses(plan(), s, capsys, workers) == ran("reads-teacher", "reads-reader")
    assert json.loads((s.run_dir("reads-teacher") / DONE).read_text())["result"]["read"] == "weights v2"
    assert _statuses(plan("b"), s, capsys, workers) == ran("make", "reads-make")  # chained: its reader re-runs
    assert json.loads((s.run_dir("reads-make") / DONE).read_text())["result"]["read"] == "b"
    # A run finished before runs were keyed is made again, unless adopted (--adopt) with the same command.
    for name in ("make", "reads-make"):
        done = json.loads((s.run_dir(name) / DONE).read_text())
        (s.run_dir(name) / DONE).write_text(json.dumps({k: v for k, v in done.items() if k != "key"}))
    s.adopt = True
    log = run_specs(plan("b"), s, show_progress=False, workers=workers)
    assert [r["status"] for r in log] == ["skipped (finished earlier)"] * 4
    assert "make: adopted (finished before runs were keyed" in capsys.readouterr().out
    s.adopt = False
    (s.run_dir("make") / DONE).write_text(json.dumps({"command": "old", "wall_s": 1}))
    assert _statuses(plan("b"), s, capsys, workers) == ran("make")  # same outputs: its key is the same


def _train_cfg(student, teacher, out, **kw):
    return TrainConfig.from_flat(
        student=str(student),
        teacher=str(teacher),
        out=str(out),
        steps=4,
        batch_size=4,
        max_new_tokens=8,
        eval_every=0,
        eval_size=4,
        eval_samples=0,
        ckpt_every=2,
        log_rollouts=1,
        diag_positions=16,
        warmup_steps=1,
        **kw,
    )


def _steps(path):
    return [json.loads(line) for line in path.read_text().splitlines() if "train/loss" in line]


@pytest.mark.slow
def test_interrupted_train_run_resumes_from_its_checkpoint(tiny_models, tmp_path):
    from opd.training.loop import train

    student, teacher = tiny_models
    s = Settings(tmp_path, seeds=1, quick=True)
    cfg = _train_cfg(student, teacher, s.run_dir("opd"))
    train(cfg, show_progress=False)  # the uninterrupted run, then pretend it died after step 1
    full = _steps(s.run_dir("opd") / "metrics.jsonl")
    (s.run_dir("opd") / "checkpoints" / "latest").write_text("step_0000001")
    spec = RunSpec("opd", "train", cfg)
    started = {"command": command_line(spec, s.run_dir("opd")), "key": Keys([spec], s.run_dir, command_line)["opd"]}
    (s.run_dir("opd") / STARTED).write_text(json.dumps(started))  # as run_specs would have begun it
    log = run_specs([RunSpec("opd", "train", cfg)], s, show_progress=False)
    assert log[0]["status"] == "ran"
    resumed = _steps(s.run_dir("opd") / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert resumed[:2] == full[:2]  # steps 0-1 kept as logged, not rerun
    for a, b in zip(resumed[2:], full[2:]):  # steps 2-3 rerun from the checkpoint, reproducibly
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
    # a run killed before its first checkpoint starts over instead of appending to its log
    cfg2 = cfg.replace(out=str(s.run_dir("early")), steps=2)
    s.run_dir("early").mkdir(parents=True)
    (s.run_dir("early") / "metrics.jsonl").write_text('{"step": 0, "train/loss": 9.0}\n')
    run_specs([RunSpec("early", "train", cfg2)], s, show_progress=False)
    assert [r["step"] for r in _steps(s.run_dir("early") / "metrics.jsonl")] == [0, 1]
    # an interrupted run begun with other settings is not resumed under the new ones
    (s.run_dir("early") / DONE).unlink()
    (s.run_dir("early") / "metrics.jsonl").write_text('{"step": 0, "train/loss": 9.0}\n')  # checkpoints kept
    run_specs([RunSpec("early", "train", cfg2.replace(lr=cfg2.optimizer.lr * 2))], s, show_progress=False)
    assert 9.0 not in [r["train/loss"] for r in _steps(s.run_dir("early") / "metrics.jsonl")]


def _parse_flags(argv: list[str]) -> dict:
    """The flags of an ``opd train`` line back into config values (the CLI's own conventions)."""
    out, i = {}, 0
    while i < len(argv):
        key = argv[i][2:].replace("-", "_")
        nxt = argv[i + 1] if i + 1 < len(argv) else "--"
        if nxt.startswith("--"):
            if key.startswith("no_"):
                out[key[3:]] = False
            else:
                out[key] = True
            i += 1
            continue
        if key == "special_tokens":
            out.setdefault(key, []).append(nxt)
        else:
            out[key] = nxt
        i += 2
    return out


def test_command_line_parses_back_to_the_same_config(tmp_path):
    cfg = TrainConfig.from_flat(
        student="s dir",
        teacher="t",
        objective="sampled",
        top_p=1.0,
        mask_special=False,
        lr=2e-3,
        steps=7,
        special_tokens=["<|im_end|>"],
        renormalize=False,
    )
    line = command_line(RunSpec("x", "train", cfg), tmp_path / "x")
    argv = shlex.split(line)
    assert argv[:2] == ["opd", "train"]
    values = _parse_flags(argv[2:])
    hints = {f.name: f.type for _, f in option_fields(TrainConfig)}
    typed = {k: (float(v) if hints[k] == "float" else int(v) if hints[k] == "int" else v) for k, v in values.items()}
    assert build_config(TrainConfig, {}, typed) == cfg.replace(out=str(tmp_path / "x"))


def test_a_multi_task_runs_command_line_runs_the_same_config(tmp_path, monkeypatch):
    """A task list has no flags of its own: each entry is written as one JSON mapping per --tasks."""
    from typer.testing import CliRunner

    import opd.training.loop
    from opd.cli import app

    tasks = [
        {"name": "math", "share": 2, "teacher": "t dir", "task_level": 1, "batch_size": 8},
        {"name": "game", "teacher": "g", "env": "toy", "env_args": ["n_train=4"], "max_new_tokens": 96},
    ]
    cfg = TrainConfig.from_flat(student="s", tasks=tasks, task_mode="alternate", objective="sampled", steps=5)
    line = command_line(RunSpec("x", "train", cfg), tmp_path / "x")
    got = []
    monkeypatch.setattr(opd.training.loop, "train", lambda c: got.append(c))
    result = CliRunner().invoke(app, shlex.split(line)[1:])
    assert result.exit_code == 0, result.output
    assert got == [cfg.replace(out=str(tmp_path / "x"))]


# ----------------------------------------------------------------------------- variance estimator


def test_per_rollout_gradients_match_a_loop():
    from opd.lab.experiments.variance import gradient_variance, random_table, sample, surrogate

    g = torch.Generator().manual_seed(0)
    theta, teacher = random_table(5, 3, 1.0, g), random_table(5, 3, 2.0, g)
    for gamma in (0.0, 1.0):
        res = gradient_variance(theta, teacher, gamma, 50, torch.Generator().manual_seed(1))
        ys, prev = sample(theta, 50, torch.Generator().manual_seed(1))  # the same rollouts
        grads = []
        for i in range(50):
            th = theta.clone().requires_grad_(True)
            surrogate(th, teacher, ys[i : i + 1], prev[i : i + 1], gamma).sum().backward()
            grads.append(th.grad.reshape(-1))
        G = torch.stack(grads)
        assert res["var"] == pytest.approx(float(((G - G.mean(0)) ** 2).sum(-1).mean()), rel=1e-9)


def test_sequence_kl_is_exact():
    from opd.lab.experiments.variance import random_table, sequence_kl

    g = torch.Generator().manual_seed(3)
    T, V = 3, 3
    theta, teacher = random_table(T, V, 1.0, g), random_table(T, V, 1.5, g)
    total = 0.0
    for seq in itertools.product(range(V), repeat=T):  # every sequence: brute force
        lp = lq = 0.0
        prev = V
        for t, y in enumerate(seq):
            lp += float(torch.log_softmax(theta[t, prev], -1)[y])
            lq += float(torch.log_softmax(teacher[t, prev], -1)[y])
            prev = y
        total += math.exp(lp) * (lp - lq)
    assert sequence_kl(theta, teacher) == pytest.approx(total, rel=1e-9)


@pytest.mark.slow
def test_variance_quick_end_to_end(tmp_path):
    res = run("variance", tmp_path, seeds=2, quick=True, show_progress=False)
    out = tmp_path / "variance"
    assert len(res["claims"]) >= 6
    for p in res["plots"]:
        assert (out / p).stat().st_size > 1000
    assert "quick" in (out / "results.md").read_text()
    lines = (out / "commands.txt").read_text().splitlines()
    assert lines[0] == f"# opd experiment variance --seeds 2 --out {tmp_path} --quick"
    again = run("variance", tmp_path, seeds=2, quick=True, show_progress=False)
    assert all(r["status"].startswith("skipped") for r in again["run_log"])

    from opd.lab.experiments.results_md import build_results_md

    doc = build_results_md([tmp_path], tmp_path / "docs" / "RESULTS.md")
    text = doc.read_text()
    assert "quick (smoke test)" in text and "Not run yet: `opd experiment depth`" in text
    assert (tmp_path / "docs/results/variance/variance_vs_horizon.png").is_file()
    # Rebuilt from other output roots, the document keeps the variance result: from the results.json kept
    # beside it, or, where that is gone (documents older than the copies), its own section and summary rows.
    section = text[text.index("## variance: ") :]
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    (tmp_path / "variance" / "results.json").unlink()
    with pytest.raises(UserError, match="no experiment results"):
        build_results_md([empty], tmp_path / "other" / "RESULTS.md")
    assert (
        build_results_md([empty], doc).read_text().split("Summary of verdicts")[1]
        == text.split("Summary of verdicts")[1]
    )
    (tmp_path / "docs/results/variance/results.json").unlink()
    kept = build_results_md([empty], doc).read_text()
    assert kept[kept.index("## variance: ") :].split("\n## ")[0] == section.split("\n## ")[0]
    assert [r for r in kept.splitlines() if r.startswith("| variance |")] == [
        r for r in text.splitlines() if r.startswith("| variance |")
    ]
    runs_line = lambda doc_text: next(line for line in doc_text.splitlines() if line.startswith("Runs behind"))
    assert runs_line(kept) == runs_line(text)  # its wall time and machine read back from the section
    # A quick results.json does not replace a full result the document already holds; it does replace a quick one.
    run("variance", tmp_path, seeds=2, quick=True, show_progress=False)  # writes variance/results.json again
    size_line = next(line for line in kept.splitlines() if line.startswith("Size: "))
    as_full = kept.replace(size_line, "Size: full size" + size_line[size_line.index(";") :], 1)
    doc.write_text(as_full)
    variance_part = lambda doc_text: doc_text[doc_text.index("## variance: ") :].split("\n## ")[0]
    rebuilt = build_results_md([tmp_path], doc).read_text()
    assert variance_part(rebuilt) == variance_part(as_full)
    assert not (tmp_path / "docs/results/variance/results.json").exists()  # the quick result was not taken
    doc.write_text(kept)
    rebuilt = build_results_md([tmp_path], doc).read_text()
    assert (tmp_path / "docs/results/variance/results.json").is_file()  # the quick result replaced a quick section
    assert "Size: full size" not in variance_part(rebuilt)


def test_depth_buckets_and_reformatted_solutions():
    from opd.lab.experiments.depth import BUCKET, bucket_stats
    from opd.tasks.arithmetic import reformat_solution

    rows = [
        {"reward": [-1.0] * (2 * BUCKET), "correct": False},
        {"reward": [0.5] * (2 * BUCKET) + [0.0], "correct": True},
    ]
    b = bucket_stats(rows)
    assert len(b) == 3 and b[0]["auroc"] == 1.0 and b[0]["mean_reward"] == pytest.approx(-0.25)
    assert math.isnan(b[2]["auroc"])  # only the correct rollout reaches the third bucket
    sol = "<think>12 + 7 = 19. 19 - 3 = 16.</think> The answer is \\boxed{16}"
    assert reformat_solution(sol, "default") == sol
    assert reformat_solution(sol, "words") == (
        "Step 1: 12 plus 7 makes 19. Step 2: 19 minus 3 makes 16. So the answer is \\boxed{16}"
    )
    with pytest.raises(UserError, match="words"):
        reformat_solution(sol, "nope")


# ----------------------------------------------------------------------------- model experiments, --quick


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        n
        for n in NAMES
        if n not in ("variance", "multitask", "multitask-game", "vllm-rollouts", "collapse", "new-knowledge")
    ],
)  # multitask(-game): lab/demos/test_demo_multitask.py; vllm-rollouts: rollout/test_vllm.py (it needs vLLM);
# collapse and new-knowledge: below
def test_model_experiment_quick(name, tmp_path):
    res = run(name, tmp_path, seeds=1, quick=True, show_progress=False)
    assert res["quick"] and res["tables"] and res["claims"]
    assert all(c["verdict"] == INCONCLUSIVE for c in res["claims"])  # one seed decides nothing
    for p in res["plots"]:
        assert (tmp_path / name / p).is_file()
    commands = (tmp_path / name / "commands.txt").read_text()
    assert "opd train" in commands or "# python step" in commands


@pytest.mark.slow
def test_new_knowledge_quick_tests_its_claims_only_where_both_teachers_lead(tmp_path):
    """The quick run's tables and plots; then its claims, made again from the same runs with the
    scores before OPD set on either side of the premise (both teachers above the student)."""
    from opd.lab.experiments.core import Analysis
    from opd.lab.experiments.new_knowledge import NEW, SAME, _claims

    res = run("new-knowledge", tmp_path, seeds=1, quick=True, show_progress=False)
    assert res["quick"] and [len(t["rows"]) for t in res["tables"]] == [3, 2]
    assert all((tmp_path / "new-knowledge" / p).is_file() for p in res["plots"]) and res["plots"]
    tested = len(res["claims"]) == 2 and not any("not tested" in n for n in res["notes"])
    untested = not res["claims"] and any("not tested" in n for n in res["notes"])
    assert tested != untested  # claims where the teachers lead the student, else a note saying why not
    assert all(c["verdict"] == INCONCLUSIVE for c in res["claims"])  # one seed decides nothing
    s = Settings(tmp_path / "new-knowledge", seeds=1, quick=True)
    scores = lambda x: {"accuracy": x, "avg_at_k": x}  # noqa: E731
    below, above = Analysis(), Analysis()
    _claims(below, s, scores(0.5), {SAME: scores(0.5), NEW: scores(0.9)})  # no gap to recover: not tested
    assert not below.claims and "not tested" in below.notes[0] and "same-pipeline teacher's" in below.notes[0]
    behind_new = Analysis()
    _claims(behind_new, s, scores(0.5), {SAME: scores(0.9), NEW: scores(0.4)})
    assert not behind_new.claims and "new-knowledge teacher's" in behind_new.notes[0]
    _claims(above, s, scores(-1.0), {SAME: scores(1.0), NEW: scores(3.0)})
    assert [c.verdict for c in above.claims] == [INCONCLUSIVE, INCONCLUSIVE]
    assert "gap recovery" in above.claims[1].claim


@pytest.mark.slow
def test_collapse_quick_runs_its_pilot_then_the_confirmation_of_the_chosen_remedy(tmp_path, monkeypatch):
    from opd.lab.experiments import collapse

    monkeypatch.setattr(collapse, "REMEDY", None)  # before the pilot has chosen
    res = run("collapse", tmp_path, seeds=1, quick=True, show_progress=False)
    assert [r[0] for r in res["tables"][0]["rows"]] == list(collapse.CANDIDATES) and not res["claims"]
    assert "no confirmation has run yet" in res["notes"][-1]
    assert not (tmp_path / "collapse" / "runs" / "lsm").exists()  # the pilot's seeds only
    monkeypatch.setattr(collapse, "REMEDY", "fkl-0.1")
    res = run("collapse", tmp_path, seeds=2, quick=True, show_progress=False)
    assert len(res["claims"]) == 2 and all(c["verdict"] == INCONCLUSIVE for c in res["claims"])
    assert [r[0] for r in res["tables"][1]["rows"]] == ["lsm", "fkl-0.1"]
    train = json.loads((tmp_path / "collapse/runs/fkl-0.1/seed1/config.json").read_text())
    assert train["objective"]["forward_kl_share"] == 0.1 and train["objective"]["objective"] == "lsm"


def test_collapse_pilot_rule_takes_the_largest_rise_that_keeps_success():
    from opd.lab.experiments.collapse import choose

    measure = {"lsm": [0.1, 0.2], "a": [0.3, 0.4], "b": [0.5, 0.6], "c": [0.05, 0.1]}
    success = {"lsm": [0.5, 0.5], "a": [0.5, 0.46], "b": [0.2, 0.3], "c": [0.9, 0.9]}
    chosen, rise = choose(measure, success)
    assert chosen == "a" and rise == pytest.approx({"a": 0.2, "b": 0.4, "c": -0.075})  # b costs 25 points
    assert choose({"lsm": [0.3], "a": [0.2]}, {"lsm": [0.5], "a": [0.5]})[0] is None


def test_results_md_names_a_corrupt_results_file(tmp_path):
    from opd.lab.experiments.results_md import build_results_md

    (tmp_path / "variance").mkdir()
    (tmp_path / "variance" / "results.json").write_text("{cut short")
    with pytest.raises(
        UserError, match=r"variance/results.json is not a results.json.*rerun `opd experiment variance`"
    ):
        build_results_md([tmp_path], tmp_path / "RESULTS.md")


def test_multitask_format_shares_read_the_game_steps_logged_format_rate(tmp_path):
    from opd.lab.experiments.core import Settings
    from opd.lab.experiments.multitask import WINDOW, format_shares

    s = Settings(tmp_path, seeds=1, quick=False)
    run = s.run_dir("lsm/seed0")
    run.mkdir(parents=True)
    game_steps = [1, 4, 7, 10, 13, 16, 19]
    rates = [0.1, 0.0, 0.05, 0.9, 0.3, 0.2, 0.4]  # step 10: between the windows, read by neither
    shares = [0.5, 0.01, 0.02, 0.03, 0.04, 0.05, 0.09]
    metrics = [
        {"step": t, "alfworld/rollout/format_token_rate": r, "alfworld/diag/out_of_support": x}
        for t, r, x in zip(game_steps, rates, shares)
    ]
    metrics.insert(2, {"step": 5, "math/rollout/format_token_rate": 1.0, "math/diag/out_of_support": 0.9})
    metrics.append({"step": 19, "eval/alfworld/accuracy": 0.2})  # an eval record holds neither
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    start, end, out_of_support = format_shares(s, "lsm/seed0")
    assert WINDOW == 3
    assert start == pytest.approx((0.1 + 0.0 + 0.05) / 3) and end == pytest.approx((0.3 + 0.2 + 0.4) / 3)
    assert out_of_support == pytest.approx((0.04 + 0.05 + 0.09) / 3)


def test_agentic_first_word_windows_read_the_action_starts(tmp_path):
    from opd.lab.experiments.agentic import DOUBT, SURE, WORD_WINDOW, first_word_windows

    assert (WORD_WINDOW, SURE, DOUBT) == (10, 0.5, 0.1)
    ln = math.log
    names = {"7": "go", "8": "move", "9": "take"}

    def episode(step, starts, wrote, teacher_lp, top, top_lp, student_top_lp):
        """A 6-token response region; fields at the action starts given, None elsewhere (replies)."""
        rec = {"step": step, "topk_tokens": names, "turns": [{"start": i} for i in starts]}
        rec["tokens"] = ["x"] * 6
        rec["teacher_logprobs"] = [None] * 6
        rec["teacher_topk_ids"] = [None] * 6
        rec["teacher_topk_logprobs"] = [None] * 6
        rec["student_topk_logprobs"] = [None] * 6
        for j, i in enumerate(starts):
            rec["tokens"][i] = wrote[j]
            rec["teacher_logprobs"][i] = ln(teacher_lp[j])
            rec["teacher_topk_ids"][i] = [top[j], 9]
            rec["teacher_topk_logprobs"][i] = [ln(top_lp[j]), ln(0.01)]
            rec["student_topk_logprobs"][i] = [ln(student_top_lp[j]), ln(0.01)]
        return rec

    rows = [
        # step 3: the student wrote "move" twice, the teacher doubting one (0.05 < 0.1); the teacher sure
        # of "move" at the first (0.9 > 0.5: kept), unsure at the second (0.4: not read)
        episode(3, [0, 3], ["move", "move"], [0.05, 0.3], [8, 8], [0.9, 0.4], [0.2, 0.7]),
        # step 9: same window; "go" written where the teacher is sure of "move"
        episode(9, [1], ["go"], [0.02], [8], [0.8], [0.4]),
        # step 25: window 2; the student gives the teacher's sure "go" 0.6
        episode(25, [2, 4], ["go", "move"], [0.6, 0.5], [7, 8], [0.7, 0.6], [0.6, 0.01]),
        {"step": 26, "tokens": ["x"], "topk_tokens": names},  # a math-style record: no turns, nothing read
    ]
    path = tmp_path / "rollouts.jsonl"
    # a killed run's last line, cut short: skipped, not an error
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 30, "turns": [{"sta')
    got = first_word_windows(path)
    assert got["kept"]["move"] == pytest.approx({0: (0.2 + 0.4) / 2, 2: 0.01})
    assert got["kept"]["go"] == pytest.approx({2: 0.6})
    assert got["doubted"]["move"] == pytest.approx({0: 1 / 2, 2: 0.0})
    assert got["doubted"]["go"] == pytest.approx({0: 1.0, 2: 0.0})
    assert set(got["kept"]) == {"go", "move"} and "x" not in got["doubted"]
    assert first_word_windows(tmp_path / "missing.jsonl") == {"kept": {}, "doubted": {}}


def test_agentic_first_word_table_counts_the_seeds_that_lost_a_word(tmp_path):
    from opd.lab.experiments.agentic import VARIANTS, first_word_table
    from opd.lab.experiments.core import Analysis, Settings

    s = Settings(tmp_path, seeds=2, quick=False)
    ln = math.log

    def record(step, student_p, doubted):
        return {
            "step": step,
            "topk_tokens": {"8": "move"},
            "turns": [{"start": 0}],
            "tokens": ["move"],
            "teacher_logprobs": [ln(0.05 if doubted else 0.9)],
            "teacher_topk_ids": [[8]],
            "teacher_topk_logprobs": [[ln(0.9)]],
            "student_topk_logprobs": [[ln(student_p)]],
        }

    # seed 0 loses "move" (0.8 -> 0.01 -> 0.02), seed 1 dips and recovers (0.6 -> 0.1 -> 0.7)
    seeds = [
        [record(0, 0.8, True), record(15, 0.01, False), record(25, 0.02, False)],
        [record(0, 0.6, False), record(15, 0.1, False), record(25, 0.7, False)],
    ]
    for variant in VARIANTS:
        for k, rows in enumerate(seeds):
            run = s.run_dir(f"{variant}/seed{k}")
            run.mkdir(parents=True)
            (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = Analysis()
    first_word_table(a, s)
    (table,) = a.tables
    assert len(table["rows"]) == len(VARIANTS)
    # early uses doubted: 1 of 1 (seed 0), 0 of 1 (seed 1) -> 50; first (0.8+0.6)/2, lowest (0.01+0.1)/2,
    # last (0.02+0.7)/2; one seed of two ends below 5%
    assert table["rows"][0] == [next(iter(VARIANTS)), "move", "50", "70", "6", "36", "1 of 2"]


def test_a_pipe_in_a_cell_does_not_split_its_row():
    import re

    from opd.lab.experiments.core import Analysis, render_markdown

    a = Analysis()
    a.table("t", ["what", "mean |x|"], [["gap |a - b|", "0.5"]])
    res = {"quick": False, "seeds": 3, "wall_s": 60, "runs_total": 1, "generated": "now", "about": "", "notes": []}
    res.update(machine={"cpu_cores": 2, "torch": "2", "python": "3"}, tables=a.tables, plots=[])
    res["claims"] = [{"source": "s", "claim": "|a| > 0", "rule": "r", "verdict": "reproduced", "evidence": "e"}]
    rows = [line for line in render_markdown(res).splitlines() if line.startswith("|")]
    cells = [len(re.split(r"(?<!\\)\|", line)) - 2 for line in rows]
    assert cells == [5, 5, 5, 2, 2, 2], rows  # the claims table, then the table: every row as wide as its header


def test_a_copy_of_the_tree_sent_elsewhere_names_its_commit_from_opd_commit(monkeypatch):
    """OPD_COMMIT names the code where set (a copy's .git may be missing or not the tree's); without it,
    git's HEAD, and 'unknown' outside a checkout."""
    import subprocess

    from opd.lab.experiments.core import machine_words, source_commit

    monkeypatch.delenv("OPD_COMMIT", raising=False)
    assert source_commit() != "unknown"  # this checkout
    monkeypatch.setenv("OPD_COMMIT", "abc1234")
    assert source_commit() == "abc1234"
    monkeypatch.delenv("OPD_COMMIT")
    no_git = lambda *a, **k: subprocess.CompletedProcess(a, 128, "", "fatal: not a git repository")  # noqa: E731
    monkeypatch.setattr(subprocess, "run", no_git)
    assert source_commit() == "unknown"
    cpu = {"cpu_cores": 2, "torch": "2.13.0+cpu"}
    assert machine_words(cpu) == "2 CPU cores, torch 2.13.0+cpu"
    assert machine_words(cpu | {"gpu": "NVIDIA H100"}) == "2 CPU cores, torch 2.13.0+cpu on an NVIDIA H100"


def test_runs_recorded_with_their_options_in_another_order_are_rekeyed_not_made_again(tmp_path, capsys):
    """A run recorded with the same flags listed in another order (the runner's order changed) takes today's
    key, chained runs included; one whose recorded key says its inputs differed, or whose flags differ, is
    left to be made again."""
    from opd.config import EvalConfig
    from opd.lab.experiments.core import _up_to_date, rekey_reordered

    s = Settings(tmp_path / "exp", seeds=1, quick=True)
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"w")

    def spec(name: str, student: Path, size: int) -> RunSpec:
        return RunSpec(name, "eval", EvalConfig.from_flat(student=str(student), eval_size=size, max_new_tokens=7))

    specs = [spec("a", model, 3), spec("b", s.run_dir("a"), 5), spec("c", model, 4), spec("d", model, 6)]
    keys = Keys(specs, s.run_dir, command_line)

    def reordered(sp: RunSpec, run_dir: Path) -> str:
        words = shlex.split(command_line(sp, run_dir))
        flags = [i for i, w in enumerate(words) if w.startswith("--")]
        groups = [words[i:j] for i, j in zip(flags, [*flags[1:], len(words)], strict=True)]
        assert len(groups) >= 3
        return " ".join([*words[: flags[0]], *(shlex.join(g) for g in reversed(groups))])

    old = Keys(specs, s.run_dir, reordered)
    records = {
        "a": (reordered(specs[0], s.run_dir("a")), old["a"]),
        "b": (reordered(specs[1], s.run_dir("b")), old["b"]),  # reads a's folder: its key chains through a's
        "c": (reordered(specs[2], s.run_dir("c")), "0" * 64),  # recorded with other inputs
        "d": (reordered(specs[2], s.run_dir("d")).replace("--eval-size 4", "--eval-size 9"), old["d"]),
    }
    for name, (command, key) in records.items():
        s.run_dir(name).mkdir(parents=True)
        (s.run_dir(name) / DONE).write_text(json.dumps({"command": command, "key": key}) + "\n")
        assert command != command_line(specs["abcd".index(name)], s.run_dir(name))
    assert old["a"] != keys["a"] and old["b"] != keys["b"]

    assert rekey_reordered(specs, s, keys) == ["a", "b"]
    assert [_up_to_date(sp, s, keys[sp.name]) for sp in specs] == [True, True, False, False]
    done_a = json.loads((s.run_dir("a") / DONE).read_text())
    assert done_a == {"command": command_line(specs[0], s.run_dir("a")), "key": keys["a"]}
    assert json.loads((s.run_dir("c") / DONE).read_text())["key"] == "0" * 64
    assert "a: re-keyed" in capsys.readouterr().out
    assert rekey_reordered(specs, s, keys) == []  # once
