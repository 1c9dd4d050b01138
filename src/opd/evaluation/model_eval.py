"""Evaluation: running a model on a task or on an environment's held-out games (``opd eval``).

The estimators behind its figures (``pass_at_k``, ``avg_at_k``, ``gap_recovery``) live in
:mod:`opd.evaluation.estimators` and are importable from here too.

:func:`evaluate_model` generates through the same rollout engine as training
(:class:`opd.rollout.sampling.HFRollout`) and grades with the task's own reward, as training does. Seeds
are per prompt and sample, so a figure is reproducible.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from opd.chat import set_chat_options
from opd.config import EvalConfig
from opd.errors import UserError
from opd.evaluation.estimators import avg_at_k, gap_recovery, mean_pass_at_k
from opd.evaluation.game_eval import evaluate_agent
from opd.evaluation.sharing import ALONE, Share
from opd.models.loading import load_model, load_tokenizer, resolve_device
from opd.models.precision import configure_device_math
from opd.rollout.game_set import GameSet, check_episode_context, play_env
from opd.rollout.prompt_set import PromptSet, answer_source, data_options, eval_prompts, graded, load_task
from opd.rollout.sampling import HFRollout
from opd.runs.progress import progress_bar
from opd.runs.rundir import RunDir
from opd.tasks import Task

__all__ = ["decode_responses", "evaluate_model", "run_eval"]


# ----------------------------------------------------------------------------- running a model


def decode_responses(tokenizer, response_ids_NT, response_mask_NT) -> list[str]:
    return [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(response_ids_NT, response_mask_NT)
    ]


def evaluate_model(
    model,
    tokenizer,
    prompts: PromptSet,
    task: Task,
    *,
    max_new_tokens: int,
    samples: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 128,
    seed: int = 0,
    show_progress: bool = False,
    share: Share = ALONE,
) -> dict:
    """Greedy accuracy over ``prompts``; with ``samples`` > 0 also avg@k and pass@k (k = samples).

    A response counts as correct when ``task.reward`` gives it 1, the same test as training's. ``share``:
    this process's part when several evaluate together (:mod:`opd.evaluation.sharing`); every one of them
    returns the figures of all the prompts.
    """
    engine = HFRollout(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    mine = share.items(len(prompts))
    greedy_ok: dict[int, bool] = {}
    sampled_ok: dict[int, list[bool]] = {i: [] for i in mine}
    greedy_jobs = [(i, -1) for i in mine]
    sampled_jobs = [(i, s) for s in range(samples) for i in mine]
    with progress_bar("evaluating", total=len(greedy_jobs) + len(sampled_jobs), enabled=show_progress) as bar:
        for jobs, greedy in ((greedy_jobs, True), (sampled_jobs, False)):
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start : start + batch_size]
                batch = engine.generate(
                    [prompts.prompt_ids[i] for i, _ in chunk],
                    [seed * 7919 + i * 131 + s for i, s in chunk],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    greedy=greedy,
                )
                texts = decode_responses(tokenizer, batch.response_ids_NT, batch.response_mask_NT)
                for (i, _), text in zip(chunk, texts, strict=True):
                    ok = task.reward(text, prompts.examples[i]) == 1.0
                    if greedy:
                        greedy_ok[i] = ok
                    else:
                        sampled_ok[i].append(ok)
                bar.advance(len(chunk))
    outcomes = share.merged(len(prompts), [(greedy_ok[i], sampled_ok[i]) for i in mine])
    return prompt_figures(outcomes, samples)


def prompt_figures(outcomes: list[tuple[bool, list[bool]]], samples: int) -> dict:
    """Accuracy (and avg@k, pass@k) of each prompt's outcome: (greedy answer correct, each sample's)."""
    n = len(outcomes)
    result = {"accuracy": sum(ok for ok, _ in outcomes) / n, "n": n}
    if samples > 0:
        sampled = [oks for _, oks in outcomes]
        result.update({"avg_at_k": avg_at_k(sampled), "pass_at_k": mean_pass_at_k(sampled, samples), "k": samples})
    return result


def check_graded(cfg: EvalConfig, task: Task) -> None:
    """``opd eval`` grades answers: data without any is an error, and one with some is graded on those (said so)."""
    held_out = task.examples("test")
    n = len(graded(held_out))
    if not n:
        raise UserError(
            f"--task {cfg.task} has no reference answers to grade against (looked for {answer_source(task)}); "
            "opd eval measures accuracy: give data with answers (--answer-field names its column)"
        )
    if n < len(held_out):
        print(
            f"opd eval: note: grading the {n} of {len(held_out)} prompts that have a reference answer", file=sys.stderr
        )


def run_eval(cfg: EvalConfig) -> dict:
    # Where the figures go is checked (and claimed) first: a folder that cannot take them would lose a whole evaluation.
    rundir = RunDir(cfg.out, command="eval", models={"student": cfg.student, "tokenizer": cfg.tokenizer})
    # Data named for evaluation is evaluated whole, as --eval-task is (its test split, or every row
    # of a one-split set); --split instead picks the held-out part, as training holds it out.
    if not cfg.env:  # before the model: a data problem shows at once
        options = data_options(cfg)
        task = load_task(cfg.task, cfg.task_level, cfg.seed, split=cfg.split, evaluation=not cfg.split, **options)
        check_graded(cfg, task)
    rev = cfg.student_revision
    tok = set_chat_options(
        load_tokenizer(cfg.tokenizer or cfg.student, revision="" if cfg.tokenizer else rev),
        cfg.chat_template_kwargs,
        check=cfg.check_chat_template_kwargs,
    )
    device = resolve_device(cfg.device)
    configure_device_math(device, cfg.dtype, cfg.tf32, "opd eval")
    model = load_model(cfg.student, dtype=cfg.dtype, device=device, revision=rev)
    common: dict[str, Any] = dict(
        samples=cfg.samples,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        show_progress=True,
    )
    t0 = time.time()
    if cfg.env:  # the held-out games of an environment: success rate (opd.evaluation.game_eval)
        check_episode_context(model, cfg.max_prompt_tokens, cfg.max_new_tokens)
        env = play_env(cfg)
        try:
            result = evaluate_agent(
                model, tok, GameSet.build(env, "test", cfg.eval_size), **cfg.episode_limits(), **common
            )
        finally:
            getattr(env, "close", lambda: None)()
    else:
        prompts = PromptSet.build(eval_prompts(task, cfg.eval_size), tok, cfg.max_prompt_tokens, "test prompts")
        result = evaluate_model(model, tok, prompts, task, max_new_tokens=cfg.max_new_tokens, **common)
    result["wall_s"] = round(time.time() - t0, 2)
    if cfg.acc_before >= 0 and cfg.acc_teacher >= 0:
        result["gap_recovery"] = gap_recovery(cfg.acc_before, result["accuracy"], cfg.acc_teacher)
    rundir.write_json("eval.json", result)
    print(json.dumps(result, indent=2))
    return result
