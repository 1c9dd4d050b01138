"""The embedded default (``opd demo``): OPD on a laptop CPU in minutes, start to finish.

Everything is made locally: the built-in arithmetic task, a byte-level BPE tokenizer trained on
it, and two tiny Qwen2 models trained with ``opd sft`` -- a strong teacher trained on every
training solution, and a smaller student that writes the same
``<think>...</think> The answer is \\boxed{N}`` format but learned from 1,000 of them only, to its
plateau: the common situation of a small labelled set and a teacher that knows more. Those models ship
with the package (``opd/assets/demo``) because training the teacher takes longer than the demo
should; ``opd make-demo-models --out DIR`` reproduces them.

The demo evaluates teacher and student, then runs sampled-token OPD and LSM from the same
student with the same seeds and settings, evaluates both, and writes ``summary.json`` and a
table, then the report of both runs (``report.html``, :mod:`opd.report`). Each run directory holds
``final/`` (the trained student, loadable with AutoModelForCausalLM/AutoTokenizer) and
``eval.jsonl`` (the evaluation prompts).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opd.config import SFTConfig, TrainConfig
from opd.errors import UserError
from opd.evaluation.model_eval import evaluate_model
from opd.lab.demos.parallel import process_pool, threads_per_worker, with_threads
from opd.models.loading import load_model, load_tokenizer, resolve_device
from opd.models.tokenizer import train_tokenizer
from opd.report import PNG_DIR, write_report
from opd.rollout.prompt_set import PromptSet, load_task
from opd.tasks import Task, get_task
from opd.training.schedule import split_by_task

ASSETS = Path(__file__).parents[2] / "assets" / "demo"
TASK_LEVEL = 2
VOCAB_SIZE = 2048
TEACHER_ARCH, STUDENT_ARCH = "qwen2:4:256", "qwen2:2:128"
STUDENT_TRAIN_SIZE = 1000  # of the task's 20,000 training solutions; the teacher learns from all
EVAL_SIZE, EVAL_SAMPLES = 300, 4
MAX_NEW_TOKENS = 48
TOP_P = 0.9  # rollouts and avg@k sampling alike, so before/after figures are comparable


def make_demo_models(out: Path, quick: bool = False, seed: int = 0, only: str = "") -> dict:
    """Train the tokenizer, the teacher and the student of the demo into ``out``.

    ``only="teacher"`` or ``"student"`` makes just that model (reusing ``out/tokenizer``)."""

    if only not in ("", "teacher", "student"):
        raise UserError(f"--only {only!r}: use teacher or student (or leave it empty for both)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (only and (out / "tokenizer" / "tokenizer.json").is_file()):
        train = get_task("arithmetic", level=TASK_LEVEL, seed=seed).examples("train")
        solutions = cast(list[str], [e.solution for e in train])  # the arithmetic task writes every solution
        tok = train_tokenizer([e.prompt for e in train] + solutions, VOCAB_SIZE)
        tok.save_pretrained(out / "tokenizer")
    # --quick only checks that the recipe runs (tests): a few steps, small batches.
    plans = {
        "teacher": teacher_sft_config(out / "runs" / "teacher", str(out / "tokenizer"), quick, seed),
        "student": student_sft_config(out / "runs" / "student", str(out / "tokenizer"), quick, seed),
    }
    return train_models(out, plans, only)


def student_sft_config(out: Path, tokenizer: str, quick: bool = False, seed: int = 0) -> SFTConfig:
    """The demo student's recipe: a new STUDENT_ARCH model trained on a small labelled set (the first
    STUDENT_TRAIN_SIZE solutions) at a constant rate until its accuracy stops improving: more of the
    same supervised training cannot raise it, while OPD brings the teacher's knowledge on every task
    prompt."""
    return SFTConfig.from_flat(
        arch=STUDENT_ARCH,
        out=str(out),
        lr=1e-3,
        schedule="constant",
        steps=10 if quick else 3000,
        warmup_steps=2 if quick else 100,
        patience=0 if quick else 5,
        eval_every=10 if quick else 100,
        train_size=STUDENT_TRAIN_SIZE,
        **_sft_common(tokenizer, quick, seed),
    )


def _sft_common(tokenizer: str, quick: bool, seed: int) -> dict:
    return dict(
        task="arithmetic",
        task_level=TASK_LEVEL,
        seed=seed,
        tokenizer=tokenizer,
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=8 if quick else 64,
        eval_size=16 if quick else 300,
        validation_size=0,  # the packaged models were chosen on the test set (made before --validation-size)
    )


def teacher_sft_config(out: Path, tokenizer: str, quick: bool = False, seed: int = 0) -> SFTConfig:
    """The demo teacher's recipe: a new TEACHER_ARCH model (``tokenizer``: its tokenizer directory)
    trained on every training solution of the task; ``quick``: a few steps that only show it runs.
    The cross-tokenizer experiment trains its teacher with this recipe and another tokenizer."""
    return SFTConfig.from_flat(
        arch=TEACHER_ARCH,
        out=str(out),
        lr=1e-3,
        steps=10 if quick else 1200,
        warmup_steps=2 if quick else 100,
        eval_every=10 if quick else 200,
        **_sft_common(tokenizer, quick, seed),
    )


def train_models(out: Path, plans: Mapping[str, SFTConfig | list[SFTConfig]], only: str = "") -> dict:
    """Run each plan's ``opd sft`` (``only``: just that one), move its best model to ``out/<name>``
    and record its summary in ``out/make_summary.json``. A plan may be a list of stages, each
    starting from the one before (its ``init``); only the last stage's model is kept, and the
    summary lists every stage's."""
    from opd.training.sft import sft

    summary_path = out / "make_summary.json"
    for name, stages in plans.items():
        if only and name != only:
            continue
        stages = stages if isinstance(stages, list) else [stages]
        results = []
        for cfg in stages:
            shutil.rmtree(cfg.run.out, ignore_errors=True)  # remade from scratch, its old logs included
            results.append(sft(cfg))
        for cfg in stages[:-1]:  # their weights live on in the next stage's
            shutil.rmtree(Path(cfg.run.out) / "final")
        result = {**results[-1], "stages": results} if len(stages) > 1 else results[0]
        # Read just before writing: `--only teacher` and `--only student` may run side by side.
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        summary[name] = result
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        final = Path(stages[-1].run.out) / "final"
        target = out / name
        if target.exists():
            shutil.rmtree(target)
        final.rename(target)
    return json.loads(summary_path.read_text())


def _eval(model_dir: Path, prompts: PromptSet, task: Task, tok, seed: int) -> dict:
    model = load_model(model_dir, "model", device=resolve_device("auto"))  # where the demo's training ran
    return evaluate_model(
        model,
        tok,
        prompts,
        task,
        max_new_tokens=MAX_NEW_TOKENS,
        samples=EVAL_SAMPLES,
        top_p=TOP_P,
        seed=seed,
        show_progress=True,
    )


def run_demo(out: Path, steps: int = 200, quick: bool = False, assets: Path | None = None, seed: int = 0) -> dict:
    """Evaluate teacher and student, run sampled-token OPD and LSM, compare."""

    assets = Path(assets) if assets else ASSETS
    for name in ("teacher", "student"):
        if not (assets / name / "config.json").is_file():
            raise UserError(f"demo model {assets / name} is missing; run `opd make-demo-models --out {assets}` first")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    tok = load_tokenizer(assets / "student")
    task = load_task("arithmetic", TASK_LEVEL, seed)
    eval_size = 64 if quick else EVAL_SIZE
    prompts = PromptSet.build(task.examples("test")[:eval_size], tok, 256, "test prompts")
    console.print(f"[bold]opd demo[/bold]: evaluating the teacher and the student on {eval_size} test prompts")
    console.print(machine_line())
    teacher_res = _eval(assets / "teacher", prompts, task, tok, seed)
    student_res = _eval(assets / "student", prompts, task, tok, seed)
    base = opd_config(assets, seed, steps, quick, eval_size=eval_size)
    results = run_objectives(base, ("sampled", "lsm"), out, console)
    summary = {
        "teacher_acc": teacher_res["accuracy"],
        "teacher_avg_at_k": teacher_res.get("avg_at_k"),
        "student_init_acc": student_res["accuracy"],
        "student_init_avg_at_k": student_res.get("avg_at_k"),
        "eval_size": eval_size,
        "k": EVAL_SAMPLES,
        "objectives": results,
        **machine_fields(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(summary_table(summary))
    report = write_report([out / name for name in results], out / "report")
    console.print(f"report: {report}  (open it in a browser; the charts are also PNGs in {report.parent / PNG_DIR})")
    return summary


def machine_fields() -> dict:
    """What a demo's figures depend on besides its seeds and code: torch's version and the instruction set
    of the CPU kernels it picked (its CPU capability). Kernels for another instruction set round floats
    differently and 200 steps amplify it: the same commit prints other figures on another CPU, or with
    ATEN_CPU_CAPABILITY set (the README's demo section has the sets measured)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def machine_line() -> str:
    m = machine_fields()
    return (
        f"torch {m['torch']}, CPU capability {m['cpu_capability']}: the figures depend on the CPU's kernels "
        "(they repeat on this machine; another CPU may print others: the README's demo section)"
    )


def opd_config(assets: Path, seed: int = 0, steps: int = 200, quick: bool = False, **change) -> TrainConfig:
    """The demo's OPD run from the models in ``assets`` (``change`` on top: the objective, the output)."""
    settings = dict(
        student=str(assets / "student"),
        teacher=str(assets / "teacher"),
        task="arithmetic",
        task_level=TASK_LEVEL,
        seed=seed,
        steps=10 if quick else steps,
        batch_size=16 if quick else 64,
        lr=5e-4,
        warmup_steps=10,
        max_new_tokens=MAX_NEW_TOKENS,
        eval_every=0 if quick else 50,
        eval_size=64 if quick else EVAL_SIZE,
        eval_samples=EVAL_SAMPLES,
        ckpt_every=50,
        top_p=TOP_P,
        k=32,
    )
    return TrainConfig.from_flat(**{**settings, **change})


def run_objectives(base: TrainConfig, objectives, out: Path, console: Console, workers: int = 1) -> dict:
    """``opd train`` from the same student, seeds and settings once per objective (each name in
    ``objectives``, or name -> config changes), into ``out/<name>``; the final evaluation of each
    (a multi-task run: the mean over its tasks, and each task's under ``tasks``).

    ``workers`` > 1 trains that many objectives at once, each in its own process with its share of
    the CPU threads: for small models, where one process cannot keep several cores busy (the
    agentic demo's steps are mostly the game engine, which is single-threaded Python)."""
    changes = objectives if isinstance(objectives, dict) else {name: {"objective": name} for name in objectives}
    cfgs = {
        # each objective's own masking default: mask_special unset, resolved again
        name: base.replace(**{"mask_special": None, **change, "out": str(out / name)})
        for name, change in changes.items()
    }
    for cfg in cfgs.values():
        shutil.rmtree(cfg.run.out, ignore_errors=True)  # a demo run always starts from the packaged student
    if workers > 1 and len(cfgs) > 1:
        finals = _train_side_by_side(cfgs, workers, console)
    else:
        finals = {}
        for name, cfg in cfgs.items():
            console.print(f"[bold]OPD: {name}[/bold] ({cfg.optimizer.steps} steps) -> {cfg.run.out}")
            finals[name] = _train_timed(cfg, show_progress=True)
    results = {}
    for name, (final, wall_s) in finals.items():
        cfg = cfgs[name]
        results[name] = {
            "final_acc": final.get("eval/accuracy"),
            "avg_at_k": final.get("eval/avg_at_k"),
            "steps": cfg.optimizer.steps,
            "wall_s": wall_s,
        }
        if cfg.multitask.tasks is not None:
            names = [t["name"] for t in cfg.multitask.tasks]
            results[name]["tasks"] = {
                n: {"final_acc": r.get("eval/accuracy"), "avg_at_k": r.get("eval/avg_at_k")}
                for n, r in split_by_task(final, names).items()
            }
    return results


def _train_timed(cfg: TrainConfig, show_progress: bool = False) -> tuple[dict, float]:
    from opd.training.loop import train

    t0 = time.time()
    final = train(cfg, show_progress=show_progress)
    return final, round(time.time() - t0, 1)


def _train_side_by_side(cfgs: dict[str, TrainConfig], workers: int, console: Console) -> dict:
    """Train the configs in ``workers`` processes at once; one progress bar per run, read from
    its metrics.jsonl (the runs themselves are silent)."""
    threads = threads_per_worker(workers)
    console.print(f"[bold]OPD: {', '.join(cfgs)}[/bold] side by side ({workers} processes, {threads} thread(s) each)")
    with (
        process_pool(workers) as pool,
        Progress(
            TextColumn("[bold]OPD {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        ) as bars,
    ):
        jobs = {name: pool.submit(with_threads, threads, _train_timed, cfg) for name, cfg in cfgs.items()}
        ids = {name: bars.add_task(name, total=cfg.optimizer.steps) for name, cfg in cfgs.items()}
        while not all(job.done() for job in jobs.values()):
            for name, cfg in cfgs.items():
                bars.update(ids[name], completed=_steps_done(Path(cfg.run.out)))
            time.sleep(2)
        finals = {name: job.result() for name, job in jobs.items()}  # a run's error is raised here
        for name, cfg in cfgs.items():
            bars.update(ids[name], completed=cfg.optimizer.steps)
    return finals


def _steps_done(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum('"time/step"' in line for line in lines)


def summary_table(summary: dict, title: str = "", metric: str = "greedy acc", labels: dict | None = None) -> Table:
    k = summary["k"]
    table = Table(
        title=title
        or f"opd demo: greedy accuracy and avg@{k} (temperature 1, top-p {TOP_P}) on {summary['eval_size']} test prompts"
    )
    for col in ("model", metric, f"avg@{k}", "steps", "wall s"):
        table.add_column(col, justify="left" if col == "model" else "right")
    fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    table.add_row("teacher", fmt(summary["teacher_acc"]), fmt(summary["teacher_avg_at_k"]), "-", "-")
    table.add_row(
        "student (before OPD)", fmt(summary["student_init_acc"]), fmt(summary["student_init_avg_at_k"]), "-", "-"
    )
    labels = labels or {"sampled": "student + sampled-token OPD", "lsm": "student + LSM (teacher top-K)"}
    for name, r in summary["objectives"].items():
        label = labels.get(name, name)
        table.add_row(label, fmt(r["final_acc"]), fmt(r["avg_at_k"]), str(r["steps"]), f"{r['wall_s']:.0f}")
    return table
