"""The experiment machinery: run specs, the resuming runner, and the written outputs.

An :class:`Experiment` is a plan (the list of :class:`RunSpec` it needs, for given seeds and
size) plus an analysis that reads *only* the run directories and returns tables, plots and
claim verdicts. :func:`run_experiment` executes the plan under ``OUT/NAME/runs/``, skipping runs
whose directory holds ``DONE.json`` and resuming interrupted ``opd train`` runs from their
latest checkpoint, then writes ``results.md``, ``results.json``, the PNG plots and
``commands.txt`` (the ``opd`` command equivalent to each run) into ``OUT/NAME/``.

Run kinds: ``train`` (:func:`opd.training.loop.train`), ``sft`` (:func:`opd.training.sft.sft`), ``eval``
(:func:`opd.evaluation.model_eval.run_eval`) and ``python`` (an experiment's own measurement function, e.g.
the synthetic variance study, called as ``fn(params, run_dir) -> dict``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from opd.config.fields import option_fields
from opd.errors import UserError
from opd.lab.demos.parallel import process_pool, threads_per_worker, with_threads
from opd.lab.experiments.keys import Keys
from opd.lab.experiments.rundata import RunData
from opd.runs.provenance import source_commit
from opd.runs.rundir import STARTED

DONE = "DONE.json"
# STARTED (opd.runs.rundir): the command a train run was begun with: resume only that one
DATA = "data.json"  # what the analysis read of the runs (opd.lab.experiments.rundata)


@dataclass
class Settings:
    """What the user asked for: where, how many seeds, full size or ``--quick``."""

    out: Path  # OUT/NAME
    seeds: int
    quick: bool
    adopt: bool = False  # reuse runs finished before runs were keyed, when their command matches
    # how the analysis reads the runs: recorded from the run folders, or replayed from data.json
    reads: RunData | None = None
    commit: str = ""  # the code this invocation runs, read once at its start (a later edit does not change it)

    def __post_init__(self) -> None:
        if self.reads is None:
            self.reads = RunData(self.runs)
        self.commit = self.commit or source_commit()

    @property
    def run_data(self) -> RunData:
        """:attr:`reads`, which ``__post_init__`` always sets."""
        return cast(RunData, self.reads)

    @property
    def runs(self) -> Path:
        return self.out / "runs"

    def run_dir(self, name: str) -> Path:
        return self.runs / name


@dataclass
class RunSpec:
    """One run of an experiment; ``name`` is its directory under ``OUT/NAME/runs``."""

    name: str
    kind: str  # train | sft | eval | python
    config: Any  # TrainConfig | SFTConfig | EvalConfig | dict of parameters (python)
    fn: Callable[[dict, Path], dict] | None = None
    label: str = ""  # what a python step does, for commands.txt
    # The runs whose outputs this one reads (--workers > 1 may start it once they are finished);
    # None: every run before it in the plan.
    needs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("train", "sft", "eval", "python"):
            raise ValueError(f"unknown run kind {self.kind!r}")
        if self.kind == "python" and self.fn is None:
            raise ValueError(f"python run {self.name} needs fn")


@dataclass
class Claim:
    """A claim of a paper, the rule that decides it here, the verdict and the numbers behind it."""

    source: str  # e.g. "2603.25562 Fig. 1a"
    claim: str
    rule: str
    verdict: str
    evidence: str
    # the verdict's p-value (stats.with_p: the smallest alpha at which the (1 - alpha) interval gives it),
    # for the false-discovery-rate correction over all claims; None where it was not recorded
    p: float | None = None
    by_construction: str = ""  # why the claim holds whatever the runs do (a test that cannot fail), if it does


@dataclass
class Analysis:
    tables: list[dict] = field(default_factory=list)  # {"title", "headers", "rows", "note"}
    plots: list[str] = field(default_factory=list)  # file names inside OUT/NAME
    claims: list[Claim] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, title: str, headers: list[str], rows: list[list], note: str = "") -> None:
        self.tables.append(
            {"title": title, "headers": headers, "rows": [[str(c) for c in r] for r in rows], "note": note}
        )


@dataclass
class Experiment:
    name: str
    title: str
    about: str  # what it measures, full-size cost, what was cut (markdown)
    plan: Callable[[Settings], list[RunSpec]]
    analyze: Callable[[Settings, list[RunSpec]], Analysis]


# ----------------------------------------------------------------------------- running


def _finished(run_dir: Path) -> bool:
    return (run_dir / DONE).is_file()


def _started_as(run_dir: Path) -> dict | None:
    """The command and key a train run was begun with (None: never begun by the runner)."""
    try:
        started = json.loads((run_dir / STARTED).read_text())
    except (OSError, ValueError):
        return None
    return {"command": started.get("command"), "key": started.get("key")}


def _flag_groups(command: str) -> list[tuple[str, ...]]:
    """A command's words flag by flag (each flag with the values after it), sorted: its order left out."""
    groups: list[list[str]] = []
    for word in shlex.split(command):
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return sorted(tuple(g) for g in groups)


def rekey_reordered(specs: list[RunSpec], settings: Settings, keys: Keys) -> list[str]:
    """Runs recorded with a command that lists today's flags in another order (opd's options moved between
    config classes, and the runner lists them by section since) take today's key, so a finished run is
    reused and a begun one resumed rather than made again. Only where the recorded key is what the recorded
    commands give with today's inputs (keys chain: the plan's runs are all read through their own records
    here), so a run whose inputs changed since is still made again. Returns the names re-keyed."""
    records: dict[str, list[tuple[Path, dict]]] = {}
    for s in specs:
        run_dir = settings.run_dir(s.name)
        now = command_line(s, run_dir)
        for path in (run_dir / DONE, run_dir / STARTED):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            then = data.get("command")
            if s.kind != "python" and isinstance(then, str) and then != now and _flag_groups(then) == _flag_groups(now):
                records.setdefault(s.name, []).append((path, data))
    if not records:
        return []
    recorded = Keys(
        specs,
        settings.run_dir,
        lambda s, d: records[s.name][0][1]["command"] if s.name in records else command_line(s, d),
    )
    done = []
    for name, found in records.items():
        for path, data in found:
            if data.get("key") == recorded[name] != keys[name]:
                now = command_line(recorded.specs[name], settings.run_dir(name))
                indent = 2 if path.name == DONE else None
                path.write_text(
                    json.dumps({**data, "command": now, "key": keys[name]}, indent=indent, default=str) + "\n"
                )
                done.append(name)
    for name in dict.fromkeys(done):
        print(f"{name}: re-keyed (recorded with the same options in another order)", flush=True)
    return list(dict.fromkeys(done))


def _execute(spec: RunSpec, run_dir: Path, show_progress: bool, command: str, key: str) -> dict:
    if spec.kind == "train":
        from opd.runs.rundir import RunDir, mark_run
        from opd.training.loop import train

        started = (run_dir / "metrics.jsonl").exists()
        begun_as = {"command": command, "key": key}
        if started and (_started_as(run_dir) != begun_as or RunDir(run_dir).latest_checkpoint() is None):
            shutil.rmtree(run_dir)  # begun with other settings or inputs, or killed before its first checkpoint
            started = False
        mark_run(run_dir, "train", by="experiment")  # the experiment's folder: opd train's checks let it in
        (run_dir / STARTED).write_text(json.dumps(begun_as) + "\n")
        cfg = spec.config.replace(out=str(run_dir), resume=started)
        return train(cfg, show_progress=show_progress) or {}
    if spec.kind == "sft":
        from opd.training.sft import sft

        shutil.rmtree(run_dir, ignore_errors=True)  # sft has no resume: an interrupted one starts over
        return sft(spec.config.replace(out=str(run_dir)), show_progress=show_progress)
    if spec.kind == "eval":
        from opd.evaluation.model_eval import run_eval

        return run_eval(spec.config.replace(out=str(run_dir)))
    run_dir.mkdir(parents=True, exist_ok=True)
    return cast(Callable[[dict, Path], dict], spec.fn)(dict(spec.config), run_dir)  # checked by RunSpec


def run_specs(specs: list[RunSpec], settings: Settings, show_progress: bool = True, workers: int = 1) -> list[dict]:
    """Run each spec in order (later specs may use earlier ones' outputs); skip finished ones, and those
    the settings read from a recording (``settings.run_data.kept``).
    ``workers`` > 1: that many at once, each in its own process, a spec starting once the runs it
    ``needs`` have finished."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("run names within an experiment must be unique")
    if workers < 1:
        raise UserError(f"--workers {workers} must be >= 1")
    keys = Keys(specs, settings.run_dir, command_line)  # before any run: a changed input shows at once
    rekey_reordered(specs, settings, keys)
    kept = {s.name: {"run": s.name, "status": RECORDED} for s in specs if s.name in settings.run_data.kept}
    made = [s for s in specs if s.name not in kept]
    if workers == 1:
        log = {
            spec.name: _run_one(spec, settings, show_progress, f"[{i}/{len(made)}]", keys[spec.name])
            for i, spec in enumerate(made, 1)
        }
    else:
        log = _run_side_by_side(made, settings, workers, keys, set(kept))
    return [(kept | log)[n] for n in names]


RECORDED = "from the recording (not made again)"


def kept_from_recording(specs: list[RunSpec], settings: Settings, recorded: dict) -> set[str]:
    """The runs ``opd experiment --recorded`` takes from an earlier recording instead of making them:
    those it holds (their DONE.json) that have not finished in their own folder, less those a run that
    is made reads from (a run reads its inputs from their folders, so they are made too)."""
    files = recorded.get("files", {})
    kept = {s.name for s in specs if files.get(f"{s.name}/{DONE}") and not _finished(settings.run_dir(s.name))}
    keys = Keys(specs, settings.run_dir, command_line)
    reads = {s.name: keys.inputs(s.name) | set(s.needs or ()) for s in specs}
    frontier = [s.name for s in specs if s.name not in kept]
    while frontier:
        needed = {d for name in frontier for d in reads[name]} & kept
        kept -= needed
        frontier = sorted(needed)
    return kept


def _up_to_date(spec: RunSpec, settings: Settings, key: str) -> bool:
    """Finished earlier with the settings and inputs asked for now (see :mod:`opd.lab.experiments.keys`);
    says so when it is, as a reused run's numbers may be older than the code."""
    run_dir = settings.run_dir(spec.name)
    if not _finished(run_dir):
        return False
    done = json.loads((run_dir / DONE).read_text())
    if settings.adopt and "key" not in done and done.get("command") == command_line(spec, run_dir):
        (run_dir / DONE).write_text(json.dumps({**done, "key": key}, indent=2, default=str) + "\n")
        print(f"{spec.name}: adopted (finished before runs were keyed; its inputs were not checked)", flush=True)
        return True
    if done.get("key") != key:
        return False
    print(f"{spec.name}: reused (finished earlier with the same command and inputs, key {key[:12]})", flush=True)
    return True


SKIPPED = "skipped (finished earlier)"


def _run_one(spec: RunSpec, settings: Settings, show_progress: bool, counter: str, key: str) -> dict:
    run_dir = settings.run_dir(spec.name)
    command = command_line(spec, run_dir)
    if _up_to_date(spec, settings, key):
        return {"run": spec.name, "status": SKIPPED}
    if _finished(run_dir):
        # Finished with other settings or inputs (the experiment's definition changed, or a model it
        # reads): its results would not be the ones asked for, so it is made again from scratch.
        print(f"{spec.name}: finished with other settings or inputs; running it again", flush=True)
        shutil.rmtree(run_dir)
    print(f"{counter} {spec.kind} {spec.name}", flush=True)
    t0 = time.time()
    result = _execute(spec, run_dir, show_progress, command, key)
    wall = round(time.time() - t0, 2)
    record = {"run": spec.name, "kind": spec.kind, "wall_s": wall, "command": command, "key": key}
    record |= {"commit": settings.commit, "finished": time.strftime("%Y-%m-%d", time.gmtime()), "result": result}
    (run_dir / DONE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return {"run": spec.name, "status": "ran", "wall_s": wall}


def _run_side_by_side(
    specs: list[RunSpec], settings: Settings, workers: int, keys: Keys, kept: set[str]
) -> dict[str, dict]:
    """The scheduler of ``run_specs(workers > 1)``: a run's error stops the experiment once the
    runs already going have ended (finished runs keep their DONE.json; a rerun resumes). The ``kept``
    runs (taken from a recording) count as finished."""
    names = [s.name for s in specs]
    needs = {}
    for i, spec in enumerate(specs):
        needs[spec.name] = set(names[:i] if spec.needs is None else spec.needs) - kept
        if not needs[spec.name] <= set(names[:i]):
            raise ValueError(
                f"run {spec.name} needs {sorted(needs[spec.name] - set(names[:i]))}: not earlier in the plan"
            )
    threads = threads_per_worker(workers)
    print(f"{len(specs)} runs, {workers} at once ({threads} CPU thread(s) each)", flush=True)
    # Runs finished earlier are skipped here, without starting a process for each.
    log = {s.name: {"run": s.name, "status": SKIPPED} for s in specs if _up_to_date(s, settings, keys[s.name])}
    pending, done = [s for s in specs if s.name not in log], set(log)
    running: dict[Future, RunSpec] = {}
    with process_pool(workers) as pool:
        while pending or running:
            for spec in [s for s in pending if needs[s.name] <= done][: workers - len(running)]:
                pending.remove(spec)
                counter = f"[{names.index(spec.name) + 1}/{len(specs)}]"
                job = pool.submit(with_threads, threads, _run_one, spec, settings, False, counter, keys[spec.name])
                running[job] = spec
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for job in finished:
                spec = running.pop(job)
                log[spec.name] = job.result()
                done.add(spec.name)
    return log


# An analysis reads the runs through these (and :func:`derived`) alone, so that opd results can replay it.


def read_done(settings: Settings, name: str) -> dict:
    done = settings.run_data.read(name, DONE)
    if done is None:
        raise UserError(f"run {settings.run_dir(name)} has not finished; rerun the experiment to complete it")
    return done


def read_metrics(settings: Settings, name: str) -> list[dict]:
    """The records of a run's metrics.jsonl (training steps and eval records alike)."""
    return settings.run_data.read(name, "metrics.jsonl") or []


def read_run_file(settings: Settings, name: str, file: str) -> Any:
    """A JSON file a run wrote (``.jsonl``: its records)."""
    found = settings.run_data.read(name, file)
    if found is None:
        raise UserError(f"{settings.run_dir(name) / file} is missing; rerun the experiment to make it")
    return found


def derived(settings: Settings, key: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(the runs folder)``, for values drawn from files too large to keep (the logged rollouts);
    the value is what the run data keeps. ``key`` names it uniquely within the experiment."""
    return settings.run_data.derived(key, compute)


# ----------------------------------------------------------------------------- commands


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _flag_values(cfg: Any) -> list[str]:
    """``--flag value`` for every option that differs from its default, section by section and in each
    section in its class's order, as ``--help`` lists them (runs recorded with the same flags in another
    order keep their results: :func:`rekey_reordered`)."""
    parts = []
    values = cfg.flat()
    for _, f in option_fields(type(cfg)):
        value = values[f.name]
        if value == _field_default(f) or f.name == "resume":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):  # a task list's entries as JSON mappings, one --tasks each
            parts.extend(f"{flag} {json.dumps(json.dumps(v) if isinstance(v, dict) else str(v))}" for v in value)
        else:
            text = str(value)
            parts.append(f"{flag} {text if text and ' ' not in text else json.dumps(text)}")
    return parts


def command_line(spec: RunSpec, run_dir: Path) -> str:
    if spec.kind == "python":
        params = json.dumps(spec.config, sort_keys=True)
        fn = cast(Callable, spec.fn)  # a python run has one (RunSpec checks)
        return f"# python step ({spec.label or fn.__module__ + '.' + fn.__name__}) -> {run_dir}: {params}"
    cfg = spec.config.replace(out=str(run_dir))
    return " ".join(["opd", spec.kind, *_flag_values(cfg)])


# ----------------------------------------------------------------------------- outputs


def cell_in_process(script: str, spec: dict, root: Path, error_chars: int = 2000) -> dict:
    """A benchmark's cell run alone, in a fresh process (``script --cell SPEC``: its peak memory is its own),
    with ``root``'s sources; the cell's JSON (its script prints it last), or the spec and its error's tail."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, script, "--cell", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
    if out.returncode:
        return {**spec, "error": out.stderr[-error_chars:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine_info() -> dict:
    import torch

    return {
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        # the CPU kernels torch picked (AVX512, AVX2, ...): float rounding, and so a run's figures, differ by it
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # runs compute on the GPU when torch sees one (--device auto, every run's default)
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine_words(m: dict) -> str:
    """``N CPU cores, torch V`` and the GPU where there was one."""
    return f"{m['cpu_cores']} CPU cores, torch {m['torch']}" + (f" on an {m['gpu']}" if m.get("gpu") else "")


def md_cell(text: str) -> str:
    """A table cell's text with its pipes escaped (a bare ``|`` would split the row)."""
    return re.sub(r"(?<!\\)\|", r"\\|", str(text))


def _md_table(t: dict) -> str:
    lines = [
        f"**{t['title']}**",
        "",
        "| " + " | ".join(map(md_cell, t["headers"])) + " |",
        "|" + "|".join("---" for _ in t["headers"]) + "|",
    ]
    lines += ["| " + " | ".join(map(md_cell, r)) + " |" for r in t["rows"]]
    if t.get("note"):
        lines += ["", t["note"]]
    return "\n".join(lines)


def claim_text(claim: dict) -> str:
    """A claim as the tables show it: a claim true by construction says so, and why."""
    why = claim.get("by_construction")
    return f"{claim['claim']} (*true by construction*: {why})" if why else claim["claim"]


def verdict_cell(res: dict, claim: dict) -> str:
    """The verdict as shown: a --quick run's verdict is marked, since a few steps decide nothing."""
    if res["quick"]:
        return f"*{claim['verdict']}* (quick smoke run: not a result)"
    return f"**{claim['verdict']}**"


def made_at(res: dict) -> str:
    """Which code made the runs behind a result ("measured at ..."), as its results.json records it."""
    made = [m for m in res.get("runs_made_at", []) if m["commit"] != "unknown"]
    if not made:  # runs made before they recorded their commit: a stamp written with the result, if any
        return res.get("measured_at", "the commit its runs were made at was not recorded")
    # a full hash (OPD_COMMIT set from `git rev-parse HEAD`) is shown as git's short one
    short = lambda c: c[:7] if re.fullmatch(r"[0-9a-f]{40}", c) else c  # noqa: E731
    return "runs made at " + ", ".join(f"{short(m['commit'])} ({m['date'] or 'date not recorded'})" for m in made)


def render_markdown(res: dict, plot_prefix: str = "") -> str:
    """The body of an experiment's results (used for results.md and docs/RESULTS.md)."""
    size = "quick (--quick: a shortened smoke version, NOT the full result)" if res["quick"] else "full size"
    m = res["machine"]
    out = [
        f"Size: {size}; seeds: {res['seeds']}; wall time {res['wall_s'] / 60:.1f} min of runs "
        f"({res['runs_total']} runs); machine: {machine_words(m)}, "
        f"Python {m['python']}; generated {res['generated']}; {made_at(res)}.",
        "",
        res["about"].strip(),
        "",
    ]
    if res["claims"]:
        out += ["**Claims**", "", "| source | claim | rule | verdict | numbers |", "|---|---|---|---|---|"]
        out += [
            "| "
            + " | ".join(
                md_cell(x) for x in (c["source"], claim_text(c), c["rule"], verdict_cell(res, c), c["evidence"])
            )
            + " |"
            for c in res["claims"]
        ]
        out.append("")
    for t in res["tables"]:
        out += [_md_table(t), ""]
    for p in res["plots"]:
        out += [f"![{p}]({plot_prefix}{p})", ""]
    out += [f"- {n}" for n in res["notes"]]
    return "\n".join(out).rstrip() + "\n"


def run_experiment(
    exp: Experiment,
    out: Path,
    seeds: int,
    quick: bool,
    show_progress: bool = True,
    workers: int = 1,
    adopt: bool = False,
    recorded: Path | None = None,
) -> dict:
    """Run (or resume) every run of ``exp``, analyse, and write its outputs under ``out/exp.name``.
    ``recorded``: an earlier ``data.json`` of ``exp``; the runs it holds are read from it, not made again
    (:func:`kept_from_recording`), so seeds can be added to committed run data without its run folders."""
    if seeds < 1:
        raise UserError(f"--seeds {seeds} must be >= 1 (3 or more for intervals)")
    settings = Settings(Path(out) / exp.name, seeds, quick, adopt)
    settings.runs.mkdir(parents=True, exist_ok=True)
    specs = exp.plan(settings)
    if recorded is not None:
        recording = RunData.load_recording(recorded)
        kept = kept_from_recording(specs, settings, recording)
        settings.reads = RunData(settings.runs, recording, kept)
        print(f"{len(kept)} of {len(specs)} runs read from {recorded}, not made again", flush=True)
    t0 = time.time()
    log = run_specs(specs, settings, show_progress, workers)
    analysis = exp.analyze(settings, specs)
    dones = [read_done(settings, s.name) for s in specs]
    wall_runs = sum(d["wall_s"] for d in dones)
    # the code each run was made with: runs reused from earlier invocations may predate this one's commit
    made_at = sorted({(d.get("commit", "unknown"), d.get("finished", "")) for d in dones}, key=lambda c: c[1])
    res = {
        "name": exp.name,
        "title": exp.title,
        "about": exp.about,
        "quick": quick,
        "seeds": seeds,
        "wall_s": wall_runs,
        "wall_s_this_invocation": round(time.time() - t0, 1),
        "runs_total": len(specs),
        "machine": machine_info(),
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "analysed_at": settings.commit,
        "runs_made_at": [{"commit": c, "date": d} for c, d in made_at],
        "tables": analysis.tables,
        "plots": analysis.plots,
        "notes": analysis.notes,
        "claims": [dataclasses.asdict(c) for c in analysis.claims],
        "run_log": log,
        "command": f"opd experiment {exp.name} --seeds {seeds} --out {out}"
        + (" --quick" if quick else "")
        + (f" --recorded {recorded}" if recorded is not None else ""),
    }
    settings.run_data.write(settings.out / DATA)
    (settings.out / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (settings.out / "results.md").write_text(f"# {exp.title}\n\n{render_markdown(res)}")
    lines = [f"# {res['command']}", "# the equivalent of each run (python steps are internal to opd.lab.experiments):"]
    lines += [command_line(s, settings.run_dir(s.name)) for s in specs]
    (settings.out / "commands.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {settings.out / 'results.md'}", file=sys.stderr)
    return res
