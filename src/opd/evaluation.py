"""Evaluation: running a model on a task (``opd eval``) and the estimators behind its figures.

Usage::

    from opd.evaluation import pass_at_k, avg_at_k, gap_recovery
    pass_at_k(n=16, c=4, k=8)                     # P(at least one of 8 draws is correct)
    avg_at_k([[True, False], [True, True]])       # 0.75
    gap_recovery(acc_before=0.2, acc_after=0.5, acc_teacher=0.8)   # 0.5

``pass_at_k`` is the unbiased estimator of Chen et al. (2021): with ``n`` samples of which
``c`` are correct, the chance that ``k`` drawn without replacement include a correct one.

:func:`evaluate_model` generates through the same rollout engine as training
(:class:`opd.rollout.HFRollout`) and grades with the task's own reward, as training does. Seeds
are per prompt and sample, so a figure is reproducible.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

from opd.config import EvalConfig
from opd.data import PromptSet, data_options, load_task
from opd.models import load_model, load_tokenizer, resolve_device
from opd.progress import progress_bar
from opd.rollout import HFRollout
from opd.tasks import Task

__all__ = ["pass_at_k", "mean_pass_at_k", "avg_at_k", "gap_recovery", "decode_responses", "evaluate_model", "run_eval"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: ``1 - C(n-c, k) / C(n, k)`` for n samples, c correct, 1 <= k <= n."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}: draw more samples")
    # Exact integer binomials: the float product form drifts for large n.
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct_matrix: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; row i holds the correctness of prompt i's samples."""
    _check_matrix(correct_matrix)
    return sum(pass_at_k(len(row), sum(map(bool, row)), k) for row in correct_matrix) / len(correct_matrix)


def avg_at_k(correct_matrix: Sequence[Sequence[bool]]) -> float:
    """Mean accuracy over the k samples of each prompt, then over prompts.

    Rows may have different lengths; each prompt weighs the same whatever its sample count.
    """
    _check_matrix(correct_matrix)
    return sum(sum(map(bool, row)) / len(row) for row in correct_matrix) / len(correct_matrix)


def gap_recovery(acc_before: float, acc_after: float, acc_teacher: float) -> float:
    """Fraction of the student-teacher gap closed: ``(after - before) / (teacher - before)``.

    1.0 means the student reached the teacher, 0.0 no change, negative a regression, and
    values above 1.0 a student that passed its teacher. When the teacher is no better than the
    starting student (``teacher == before``) there is no gap to recover and the ratio is
    undefined: returns ``float('nan')`` instead of raising, so a sweep keeps running.
    """
    gap = acc_teacher - acc_before
    if gap == 0:
        return float("nan")
    return (acc_after - acc_before) / gap


def _check_matrix(correct_matrix: Sequence[Sequence[bool]]) -> None:
    if len(correct_matrix) == 0:
        raise ValueError("need at least one prompt's results, got an empty list")
    for i, row in enumerate(correct_matrix):
        if len(row) == 0:
            raise ValueError(f"prompt {i} has no samples: every prompt needs k >= 1 results")


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
) -> dict:
    """Greedy accuracy over ``prompts``; with ``samples`` > 0 also avg@k and pass@k (k = samples).

    A response counts as correct when ``task.reward`` gives it 1, the same test as training's.
    """
    engine = HFRollout(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    n = len(prompts)
    greedy_ok: list[bool] = []
    sampled_ok: list[list[bool]] = [[] for _ in range(n)]
    greedy_jobs = [(i, -1) for i in range(n)]
    sampled_jobs = [(i, s) for s in range(samples) for i in range(n)]
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
                    (greedy_ok.append(ok) if greedy else sampled_ok[i].append(ok))
                bar.advance(len(chunk))
    result = {"accuracy": sum(greedy_ok) / n, "n": n}
    if samples > 0:
        result.update(
            {"avg_at_k": avg_at_k(sampled_ok), "pass_at_k": mean_pass_at_k(sampled_ok, samples), "k": samples}
        )
    return result


def run_eval(cfg: EvalConfig) -> dict:
    # Data named for evaluation is evaluated whole, as --eval-task is (its test split, or every row
    # of a one-split set); --split instead picks the held-out part, as training holds it out.
    if not cfg.env:  # before the model: a data problem shows at once
        options = data_options(cfg)
        task = load_task(cfg.task, cfg.task_level, cfg.seed, split=cfg.split, evaluation=not cfg.split, **options)
    tok = load_tokenizer(cfg.tokenizer or cfg.student)
    model = load_model(cfg.student, dtype=cfg.dtype, device=resolve_device(cfg.device))
    common = dict(
        samples=cfg.samples,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        show_progress=True,
    )
    t0 = time.time()
    if cfg.env:  # the held-out games of an environment: success rate (opd.agentic)
        from opd.agentic import GameSet, check_episode_context, evaluate_agent, make_env

        check_episode_context(model, cfg.max_prompt_tokens, cfg.max_new_tokens)
        games = GameSet.build(make_env(cfg.env, cfg.env_level, cfg.env_args), "test", cfg.eval_size)
        result = evaluate_agent(model, tok, games, **cfg.episode_limits(), **common)
    else:
        prompts = PromptSet.build(task.examples("test")[: cfg.eval_size], tok, cfg.max_prompt_tokens, "test prompts")
        result = evaluate_model(model, tok, prompts, task, max_new_tokens=cfg.max_new_tokens, **common)
    result["wall_s"] = round(time.time() - t0, 2)
    if cfg.acc_before >= 0 and cfg.acc_teacher >= 0:
        result["gap_recovery"] = gap_recovery(cfg.acc_before, result["accuracy"], cfg.acc_teacher)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result
