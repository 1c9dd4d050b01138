"""On-policy distillation: the training loop (``opd train``).

Each step reads top to bottom:

    prompts -> rollout (student samples, top-p) -> score (teacher top-K and log-probs)
            -> update (objective loss, AdamW, clipping) -> log (metrics.jsonl, rollouts.jsonl)
            -> eval / checkpoint

The rollout and score stages are the run's rollout producer's (:mod:`opd.training.producer`): on-policy,
the step's rollouts generated here with the weights it starts from; with ``--max-staleness S``, those a
worker made with the weights of step t - S while the trainer worked. Either way the loop takes the step's
scored parts from it and updates; after the update the rollout engine is told the weights changed (an
engine with weights of its own syncs them as its next rollout begins).

Departures from the paper (arXiv:2603.25562) worth knowing: the loss is reduced as a token mean
over the whole rollout batch (micro-batches add up to exactly that); the diagnostics that need
the student's full distribution are computed on a random sample of ``diag_positions`` response
positions per step, without gradients. Sampling is seeded per prompt, so a resumed run repeats
the uninterrupted one step for step.

Under ``torchrun``/``accelerate launch`` each rank takes its shard of the step's global batch
(``--batch-size`` prompts per rank) and the student is wrapped with DDP, or FSDP with ``--fsdp``
(see :mod:`opd.training.distributed`); the loss is normalised by the global batch's counts, so N ranks of
batch b follow the trajectory of one process of batch N*b. With ``--lora-r`` only a LoRA adapter
is trained (:mod:`opd.models.lora`).

Multi-task runs (``tasks:`` in the config, :mod:`opd.training.schedule`) give every task its own teacher,
prompts or games and settings. A step holds one part per task it trains on: one part in a
single-task run or an alternating step, every task's part in ``--task-mode mix``. Each part is
rolled out and scored by its own task's teacher; the update runs the micro-batches of all parts
into one optimizer step, with the loss normalised by the counts of all parts together (a token
mean over all tasks' loss tokens; see :func:`global_totals`). Metrics are logged for the whole
step and, prefixed with the task's name, for each part.

A served teacher that stays down past ``--teacher-wait`` (or a rollout engine that cannot be brought back)
stops the run at the step being made, after checkpointing the last completed step: ``--resume`` redoes
the step cut short and loses nothing.

Run: ``opd train --student DIR --teacher DIR --objective lsm --k 32 --out runs/x``.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import ExitStack
from typing import NoReturn, cast

import torch

from opd import metrics as M
from opd.config import TrainConfig, config_record
from opd.errors import UserError
from opd.losses import Head
from opd.models.head import model_head
from opd.models.precision import precision_record, saved_dtype
from opd.rollout.engine import RolloutBatch, RolloutEngine
from opd.runs.card import run_card, write_card
from opd.runs.progress import progress_bar
from opd.runs.rundir import save_final_model
from opd.teachers.scoring import TeacherScorer, TeacherScores
from opd.training.distributed import merge_metrics, shutdown
from opd.training.evaluating import eval_stage
from opd.training.keeping import best_rule, best_weights, checkpoint_score, final_evaluation, write_summary
from opd.training.loss import LossTotals, objective_loss, policy_logprobs, reads_policy_logprobs, reduce_loss
from opd.training.microbatch import MicroBatch, in_row_order, over_budget, pad_to, split_rows
from opd.training.optim import rng_state
from opd.training.producer import Producer, ServiceDown, StepPart, make_producer
from opd.training.resuming import global_batches
from opd.training.schedule import prefixed
from opd.training.setup import Run, setup
from opd.training.stepstats import StepUpdate, metric_weights, rollout_records, step_metrics

# ----------------------------------------------------------------------------- stages


def global_totals(run: Run, masks: list[torch.Tensor], horizons: list[int]) -> LossTotals:
    """The loss normalisers of the step's global batch (all ranks, and all tasks' parts in mix mode),
    so every rank's and every part's share adds up to it. ``horizons``: each part's max_new_tokens
    (constant_sum divides by the sum over parts of rollouts x horizon)."""
    tokens, seqs, rollouts, budget = run.dist.all_sum(
        [
            sum(float(m.sum()) for m in masks),
            sum(float((m.sum(-1) > 0).sum()) for m in masks),
            sum(float(m.shape[0]) for m in masks),
            sum(float(m.shape[0] * h) for m, h in zip(masks, horizons, strict=True)),
        ]
    )
    return LossTotals(
        int(tokens), int(seqs), int(rollouts), run.cfg.rollout.max_new_tokens, run.dist.world, int(budget)
    )


def _objective(student, run: Run, teacher: TeacherScorer, *args):
    return objective_loss(run.cfg, student, teacher, *args)


def micro_batches_of(run: Run, parts: list[StepPart]) -> list[MicroBatch]:
    """The step's micro-batches on this rank (:mod:`opd.training.microbatch`), padded to the busiest rank's count."""
    lengths = [p.batch.attention_mask_NL.sum(-1).cpu() for p in parts]  # prompt and response tokens per row
    note = over_budget(lengths, run.cfg.optimizer.micro_batch_tokens)
    if note and "budget" not in run.said:
        run.said.add("budget")
        if run.dist.is_main:
            print(f"opd train: note: {note}", file=sys.stderr, flush=True)
    micro = split_rows(lengths, run.cfg.optimizer.grad_accum, run.cfg.optimizer.micro_batch_tokens)
    return pad_to(micro, max(run.dist.gather(len(micro)))) if run.dist.active else micro


def micro_inputs(p: StepPart, m: MicroBatch) -> tuple[RolloutBatch, TeacherScores, torch.Tensor, torch.Tensor | None]:
    """The micro-batch's rollouts, scores, loss mask and student top-K ids (a padding one's narrowed)."""
    rows = m.rows
    batch, scores, mask_NT = p.batch.select(rows), p.scores.select(rows), p.mask_NT[rows]
    ids = None if p.student_ids is None else p.student_ids[rows]
    if m.width:
        batch, scores, mask_NT = batch.narrow(m.width), scores.narrow(m.width), mask_NT[:, : m.width]
        ids = None if ids is None else ids[:, : m.width]
    return batch, scores, mask_NT, ids


def micro_step(run: Run, parts: list[StepPart], m: MicroBatch, totals: LossTotals, old, now, last: bool):
    """One micro-batch's forward and backward: its per-token loss, hidden states and share of the step's loss
    (gradients reduced across ranks only after the ``last``; a padding micro-batch's loss counts zero)."""
    p = parts[m.part]
    batch, scores, mask_NT, ids = micro_inputs(p, m)
    with run.dist.sync_gradients(last):
        args = (batch, scores, mask_NT, ids, old, now)
        loss_NT, h = run.dist.train_call(_objective, run, p.task.teacher, *args)
        loss = reduce_loss(run.cfg.objective.reduction, loss_NT, mask_NT, totals) * float(m.counted)
        loss.backward()
    return loss_NT.detach(), h.detach(), float(loss.detach())


def update_stage(run: Run, step: int, parts: list[StepPart]) -> list[StepUpdate]:
    """Objective loss over the micro-batches of every part, clipping, optimizer step(s); each part's
    by-products of the first update (the loss, gradient norm and lr are the step's, shared).

    With ``--updates-per-batch`` > 1 the later updates reuse the batch: the sampled-token loss
    corrects with importance ratios, the analytic losses (lsm, full_kl) need none but see states
    an older policy visited. Only the first update's loss is logged (the on-policy one).
    """
    cfg = run.cfg
    totals = global_totals(run, [p.mask_NT for p in parts], [p.task.cfg.rollout.max_new_tokens for p in parts])
    micro = micro_batches_of(run, parts)
    scale = task_lr_scale(run, parts)
    policy = policy_logprobs_of(run, parts, micro)
    first: list[StepUpdate] = []
    for update in range(cfg.optimizer.updates_per_batch):
        run.optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        kept: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in parts]  # rows, loss, h
        for j, m in enumerate(micro):
            now = None if policy is None else policy[j]  # stale rollouts: the trainer's, before the first update
            old = None
            if cfg.optimizer.updates_per_batch > 1:  # the later updates' importance ratios start from these
                old = micro_inputs(parts[m.part], m)[0].logprobs_NT if now is None else now
            loss_NT, h, value = micro_step(run, parts, m, totals, old, now, last=j == len(micro) - 1)
            loss_value += value
            if update == 0 and m.counted:
                kept[m.part].append((m.rows, loss_NT, h))
        loss_value = run.dist.all_sum([loss_value])[0] / run.dist.world  # see reduce_loss
        norm_t = torch.nn.utils.clip_grad_norm_(
            run.dist.module.parameters(), cfg.optimizer.max_grad_norm or float("inf")
        )
        norm = float(norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t)  # FSDP: a DTensor
        check_finite(run, step, loss=loss_value, gradient_norm=norm)
        for group in run.optimizer.param_groups:  # the scheduler's next step resets it from the base lr
            group["lr"] *= scale
        run.optimizer.step()
        run.scheduler.step()
        if update == 0:
            clipped = bool(cfg.optimizer.max_grad_norm and norm > cfg.optimizer.max_grad_norm)
            first = [
                _first_update(p, k, loss_value, norm, clipped, cfg.run.log_rollouts)
                for p, k in zip(parts, kept, strict=True)
            ]
    for u in first:
        u.lr = cast(float, run.scheduler.get_last_lr()[0]) * scale  # our schedules' lrs are floats
    for engine in engines(run):  # one with weights of its own syncs them as its next rollout begins
        engine.weights_changed()
    return first


def engines(run: Run) -> list[RolloutEngine]:
    """The run's rollout engines, each once (its tasks share one)."""
    return list({id(t.engine): t.engine for t in run.tasks}.values())


def policy_logprobs_of(run: Run, parts: list[StepPart], micro: list[MicroBatch]) -> list[torch.Tensor] | None:
    """Per micro-batch, the trainer's log-probs of the sampled tokens before the step's first update,
    when a policy-gradient objective's rollouts come from an older policy (--max-staleness); else None."""
    if not reads_policy_logprobs(run.cfg):
        return None
    return [run.dist.full_call(lambda s, m=m: policy_logprobs(s, micro_inputs(parts[m.part], m)[0])) for m in micro]


def task_lr_scale(run: Run, parts: list[StepPart]) -> float:
    """The step's task lr over the run's (1 but for an alternate-mode step whose task sets its own lr)."""
    return parts[0].task.cfg.optimizer.lr / run.cfg.optimizer.lr if len(parts) == 1 else 1.0


def _first_update(p: StepPart, kept: list, loss: float, norm: float, clipped: bool, log_rollouts: int):
    """The part's by-products of the first update, its micro-batches' rows put back in row order."""
    rows = [r for r, _, _ in kept]
    loss_NT, h_all = (in_row_order([k[i] for k in kept], rows) for i in (1, 2))
    return StepUpdate(
        loss=loss,
        grad_norm=norm,
        clipped=clipped,
        lr=0.0,
        loss_NT=loss_NT,
        diag_hidden_MD=h_all.reshape(-1, h_all.shape[-1])[p.diag_M],
        log_hidden_LTD=h_all[:log_rollouts],
    )


def check_finite(run: Run, step: int, **values: float) -> None:
    """Stop before a non-finite loss or gradient reaches the weights; the last checkpoint stays."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise UserError(
                f"the {name.replace('_', ' ')} became {value} at step {step}; training stopped before the update "
                f"and the last good checkpoint in {run.rundir.ckpt_root} is kept. Lower --lr, raise "
                "--warmup-steps, or check the teacher's outputs"
            )


STEP_KEYS = ("train/loss", "train/grad_norm", "train/clipped", "train/lr")  # the step's, never a part's


def part_metrics(run: Run, step: int, p: StepPart, upd: StepUpdate, W: Head) -> tuple[dict, dict, list]:
    """One rank's metrics of one part, what each is a mean over, and (rank 0) its sample rollouts."""
    cfg, c = run.cfg, p.task.cfg
    mask_NT, scores = p.mask_NT, p.scores
    examples = [p.task.source.examples[i] for i in p.rows]
    texts, correct, episodes = p.task.source.grade(run.tokenizer, examples, p.batch, p.records)
    horizon = c.rollout.max_new_tokens
    format_ids = [i for i in run.special_ids if i != run.tokenizer.eos_token_id]
    stats = step_metrics(
        p.batch, correct, scores, upd, mask_NT, W, k=cfg.objective.k, horizon=horizon, format_ids=format_ids
    )
    metrics = {**stats, **p.score_metrics, **episodes}
    weights = metric_weights(p.batch, mask_NT, upd.diag_hidden_MD.shape[0], horizon, correct)
    if p.task.name:  # a task's own loss: the token mean of its per-token loss (the step's loss is global)
        metrics["train/loss"] = M.masked_mean(upd.loss_NT, mask_NT)
        weights["train/loss"] = int(mask_NT.sum())
    if not (cfg.run.log_rollouts and run.dist.is_main):
        return metrics, weights, []
    records = rollout_records(
        run.tokenizer, W, step, p.batch, examples, texts, correct, scores, upd, mask_NT, p.records
    )
    return metrics, weights, [{"task": p.task.name, **r} if p.task.name else r for r in records]


def log_stage(run: Run, step: int, parts: list[StepPart], upds: list[StepUpdate], timings: dict) -> dict:
    """Metrics of the whole step batch (ranks' and parts' records merged), each task's under its
    name in a multi-task run, and rank 0's sample rollouts."""

    def local(student):
        W = model_head(student).detach()
        return [part_metrics(run, step, p, u, W) for p, u in zip(parts, upds, strict=True)]

    mine = run.dist.full_call(local)
    ranks = run.dist.gather([(m, w) for m, w, _ in mine])  # [rank][part] -> (metrics, weights)
    ranks_timings = run.dist.gather(timings)  # a rank may lack one (its worker died: nothing scored ahead)
    slowest = {
        k: max(t[k] for t in ranks_timings if k in t) for k in dict.fromkeys(k for t in ranks_timings for k in t)
    }
    every = [mw for rank in ranks for mw in rank]
    record = {"step": step, **merge_metrics([m for m, _ in every], [w for _, w in every]), **slowest}
    record.update({k: getattr(upds[0], k.split("/")[1]) for k in STEP_KEYS})
    for i, p in enumerate(parts):
        if p.task.name:
            own = merge_metrics([r[i][0] for r in ranks], [r[i][1] for r in ranks])
            record.update(prefixed({k: v for k, v in own.items() if k not in STEP_KEYS[1:]}, p.task.name))
    run.rundir.log_metrics(record)
    rollouts = [r for _, _, recs in mine for r in recs]
    if rollouts:
        run.rundir.log_rollouts(rollouts)
    return record


def checkpoint_stage(
    run: Run, producer: Producer, step: int, rng: dict | None = None, score: float | None = None
) -> None:
    """Rank 0 writes; every rank takes part in gathering sharded weights, per-rank RNG states and the
    rollouts in flight (``producer``'s) (``rng``: this rank's, when not the generators' state now).
    ``score``: the --keep-best figure of this step's evaluation; the keep rules prune the others
    (opd.training.keeping)."""
    rngs = run.dist.gather(rng_state(run.dist.device) if rng is None else rng)
    state = {
        "step": step,
        "optimizer": run.dist.optimizer_state(run.optimizer),
        "scheduler": run.scheduler.state_dict(),
        "rng": rngs if run.dist.active else rngs[0],
        "fsdp": run.dist.fsdp,
        "batch": global_batches(run.tasks, run.dist.world),  # kept by a resume on another number of processes
        "precision": precision_record(run.cfg.model.dtype, bool(run.cfg.lora.lora_r)),
        "config": config_record(run.cfg),
        "max_staleness": run.cfg.rollout.max_staleness,
        **producer.in_flight(step),  # every rank's rollouts asked for with the weights this checkpoint has seen
    }
    weights = run.dist.full_state_dict(run.student)
    keep, best = run.cfg.run.keep_checkpoints, best_rule(run.cfg)
    run.rundir.save_checkpoint(step, run.student, state, keep, model_state=weights, score=score, best=best)
    run.dist.barrier()


def stop_at(run: Run, producer: Producer, step: int, rng: dict, down: ServiceDown) -> NoReturn:
    """A served teacher (or the rollout engine) stayed unreachable while ``step`` was made (every rank is
    here together: the checkpoint is collective): step - 1 is checkpointed and the run stops. Nothing of
    this step has reached the weights, so --resume redoes it from its rollouts on and loses nothing.
    ``rng``: the generators' state as the step began, which is the one a checkpoint of step - 1 holds."""
    if step > run.start_step and not (run.cfg.run.ckpt_every and step % run.cfg.run.ckpt_every == 0):
        # else the loop wrote it, or the run resumed from it (or none ran)
        checkpoint_stage(run, producer, step - 1, rng)
    then = (
        f"checkpoint of step {step - 1} written in {run.rundir.ckpt_root}; resume with --resume"
        if step
        else "no step had finished, so nothing was checkpointed; run the same command"
    )
    raise down.kind(f"{down.why}; {then} once {down.service} is up") from None


# ----------------------------------------------------------------------------- loop


def train_steps(run: Run, producer: Producer, show_progress: bool) -> dict:
    """The steps from ``run.start_step`` on; the last evaluation's record."""
    cfg = run.cfg
    last_eval: dict = {}
    with (
        run.rundir,
        progress_bar(f"OPD {cfg.objective.objective}", total=cfg.optimizer.steps, enabled=show_progress) as bar,
    ):
        bar.advance(run.start_step)
        for step in range(run.start_step, cfg.optimizer.steps):
            t0, rng = time.perf_counter(), rng_state(run.dist.device)
            try:  # rollout -> score
                parts, timings = producer.take(step)
            except ServiceDown as down:
                stop_at(run, producer, step, rng, down)
            t1 = time.perf_counter()
            upds = update_stage(run, step, parts)  # loss -> update
            t2 = time.perf_counter()
            timings.update({"time/update": t2 - t1, "time/step": t2 - t0})
            record = log_stage(run, step, parts, upds, timings)
            # the step's scores hold the teacher's logits at the diagnostic positions (positions x V float32):
            # not kept through the next step's rollout and scoring
            del parts, upds
            bar.advance(1)
            acc = record.get("rollout/accuracy")  # absent where no rollout had a reference answer
            bar.describe(f"loss {record['train/loss']:.4f}" + ("" if acc is None else f"  acc {acc:.2f}"))
            last = step == cfg.optimizer.steps - 1
            evaluated = last or bool(cfg.eval.eval_every and (step + 1) % cfg.eval.eval_every == 0)
            if evaluated:
                last_eval = eval_stage(run, step)
            # --keep-best: every evaluation is a scored checkpoint
            if (
                last
                or (cfg.run.ckpt_every and (step + 1) % cfg.run.ckpt_every == 0)
                or (cfg.run.keep_best and evaluated)
            ):
                checkpoint_stage(run, producer, step, score=checkpoint_score(cfg, last_eval) if evaluated else None)
    return last_eval


def train(cfg: TrainConfig, show_progress: bool = True) -> dict:
    """Train; returns the last evaluation's record (a multi-task run: each task's under eval/<name>/)."""
    run = setup(cfg)
    cfg = run.cfg  # a resume on another number of processes rescales --batch-size (opd.training.resuming)
    with ExitStack() as closing:  # each closed even where one before it raises; last registered, first closed
        for engine in engines(run):  # a vLLM server
            closing.callback(engine.close)
        for t in run.tasks:  # an environment's worker processes
            closing.callback(t.source.close)
            if t.test is not None:
                closing.callback(t.test.close)
        producer = make_producer(run)
        closing.callback(producer.close)  # the rollout worker and the scoring thread
        last_eval = train_steps(run, producer, show_progress)
    weights = run.dist.full_state_dict(run.student)  # every rank: gathering sharded weights is collective
    best = best_weights(cfg, run.rundir) if run.rundir.enabled else None  # --final-best
    save_final_model(
        run.rundir.path / "final",
        run.student,
        run.tokenizer,
        run.rundir.enabled,
        model_state=weights if best is None else best,
        dtype=saved_dtype(cfg.model.dtype, bool(cfg.lora.lora_r)),
    )
    write_summary(cfg, run.rundir, cfg.optimizer.steps, last_eval)
    if run.rundir.enabled:
        card_eval = final_evaluation(cfg, run.rundir, last_eval)  # --final-best: the best step's figures
        write_card(run.rundir.path / "final", run_card(cfg, run.rundir.path.name, card_eval))
    shutdown(run.dist)
    return last_eval
