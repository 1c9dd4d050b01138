"""Evaluating a model on a task: greedy accuracy, avg@k and pass@k (``opd eval``).

Generation goes through the same rollout engine as training (:class:`opd.rollout.HFRollout`),
grading through :func:`opd.grading.grade`, and the estimators are those of
:mod:`opd.evaluation`. Seeds are per prompt and sample, so a figure is reproducible.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from opd.config import EvalConfig
from opd.data import PromptSet, load_task
from opd.evaluation import avg_at_k, gap_recovery, mean_pass_at_k
from opd.grading import grade
from opd.models import load_model, load_tokenizer, resolve_device
from opd.progress import progress_bar
from opd.rollout import HFRollout


def decode_responses(tokenizer, response_ids_NT, response_mask_NT) -> list[str]:
    return [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(response_ids_NT, response_mask_NT)
    ]


def evaluate_model(model, tokenizer, prompts: PromptSet, *, max_new_tokens: int, samples: int = 0,
                   temperature: float = 1.0, top_p: float = 1.0, batch_size: int = 128, seed: int = 0,
                   show_progress: bool = False) -> dict:
    """Greedy accuracy over ``prompts``; with ``samples`` > 0 also avg@k and pass@k (k = samples)."""
    engine = HFRollout(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    n = len(prompts)
    greedy_ok: list[bool] = []
    sampled_ok: list[list[bool]] = [[] for _ in range(n)]
    greedy_jobs = [(i, -1) for i in range(n)]
    sampled_jobs = [(i, s) for s in range(samples) for i in range(n)]
    with progress_bar("evaluating", total=len(greedy_jobs) + len(sampled_jobs), enabled=show_progress) as bar:
        for jobs, greedy in ((greedy_jobs, True), (sampled_jobs, False)):
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start:start + batch_size]
                batch = engine.generate(
                    [prompts.prompt_ids[i] for i, _ in chunk], [seed * 7919 + i * 131 + s for i, s in chunk],
                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy,
                )
                texts = decode_responses(tokenizer, batch.response_ids_NT, batch.response_mask_NT)
                for (i, s), text in zip(chunk, texts):
                    ok = grade(text, prompts.examples[i].answer)
                    (greedy_ok.append(ok) if greedy else sampled_ok[i].append(ok))
                bar.advance(len(chunk))
    result = {"accuracy": sum(greedy_ok) / n, "n": n}
    if samples > 0:
        result.update({"avg_at_k": avg_at_k(sampled_ok), "pass_at_k": mean_pass_at_k(sampled_ok, samples), "k": samples})
    return result


def run_eval(cfg: EvalConfig) -> dict:
    tok = load_tokenizer(cfg.student)
    model = load_model(cfg.student, dtype=cfg.dtype, device=resolve_device(cfg.device))
    task = load_task(cfg.task, cfg.task_level, cfg.seed)
    prompts = PromptSet.build(task.examples("test")[: cfg.eval_size], tok, cfg.max_prompt_tokens, "test prompts")
    t0 = time.time()
    result = evaluate_model(model, tok, prompts, max_new_tokens=cfg.max_new_tokens, samples=cfg.samples,
                            temperature=cfg.temperature, top_p=cfg.top_p, batch_size=cfg.batch_size,
                            seed=cfg.seed, show_progress=True)
    result["wall_s"] = round(time.time() - t0, 2)
    if cfg.acc_before >= 0 and cfg.acc_teacher >= 0:
        result["gap_recovery"] = gap_recovery(cfg.acc_before, result["accuracy"], cfg.acc_teacher)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result
