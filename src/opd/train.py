"""On-policy distillation: the training loop (``opd train``).

Each step reads top to bottom:

    prompts -> rollout (student samples, top-p) -> score (teacher top-K and log-probs)
            -> update (objective loss, AdamW, clipping) -> log (metrics.jsonl, rollouts.jsonl)
            -> eval / checkpoint

Departures from the paper (arXiv:2603.25562) worth knowing: the loss is reduced as a token mean
over the whole rollout batch (micro-batches add up to exactly that); the diagnostics that need
the student's full distribution are computed on a random sample of ``diag_positions`` response
positions per step, without gradients. Sampling is seeded per prompt, so a resumed run repeats
the uninterrupted one step for step.

Run: ``opd train --student DIR --teacher DIR --objective lsm --k 32 --out runs/x``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opd.config import TrainConfig
from opd.data import PromptSet, load_task, sample_seed
from opd.errors import UserError
from opd.evaluate import evaluate_model
from opd.models import head_weight, load_model, load_tokenizer
from opd.objectives import NEEDS_STUDENT_TOPK, LossTotals, loss_mask, objective_loss, reduce_loss, student_topk_ids
from opd.optim import make_optimizer, make_scheduler, rng_state, set_rng_state
from opd.progress import progress_bar
from opd.rollout import HFRollout, RolloutBatch
from opd.rundir import RunDir, save_final_model
from opd.stepstats import grade_rollouts, rollout_records, step_metrics
from opd.teacher import TeacherScorer, TeacherScores
from opd.teacher_http import make_teacher


@dataclass
class Run:
    """Everything the loop's stages share; built once by :func:`setup`."""

    cfg: TrainConfig
    student: torch.nn.Module
    teacher: TeacherScorer
    tokenizer: object
    engine: HFRollout
    prompts: PromptSet
    test: PromptSet
    optimizer: torch.optim.Optimizer
    scheduler: object
    rundir: RunDir
    special_ids: list[int]
    task: object
    start_step: int = 0
    history: list[dict] = field(default_factory=list)


# ----------------------------------------------------------------------------- setup


def setup(cfg: TrainConfig) -> Run:
    torch.manual_seed(cfg.seed)
    rundir = RunDir(cfg.out)
    rundir.require_fresh(cfg.resume)
    tok = load_tokenizer(cfg.student, "student")
    student = load_model(cfg.student, "student", cfg.dtype)
    teacher = make_teacher(cfg, student, tok)
    V = head_weight(student).shape[0]
    if cfg.k > V:
        raise UserError(f"k={cfg.k} is larger than the vocabulary ({V} tokens); choose --k <= {V}")
    task = load_task(cfg.task, cfg.task_level, cfg.seed)
    prompts = PromptSet.build(task.examples("train"), tok, cfg.max_prompt_tokens, "training prompts")
    test = PromptSet.build(task.examples("test")[: cfg.eval_size], tok, cfg.max_prompt_tokens, "test prompts")
    special_ids = []
    for t in cfg.special_tokens:
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id:
            raise UserError(f"special token {t!r} is not in the student's vocabulary; fix --special-tokens")
        special_ids.append(tid)
    student.train()
    optimizer = make_optimizer(student, cfg.lr, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.steps * cfg.updates_per_batch, cfg.schedule)
    run = Run(cfg, student, teacher, tok, HFRollout(student, tok.eos_token_id, tok.pad_token_id),
              prompts, test, optimizer, scheduler, rundir, special_ids, task)
    if cfg.resume:
        resume(run)
    rundir.write_config(cfg)
    rundir.write_jsonl("eval.jsonl", [{"prompt": e.prompt, "answer": e.answer} for e in test.examples])
    return run


def resume(run: Run) -> None:
    ckpt = run.rundir.latest_checkpoint()
    if ckpt is None:
        return
    state = run.rundir.load_state(ckpt)
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model" / "model.safetensors"))
    missing, unexpected = run.student.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise UserError(f"checkpoint {ckpt} does not match the student model ({len(missing)} missing, "
                        f"{len(unexpected)} unexpected tensors); resume with the same --student")
    run.student.tie_weights()
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    run.start_step = state["step"] + 1
    run.rundir.truncate_logs_after(state["step"])


# ----------------------------------------------------------------------------- stages


def rollout_stage(run: Run, step: int) -> tuple[RolloutBatch, list[int]]:
    cfg = run.cfg
    idx = run.prompts.batch_indices(step, cfg.batch_size, cfg.seed)
    rows = [i for i in idx for _ in range(cfg.samples_per_prompt)]
    seeds = [sample_seed(cfg.seed, step, slot) for slot in range(len(rows))]
    batch = run.engine.generate([run.prompts.prompt_ids[i] for i in rows], seeds, max_new_tokens=cfg.max_new_tokens,
                                temperature=cfg.temperature, top_p=cfg.top_p)
    return batch, rows


def diag_index(mask_NT: torch.Tensor, n: int, step: int, seed: int) -> torch.Tensor:
    """A seeded sample of flat response positions for the full-vocabulary diagnostics."""
    flat = mask_NT.reshape(-1).nonzero().squeeze(-1)
    if flat.numel() <= n:
        return flat
    g = torch.Generator().manual_seed(seed * 31 + step)
    return flat[torch.randperm(flat.numel(), generator=g)[:n]].sort().values


def score_stage(run: Run, batch: RolloutBatch, diag_M: torch.Tensor):
    cfg = run.cfg
    needs_student = cfg.objective == "lsm" and cfg.support in NEEDS_STUDENT_TOPK
    student_ids = student_topk_ids(run.student, batch, cfg.k) if needs_student else None
    scores = run.teacher.score(batch, cfg.k, query_ids_NTQ=student_ids, diag_index_M=diag_M)
    return scores, student_ids


def update_stage(run: Run, step: int, batch: RolloutBatch, scores: TeacherScores, student_ids, mask_NT, diag_M) -> dict:
    """Objective loss over micro-batches, clipping, optimizer step(s); detached by-products for logging."""
    cfg = run.cfg
    N, T = mask_NT.shape
    totals = LossTotals(int(mask_NT.sum()), int((mask_NT.sum(-1) > 0).sum()), N, T)
    mb = N // cfg.grad_accum
    out = {"loss": 0.0, "grad_norm": 0.0, "clipped": False}
    for update in range(cfg.updates_per_batch):
        run.optimizer.zero_grad(set_to_none=True)
        loss_value, loss_rows, hidden_rows = 0.0, [], []
        for start in range(0, N, mb):
            rows = slice(start, start + mb)
            old = batch.logprobs_NT[rows] if cfg.updates_per_batch > 1 else None
            ids_rows = None if student_ids is None else student_ids[rows]
            loss_NT, h = objective_loss(cfg, run.student, run.teacher, batch.select(rows),
                                        scores.select(rows), mask_NT[rows], ids_rows, old)
            loss = reduce_loss(cfg.reduction, loss_NT, mask_NT[rows], totals)
            loss.backward()
            loss_value += float(loss.detach())
            if update == 0:
                loss_rows.append(loss_NT.detach())
                hidden_rows.append(h.detach())
        if not math.isfinite(loss_value):
            raise UserError(
                f"the loss became {loss_value} at step {step}; training stopped and the last good checkpoint "
                f"in {run.rundir.ckpt_root} is kept. Lower --lr, raise --warmup-steps, or check the teacher's outputs"
            )
        norm = torch.nn.utils.clip_grad_norm_(run.student.parameters(), cfg.max_grad_norm or float("inf"))
        run.optimizer.step()
        run.scheduler.step()
        if update == 0:
            h_all = torch.cat(hidden_rows)
            out.update(loss=loss_value, grad_norm=float(norm), clipped=bool(cfg.max_grad_norm and norm > cfg.max_grad_norm),
                       loss_NT=torch.cat(loss_rows), diag_hidden_MD=h_all.reshape(-1, h_all.shape[-1])[diag_M],
                       log_hidden=h_all[: cfg.log_rollouts])
    out["lr"] = run.scheduler.get_last_lr()[0]
    return out


def log_stage(run: Run, step: int, rows: list[int], batch: RolloutBatch, scores: TeacherScores, upd: dict,
              mask_NT: torch.Tensor, timings: dict) -> dict:
    texts, correct = grade_rollouts(run, batch, rows)
    record = {"step": step, **step_metrics(run, batch, correct, scores, upd, mask_NT), **timings}
    run.rundir.log_metrics(record)
    if run.cfg.log_rollouts:
        run.rundir.log_rollouts(rollout_records(run, step, batch, rows, texts, correct, scores, upd, mask_NT))
    return record


def eval_stage(run: Run, step: int) -> dict:
    cfg = run.cfg
    res = evaluate_model(run.student, run.tokenizer, run.test, max_new_tokens=cfg.max_new_tokens,
                         samples=cfg.eval_samples, temperature=1.0, top_p=cfg.top_p, seed=cfg.seed)
    run.student.train()
    record = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
    run.rundir.log_metrics(record)
    return record


def checkpoint_stage(run: Run, step: int) -> None:
    state = {"step": step, "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
             "rng": rng_state(), "config": run.cfg.__dict__}
    run.rundir.save_checkpoint(step, run.student, state)


# ----------------------------------------------------------------------------- loop


def train(cfg: TrainConfig, show_progress: bool = True) -> dict:
    run = setup(cfg)
    last_eval: dict = {}
    with progress_bar(f"OPD {cfg.objective}", total=cfg.steps, enabled=show_progress) as bar:
        bar.advance(run.start_step)
        for step in range(run.start_step, cfg.steps):
            t0 = time.perf_counter()
            batch, rows = rollout_stage(run, step)
            t1 = time.perf_counter()
            mask_NT = loss_mask(batch, run.special_ids, cfg.mask_special)
            diag_M = diag_index(mask_NT, cfg.diag_positions, step, cfg.seed)
            scores, student_ids = score_stage(run, batch, diag_M)
            t2 = time.perf_counter()
            upd = update_stage(run, step, batch, scores, student_ids, mask_NT, diag_M)
            t3 = time.perf_counter()
            timings = {"time/generate": t1 - t0, "time/score": t2 - t1, "time/update": t3 - t2, "time/step": t3 - t0}
            record = log_stage(run, step, rows, batch, scores, upd, mask_NT, timings)
            bar.advance(1)
            bar.describe(f"loss {record['train/loss']:.4f}  acc {record['rollout/accuracy']:.2f}")
            last = step == cfg.steps - 1
            if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                last_eval = eval_stage(run, step)
            if last or (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0):
                checkpoint_stage(run, step)
    save_final_model(run.rundir.path / "final", run.student, run.tokenizer, run.rundir.enabled)
    return last_eval
