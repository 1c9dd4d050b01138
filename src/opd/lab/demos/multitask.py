"""The multi-task demo (``opd demo --multitask``): one student learns math and ALFWorld games, each from its own teacher.

The seed paper's headline setting at CPU scale: one student, two tasks, a teacher for each, and
training steps that alternate between them (math, game, math, game, ...; :mod:`opd.training.schedule`).
The math teacher is the arithmetic demo's recipe (:func:`opd.lab.demos.demo.teacher_sft_config`: a 4-layer
Qwen2 on every training solution) made on the agentic demo's tokenizer, which was trained on both
kinds of text; the game teacher is the agentic demo's (:mod:`opd.lab.demos.agentic`). Each teacher is
a specialist that never saw the other task. The student (2 layers, 128 wide) knows a little of
both: one mixed behaviour-cloning run (``opd sft`` with two tasks, :mod:`opd.training.sft`) on the
arithmetic demo student's 1,000 math solutions and the agentic demo student's 100 games' expert
episodes, to its plateau.

The demo evaluates each teacher on its task and the student on both, then runs, from the same
student and seeds, one two-task config per objective, side by side: sampled-token OPD and teacher
top-K LSM with the tail bucket (``tail=True``: the student's mass outside the teacher's top-K is no
longer free; it closes the math format's leak into game actions). Math and game steps alternate 1:1
for 200 steps, math at lr 3e-4, the game at its own 1e-4 (``GAME_LR``): the recipe chosen on
generated validation games (issue 45; ``benchmarks/probe_multitask_game.py``). It writes
``summary.json``, a table of math accuracy and game success before and after, and the report (its
charts split by task). ``opd make-demo-models --multitask --out DIR`` makes the models
(:func:`make_multitask_models`); ``opd experiment multitask-game`` runs the demo over seeds.

Cost, measured on a 2-core machine:

* the demo: 12.0 minutes in all on an otherwise idle machine (the three models' evaluations, two
  processes, 1.6 minutes; then the two objectives side by side, one process and one thread each: a run of 200
  steps, 100 math steps of 64 prompts and 100 game steps of 16 episodes, with its final evaluation
  of both tasks, about 10 minutes; then the report);
* the recipe: the math teacher's 1,200 SFT steps of 64 solutions about 2.4 s each (51 minutes on
  one thread with the other core busy; the arithmetic demo's teacher, the same recipe on a 2,048
  token vocabulary, took 32 minutes on two cores); the student's mixed steps (32 solutions and 16
  episodes) about 1.1 s, evaluated (300 prompts, 50 games) every 100 steps until four in a row
  bring no gain: 1,100 steps, 21 minutes on one thread (best at step 699: 21% math accuracy, 24%
  game success). The two models do not depend on each other, so ``--only teacher`` and ``--only
  student`` may run side by side (one thread each: about 50 minutes, the teacher's).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from opd.config import SFTConfig, TrainConfig, resolve_tasks
from opd.errors import UserError
from opd.lab.demos import agentic as demo_agentic
from opd.lab.demos import demo
from opd.lab.demos.demo import run_objectives, teacher_sft_config, train_models
from opd.lab.demos.parallel import demo_workers, process_pool, threads_per_worker, with_threads
from opd.models.loading import load_model, load_tokenizer, resolve_device
from opd.report import PNG_DIR, write_report
from opd.rollout.prompt_set import load_task
from opd.rollout.registry import local_engine
from opd.training.schedule import task_schedule
from opd.training.sources import eval_plan, held_out

ASSETS = Path(__file__).parents[2] / "assets" / "multitask"
MATH, GAME = "math", "alfworld"  # the task names: metric prefixes (math/train/loss, eval/alfworld/success_rate)
# Math solutions the student learns from (of 20,000; the math teacher learns from all): as many as
# the arithmetic demo's student, which reaches about half the teacher's accuracy. With 300 this
# student knew 6% of its math, too little for any objective to move it in 64 OPD steps.
STUDENT_MATH = demo.STUDENT_TRAIN_SIZE
STUDENT_GAMES = demo_agentic.STUDENT_GAMES  # expert episodes it clones (of 400; the game teacher learns from all)
MATH_EVAL, GAME_EVAL = 300, 50  # held-out prompts and games
# What the demo runs, side by side in about 10 minutes: the comparison its aim reads (issue 45), LSM
# with the tail against sampled-token OPD. LSM without the tail and with the student's top-K would
# cost a second round; they are arms of `opd experiment multitask` and `multitask-tail`.
OBJECTIVES: dict[str, dict[str, Any]] = {
    "sampled": {"objective": "sampled"},
    "lsm-tail": {"objective": "lsm", "tail": True},
}
LABELS = {
    "sampled": "student + sampled-token OPD",
    "lsm-tail": "student + LSM (teacher top-K) + tail",
}
# Math steps at the run's lr, game steps at their own, lower one. The game is fragile at this size:
# from this student, game-only OPD at 3e-4 (the agentic demo's rate) lost every game win under LSM
# with student top-K and under full-vocabulary KL (probe, one seed), and two-task LSM with the tail
# kept the student's 24% with both tasks at 1e-4 but ended at 0% at 3e-4 (seed 0; 28% with seed 1);
# with both at 1e-4, though, sampled-token OPD gained math too (27%, against LSM's 33%), so the math
# gap the demo shows needs 3e-4.
LR, GAME_LR = 3e-4, 1e-4
# The recipe chosen on validation games (issue 45; benchmarks/probe_multitask_game.py, data in
# docs/results/probes/multitask-game.json): the game gains with the number of its steps at 1e-4, and
# 32 game steps (the earlier 96 steps at two math steps per game step) were all inside its dip.
STEPS = 200  # OPD steps per objective: 100 math steps of 64 prompts, 100 game steps of 16 games
MATH_SHARE = 1  # math steps per game step
MODELS = ("math_teacher", "student")  # what the recipe makes; the game teacher is the agentic demo's


def game_teacher(assets: Path) -> Path:
    """The game teacher of a models directory: the packaged models use the packaged agentic demo's
    teacher (its 17 MB kept once in the package); any other directory holds its own copy in
    ``game_teacher/`` (the recipe puts it there), so that it stands on its own."""
    if Path(assets).resolve() == ASSETS.resolve():
        return demo_agentic.ASSETS / "teacher"
    return Path(assets) / "game_teacher"


def _math_task(quick: bool, **extra) -> dict:
    return dict(
        name=MATH,
        task="arithmetic",
        task_level=demo.TASK_LEVEL,
        max_new_tokens=demo.MAX_NEW_TOKENS,
        eval_size=16 if quick else MATH_EVAL,
        **extra,
    )


def _game_task(quick: bool, **extra) -> dict:
    return dict(
        name=GAME,
        env=demo_agentic.ENV,
        env_level=demo_agentic.LEVEL,
        env_args=demo_agentic.env_args(quick),
        eval_size=4 if quick else GAME_EVAL,
        **demo_agentic.LIMITS,
        **extra,
    )


def student_sft_config(out: Path, tokenizer: str, quick: bool = False, seed: int = 0) -> SFTConfig:
    """The student's recipe: one new STUDENT_ARCH model, mixed behaviour cloning on the first
    STUDENT_MATH math solutions and the first STUDENT_GAMES games' expert episodes (every step holds
    a batch of each), at a constant rate until the mean of its math accuracy and game success stops
    improving."""
    return SFTConfig.from_flat(
        arch=demo_agentic.STUDENT_ARCH,
        out=str(out),
        tokenizer=tokenizer,
        validation_size=0,  # the packaged model was chosen on the test set (made before --validation-size)
        seed=seed,
        **demo_agentic.to_plateau(quick),
        task_mode="mix",
        tasks=[
            _math_task(quick, train_size=8 if quick else STUDENT_MATH, batch_size=8 if quick else 32),
            _game_task(quick, train_size=8 if quick else STUDENT_GAMES, batch_size=4 if quick else 16),
        ],
    )


def make_multitask_models(
    out: Path, quick: bool = False, seed: int = 0, only: str = "", agentic: Path | None = None
) -> dict:
    """Make the multi-task demo's math teacher and student in ``out`` (``only``: ``teacher`` or ``student``).

    ``agentic``: the agentic demo's models (``tokenizer/``, ``teacher/``; default: the packaged
    ones), whose tokenizer both new models use and whose game teacher the demo uses. That teacher
    is copied to ``out/game_teacher``, except into the packaged directory, whose demo refers to
    the packaged agentic teacher (:func:`game_teacher`).
    """
    if only not in ("", "teacher", "student"):
        raise UserError(f"--only {only!r}: use teacher (the math teacher) or student (or leave it empty for both)")
    out, agentic = Path(out), Path(agentic) if agentic else demo_agentic.ASSETS
    for part in ("tokenizer", "teacher"):
        if not (agentic / part).is_dir():
            raise UserError(
                f"the multi-task models build on the agentic demo's {part}, missing in {agentic / part}; "
                f"run `opd make-demo-models --agentic --out {agentic}` first"
            )
    out.mkdir(parents=True, exist_ok=True)
    if game_teacher(out) != demo_agentic.ASSETS / "teacher":
        shutil.rmtree(game_teacher(out), ignore_errors=True)
        shutil.copytree(agentic / "teacher", game_teacher(out))
    tokenizer = str(agentic / "tokenizer")
    plans = {
        "math_teacher": teacher_sft_config(out / "runs" / "math_teacher", tokenizer, quick, seed),
        "student": student_sft_config(out / "runs" / "student", tokenizer, quick, seed),
    }
    return train_models(out, plans, {"teacher": "math_teacher"}.get(only, only))


# ----------------------------------------------------------------------------- the demo


def task_entries(
    assets: Path, quick: bool, game_lr: float = GAME_LR, math_share: float = MATH_SHARE
) -> dict[str, dict]:
    """The demo's two OPD tasks as task-list entries, by name: each its teacher, share of the steps,
    batch, evaluation and (the game) its own learning rate."""
    return {
        MATH: _math_task(
            quick,
            share=math_share,
            teacher=str(assets / "math_teacher"),
            batch_size=8 if quick else 64,
            eval_samples=2 if quick else demo.EVAL_SAMPLES,
        ),
        GAME: _game_task(
            quick,
            teacher=str(game_teacher(assets)),
            batch_size=4 if quick else 16,
            eval_samples=demo_agentic.EVAL_SAMPLES,
            lr=game_lr,
        ),
    }


def task_steps(steps: int, name: str, seed: int = 0, math_share: float = MATH_SHARE) -> int:
    """How many of ``steps`` alternating steps train on task ``name``: a single-task run of the same budget."""
    index = (MATH, GAME).index(name)
    return sum(t == index for t, _ in task_schedule(steps, [math_share, 1], seed))


def opd_config(
    assets: Path,
    out: Path,
    steps: int,
    quick: bool,
    seed: int = 0,
    only: tuple[str, ...] = (MATH, GAME),
    lr: float = LR,
    game_lr: float = GAME_LR,
    math_share: float = MATH_SHARE,
    **change,
) -> TrainConfig:
    """One OPD run from the demo's student on its two tasks (``only``: a subset), math and game steps
    alternating (``math_share`` math steps per game step, at ``lr`` and ``game_lr``), each task scored
    by its own teacher and evaluated at the end; ``change``: the objective and its support."""
    entries = task_entries(assets, quick, game_lr, math_share)
    return TrainConfig.from_flat(
        student=str(assets / "student"),
        seed=seed,
        out=str(out),
        steps=steps,
        lr=lr,
        warmup_steps=2 if quick else 10,
        eval_every=0,  # at the end only: an evaluation of both tasks costs about as much as 8 game steps
        ckpt_every=2 if quick else max(steps // 2, 1),
        log_rollouts=2 if quick else 4,
        top_p=demo.TOP_P,
        k=32,
        task_mode="alternate",
        tasks=[entries[name] for name in only],
        **change,
    )


def held_out_sets(base: TrainConfig, tok) -> dict:
    """Each task's held-out prompts or games (those training evaluates) and its resolved config."""
    sets = {}
    for spec in resolve_tasks(base):
        c = spec.cfg
        grader = None if c.env.env else load_task("arithmetic", c.data.task_level, c.run.seed)
        sets[spec.name] = (held_out(c, tok, grader), c)
    return sets


def evaluate(model_dir: Path, tok, sets: dict, names: tuple[str, ...], seed: int, show_progress: bool = True) -> dict:
    """Greedy accuracy (a game: success rate) and avg@k of one model on each task of ``names``,
    as training's own evaluation measures them."""
    model = load_model(model_dir, "model", device=resolve_device("auto"))
    out = {}
    for name in names:
        test, c = sets[name]
        res = test.evaluate(local_engine(model, tok), tok, c, eval_plan(c, seed, show_progress=show_progress)).figures
        out[name] = {"final_acc": res["accuracy"], "avg_at_k": res.get("avg_at_k")}
    return out


def evaluate_models(assets: Path, base: TrainConfig, seed: int, workers: int, console: Console) -> dict:
    """The math teacher on math, the game teacher on the games, the student on both (:func:`evaluate`).
    With ``workers`` > 1 the game teacher plays in one process while the other two run in another:
    a game is mostly single-threaded Python, so one process would leave a core idle."""
    plan = {
        "math_teacher": (assets / "math_teacher", (MATH,)),
        "game_teacher": (game_teacher(assets), (GAME,)),
        "student": (assets / "student", (MATH, GAME)),
    }
    if workers < 2:
        return _evaluate_some(base, plan, seed, True)
    groups = [{"game_teacher": plan["game_teacher"]}, {k: plan[k] for k in ("math_teacher", "student")}]
    with console.status("evaluating the teachers and the student (2 processes)"), process_pool(2) as pool:
        jobs = [pool.submit(with_threads, threads_per_worker(2), _evaluate_some, base, g, seed, False) for g in groups]
        got = {k: v for job in jobs for k, v in job.result().items()}
    return {k: got[k] for k in plan}


def _evaluate_some(base: TrainConfig, plan: dict, seed: int, show_progress: bool) -> dict:
    tok = load_tokenizer(Path(base.model.student))
    sets = held_out_sets(base, tok)
    return {label: evaluate(d, tok, sets, names, seed, show_progress) for label, (d, names) in plan.items()}


def find_models(assets: Path | None, out: Path, quick: bool) -> Path:
    """The demo's models: ``assets`` or the packaged ones; with ``quick`` and none there, the
    shortened recipe's, made in ``out/quick-models``."""
    assets = Path(assets) if assets else ASSETS
    missing = [n for n in MODELS if not (assets / n / "config.json").is_file()]
    teacher = game_teacher(assets)
    if not missing and (teacher / "config.json").is_file():
        return assets
    if quick:
        return make_quick_models(out / "quick-models")
    if missing or teacher.parent == assets:  # the recipe makes the first two and copies the third
        what = ", ".join(missing) or "game_teacher"
        raise UserError(
            f"multi-task demo models missing in {assets} ({what}); run `opd make-demo-models --multitask --out {assets}`"
        )
    raise UserError(
        f"the multi-task demo's game teacher {teacher} is missing; run `opd make-demo-models --agentic --out {teacher.parent}`"
    )


def make_quick_models(root: Path) -> Path:
    """The shortened recipe's models in ``root`` (made once), on the packaged agentic models or,
    without them, on quick ones made in ``root/agentic``: what ``--quick`` runs start from."""
    if not (root / "student" / "config.json").is_file():
        agentic = demo_agentic.ASSETS
        if not (agentic / "teacher" / "config.json").is_file():
            agentic = root / "agentic"
            demo_agentic.make_agentic_models(agentic, quick=True)
        make_multitask_models(root, quick=True, agentic=agentic)
    return root


def run_multitask_demo(
    out: Path, steps: int = 0, quick: bool = False, assets: Path | None = None, seed: int = 0
) -> dict:
    """Evaluate the teachers and the student, run each objective on both tasks, compare."""
    start = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    assets = find_models(assets, out, quick)
    console = Console()
    steps = 4 if quick else steps or STEPS
    base = opd_config(assets, out / "base", steps, quick, seed)
    tok = load_tokenizer(assets / "student")
    sets = held_out_sets(base, tok)
    console.print(
        f"[bold]opd demo --multitask[/bold]: evaluating the teachers and the student on "
        f"{len(sets[MATH][0])} math prompts and {len(sets[GAME][0])} held-out games"
    )
    console.print(demo.machine_line())
    workers = demo_workers()
    models = evaluate_models(assets, base, seed, workers, console)
    t0 = time.time()
    results = run_objectives(base, OBJECTIVES, out, console, workers=workers)
    summary = {
        "tasks": {n: {"eval_size": len(test), "k": c.eval.eval_samples} for n, (test, c) in sets.items()},
        "task_mode": base.multitask.task_mode,
        "models": models,
        "objectives": results,
        "wall_s": round(time.time() - t0, 1),
        **demo.machine_fields(),
    }
    console.print(summary_table(summary))
    report = write_report([out / name for name in results], out / "report")
    summary["total_s"] = round(time.time() - start, 1)  # the whole demo: evaluations, runs and report
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"report: {report}  (open it in a browser; the charts are also PNGs in {report.parent / PNG_DIR})")
    return summary


def summary_table(summary: dict) -> Table:
    """Math accuracy and game success (greedy, avg@k) of every model, before and after each objective."""
    tasks = summary["tasks"]
    table = Table(
        title=f"opd demo --multitask: math ({tasks[MATH]['eval_size']} test prompts) and ALFWorld "
        f"({tasks[GAME]['eval_size']} held-out games), alternating steps; avg@k at top-p {demo.TOP_P}"
    )
    table.add_column("model")
    for col in ("math acc", f"math avg@{tasks[MATH]['k']}", "game success", f"game avg@{tasks[GAME]['k']}"):
        table.add_column(col, justify="right")
    table.add_column("steps", justify="right")
    table.add_column("wall s", justify="right")
    fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"

    def row(label: str, by_task: dict, steps: str = "-", wall: str = "-") -> None:
        cells = [fmt(by_task.get(n, {}).get(k)) for n in (MATH, GAME) for k in ("final_acc", "avg_at_k")]
        table.add_row(label, *cells, steps, wall)

    m = summary["models"]
    row("math teacher", m["math_teacher"])
    row("game teacher", m["game_teacher"])
    row("student (before OPD)", m["student"])
    for name, r in summary["objectives"].items():
        row(LABELS.get(name, name), r["tasks"], str(r["steps"]), f"{r['wall_s']:.0f}")
    return table
