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

Under ``torchrun``/``accelerate launch`` each rank takes its shard of the step's global batch
(``--batch-size`` prompts per rank) and the student is wrapped with DDP, or FSDP with ``--fsdp``
(see :mod:`opd.distributed`); the loss is normalised by the global batch's counts, so N ranks of
batch b follow the trajectory of one process of batch N*b. With ``--lora-r`` only a LoRA adapter
is trained (:mod:`opd.lora`).

Run: ``opd train --student DIR --teacher DIR --objective lsm --k 32 --out runs/x``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from opd.agentic import (
    GameSet,
    check_episode_context,
    episode_metrics,
    episode_outcomes,
    evaluate_agent,
    make_env,
    write_eval_games,
)
from opd.config import TrainConfig
from opd.data import PromptSet, load_tasks, sample_seed
from opd.distributed import Dist, init_distributed, merge_metrics, shutdown
from opd.episodes import EpisodeRecord, EpisodeRollout
from opd.errors import UserError
from opd.evaluation import evaluate_model
from opd.lora import apply_lora, load_weights
from opd.models import disable_dropout, head_weight, load_model, load_tokenizer, resolve_device
from opd.objectives import (
    NEEDS_STUDENT_TOPK,
    LossTotals,
    loss_mask,
    objective_loss,
    reduce_loss,
    scored_loss_mask,
    student_topk_ids,
)
from opd.optim import make_optimizer, make_scheduler, rng_state, set_rng_state
from opd.progress import progress_bar
from opd.rollout import HFRollout, RolloutBatch
from opd.rundir import RunDir, save_final_model
from opd.stepstats import StepUpdate, grade_rollouts, metric_weights, rollout_records, step_metrics
from opd.tasks import Task
from opd.teacher import TeacherScorer, TeacherScores, make_teacher


@dataclass
class Run:
    """Everything the loop's stages share; built once by :func:`setup`."""

    cfg: TrainConfig
    student: torch.nn.Module  # a transformers causal LM, or peft's wrapper of one (--lora-r)
    teacher: TeacherScorer
    tokenizer: PreTrainedTokenizerBase
    engine: HFRollout | EpisodeRollout  # single-turn prompts, or an environment's episodes (--env)
    task: Task | None  # None with --env: an episode's reward is the game's
    prompts: PromptSet | GameSet
    test: PromptSet | GameSet
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rundir: RunDir
    special_ids: list[int]
    dist: Dist = field(default_factory=Dist)  # ranks, and the student as DDP/FSDP wrap it (dist.model)
    start_step: int = 0
    eval_task: Task | None = None  # grades the test set (--eval-task); None: the training task


# ----------------------------------------------------------------------------- setup


def setup(cfg: TrainConfig) -> Run:
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    dist = init_distributed(cfg.fsdp, device)
    rundir = RunDir(cfg.out, report_to=cfg.report_to)
    rundir.require_fresh(cfg.resume)
    task, eval_task = (None, None) if cfg.env else load_tasks(cfg)  # before the models: a data problem shows at once
    tok = load_tokenizer(cfg.student, "student")
    student = load_model(cfg.student, "student", cfg.dtype, device)
    teacher = make_teacher(cfg, student, tok)
    V = head_weight(student).shape[0]
    if cfg.k > V:
        raise UserError(f"k={cfg.k} is larger than the vocabulary ({V} tokens); choose --k <= {V}")
    if cfg.env:
        check_episode_context(student, cfg.max_prompt_tokens, cfg.max_new_tokens)
    prompts, test = prompt_sets(cfg, tok, task, eval_task)
    special_ids = special_token_ids(tok, cfg.special_tokens)
    if not cfg.keep_dropout:  # before LoRA, so --lora-dropout still applies to the adapter
        disable_dropout(student)
    if cfg.lora_r:
        student = apply_lora(student, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout, cfg.student)
    ckpt = rundir.latest_checkpoint() if cfg.resume else None
    if ckpt is not None:
        load_weights(student, ckpt / "model")  # before wrapping: FSDP shards the weights it is given
    student.train()
    optimizer = make_optimizer(dist.wrap(student), cfg.lr, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.steps * cfg.updates_per_batch, cfg.schedule)
    run = Run(
        cfg,
        student,
        teacher,
        tok,
        EpisodeRollout(student, tok) if cfg.env else HFRollout(student, tok.eos_token_id, tok.pad_token_id),
        task,
        prompts,
        test,
        optimizer,
        scheduler,
        rundir,
        special_ids,
        dist,
        eval_task=eval_task,
    )
    if ckpt is not None:
        resume(run, ckpt)
    elif cfg.resume:  # killed before its first checkpoint: it starts over, so must its logs
        rundir.truncate_logs_after(-1)
    rundir.write_config(cfg)
    if not isinstance(test, GameSet):  # an environment's games are written once played (eval_stage)
        rundir.write_jsonl("eval.jsonl", [{"prompt": e.prompt, "answer": e.answer} for e in test.examples])
    return run


def prompt_sets(cfg: TrainConfig, tok, task, eval_task) -> tuple[PromptSet | GameSet, PromptSet | GameSet]:
    """The training and test prompts, or (with --env) the environment's training and held-out games."""
    if cfg.env:
        env = make_env(cfg.env, cfg.env_level, cfg.env_args)
        return GameSet.build(env, "train"), GameSet.build(env, "test", cfg.eval_size)
    prompts = PromptSet.build(task.examples("train"), tok, cfg.max_prompt_tokens, "training prompts")
    test = PromptSet.build(eval_task.examples("test")[: cfg.eval_size], tok, cfg.max_prompt_tokens, "test prompts")
    return prompts, test


def special_token_ids(tok, tokens: list[str]) -> list[int]:
    ids = []
    for t in tokens:
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id:
            raise UserError(f"special token {t!r} is not in the student's vocabulary; fix --special-tokens")
        ids.append(tid)
    return ids


def resume(run: Run, ckpt: Path) -> None:
    """Optimizer, schedule, RNG and step from ``ckpt`` (the weights were loaded before wrapping)."""
    state = run.rundir.load_state(ckpt)
    if state.get("fsdp", False) != run.dist.fsdp:  # the two keep the optimizer state in different layouts
        was = "with" if state.get("fsdp") else "without"
        raise UserError(f"checkpoint {ckpt} was written {was} --fsdp; resume {was} --fsdp as well")
    saved_world = len(state["rng"]) if isinstance(state["rng"], list) else 1
    if saved_world != run.dist.world:  # the global batch, and so each step's prompts, would change
        raise UserError(
            f"checkpoint {ckpt} was written by {saved_world} process(es), this launch has "
            f"{run.dist.world}; resume with the same number of processes"
        )
    run.dist.load_optimizer_state(run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], run.dist.rank, run.dist.world, run.dist.device)
    run.start_step = state["step"] + 1
    run.rundir.truncate_logs_after(state["step"])


# ----------------------------------------------------------------------------- stages


def rollout_stage(run: Run, step: int) -> tuple[RolloutBatch, list[int], list[EpisodeRecord] | None]:
    """This rank's rollouts: its contiguous block of the step's global batch, seeded by global slot;
    with --env, episodes of the step's games and what happened in each."""
    cfg = run.cfg
    idx = run.prompts.batch_indices(step, cfg.batch_size * run.dist.world, cfg.seed)
    global_rows = [i for i in idx for _ in range(cfg.samples_per_prompt)]
    slots = run.dist.shard(list(range(len(global_rows))))
    rows = [global_rows[s] for s in slots]
    seeds = [sample_seed(cfg.seed, step, s) for s in slots]
    if isinstance(run.prompts, GameSet):
        played = run.dist.full_call(
            lambda _: run.engine.play(
                run.prompts.env,
                [run.prompts.games[i] for i in rows],
                seeds,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                **cfg.episode_limits(),
            )
        )
        return played.batch, rows, played.records
    batch = run.dist.full_call(
        lambda _: run.engine.generate(
            [run.prompts.prompt_ids[i] for i in rows],
            seeds,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
        )
    )
    return batch, rows, None


def diag_index(mask_NT: torch.Tensor, n: int, step: int, seed: int) -> torch.Tensor:
    """A seeded sample of flat response positions for the full-vocabulary diagnostics."""
    flat = mask_NT.reshape(-1).nonzero().squeeze(-1)
    if flat.numel() <= n:
        return flat
    g = torch.Generator().manual_seed(seed * 31 + step)
    pick = torch.randperm(flat.numel(), generator=g, device="cpu")[:n].to(flat.device)
    return flat[pick].sort().values


def score_stage(run: Run, batch: RolloutBatch, diag_M: torch.Tensor):
    cfg = run.cfg
    needs_student = cfg.objective == "lsm" and cfg.support in NEEDS_STUDENT_TOPK
    student_ids = run.dist.full_call(lambda s: student_topk_ids(s, batch, cfg.k)) if needs_student else None
    scores = run.teacher.score(batch, cfg.k, query_ids_NTQ=student_ids, diag_index_M=diag_M)
    return scores, student_ids


def global_totals(run: Run, mask_NT: torch.Tensor) -> LossTotals:
    """The loss normalisers of the global batch (all ranks), so every rank's share adds up to it."""
    tokens, seqs, rollouts = run.dist.all_sum(
        [float(mask_NT.sum()), float((mask_NT.sum(-1) > 0).sum()), float(mask_NT.shape[0])]
    )
    return LossTotals(int(tokens), int(seqs), int(rollouts), run.cfg.max_new_tokens, run.dist.world)


def _objective(student, run: Run, *args):
    return objective_loss(run.cfg, student, run.teacher, *args)


def update_stage(
    run: Run, step: int, batch: RolloutBatch, scores: TeacherScores, student_ids, mask_NT, diag_M
) -> StepUpdate:
    """Objective loss over micro-batches, clipping, optimizer step(s); the first update's by-products.

    With ``--updates-per-batch`` > 1 the later updates reuse the batch: the sampled-token loss
    corrects with importance ratios, the analytic losses (lsm, full_kl) need none but see states
    an older policy visited. Only the first update's loss is logged (the on-policy one).
    """
    cfg = run.cfg
    N = mask_NT.shape[0]
    totals = global_totals(run, mask_NT)
    mb = N // cfg.grad_accum
    first: StepUpdate | None = None
    for update in range(cfg.updates_per_batch):
        run.optimizer.zero_grad(set_to_none=True)
        loss_value, loss_rows, hidden_rows = 0.0, [], []
        for start in range(0, N, mb):
            rows = slice(start, start + mb)
            old = batch.logprobs_NT[rows] if cfg.updates_per_batch > 1 else None
            ids_rows = None if student_ids is None else student_ids[rows]
            with run.dist.sync_gradients(start + mb >= N):  # reduce across ranks once, after the last micro-batch
                loss_NT, h = run.dist.train_call(
                    _objective, run, batch.select(rows), scores.select(rows), mask_NT[rows], ids_rows, old
                )
                loss = reduce_loss(cfg.reduction, loss_NT, mask_NT[rows], totals)
                loss.backward()
            loss_value += float(loss.detach())
            if update == 0:
                loss_rows.append(loss_NT.detach())
                hidden_rows.append(h.detach())
        loss_value = run.dist.all_sum([loss_value])[0] / run.dist.world  # see reduce_loss
        norm = torch.nn.utils.clip_grad_norm_(run.dist.model.parameters(), cfg.max_grad_norm or float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
        check_finite(run, step, loss=loss_value, gradient_norm=norm)
        run.optimizer.step()
        run.scheduler.step()
        if first is None:
            h_all = torch.cat(hidden_rows)
            first = StepUpdate(
                loss=loss_value,
                grad_norm=norm,
                clipped=bool(cfg.max_grad_norm and norm > cfg.max_grad_norm),
                lr=0.0,
                loss_NT=torch.cat(loss_rows),
                diag_hidden_MD=h_all.reshape(-1, h_all.shape[-1])[diag_M],
                log_hidden_LTD=h_all[: cfg.log_rollouts],
            )
    first.lr = run.scheduler.get_last_lr()[0]
    return first


def check_finite(run: Run, step: int, **values: float) -> None:
    """Stop before a non-finite loss or gradient reaches the weights; the last checkpoint stays."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise UserError(
                f"the {name.replace('_', ' ')} became {value} at step {step}; training stopped before the update "
                f"and the last good checkpoint in {run.rundir.ckpt_root} is kept. Lower --lr, raise "
                "--warmup-steps, or check the teacher's outputs"
            )


def log_stage(
    run: Run,
    step: int,
    rows: list[int],
    batch: RolloutBatch,
    scores: TeacherScores,
    upd: StepUpdate,
    mask_NT: torch.Tensor,
    timings: dict,
    records: list[EpisodeRecord] | None = None,
) -> dict:
    """Metrics of the whole batch (ranks' records merged) and rank 0's sample rollouts."""
    cfg = run.cfg
    examples = [run.prompts.examples[i] for i in rows]
    if records is None:
        texts, correct = grade_rollouts(run.tokenizer, run.task, examples, batch)
        episodes = {}
    else:
        texts, correct = episode_outcomes(records)
        episodes = episode_metrics(records)

    def local(student):
        W = head_weight(student).detach()
        metrics = {
            **step_metrics(batch, correct, scores, upd, mask_NT, W, k=cfg.k, horizon=cfg.max_new_tokens),
            **episodes,
            **timings,
        }
        if not (cfg.log_rollouts and run.dist.is_main):
            return metrics, []
        return metrics, rollout_records(
            run.tokenizer, W, step, batch, examples, texts, correct, scores, upd, mask_NT, records
        )

    metrics, rollouts = run.dist.full_call(local)
    weights = metric_weights(batch, mask_NT, upd.diag_hidden_MD.shape[0], cfg.max_new_tokens)
    record = {"step": step, **merge_metrics(run.dist.gather(metrics), run.dist.gather(weights))}
    run.rundir.log_metrics(record)
    if rollouts:
        run.rundir.log_rollouts(rollouts)
    return record


def eval_stage(run: Run, step: int) -> dict:
    """Rank 0 evaluates (with FSDP, on weights all ranks gathered); the others wait for it."""
    cfg = run.cfg
    common = dict(samples=cfg.eval_samples, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)

    def evaluate(student):
        if isinstance(run.test, GameSet):
            return evaluate_agent(student, run.tokenizer, run.test, **cfg.episode_limits(), **common)
        task = run.eval_task or run.task
        return evaluate_model(student, run.tokenizer, run.test, task, max_new_tokens=cfg.max_new_tokens, **common)

    res = run.dist.full_call(lambda s: evaluate(s) if run.dist.is_main else None)
    run.student.train()
    if res is None:
        return {}
    # Generated games have their files once opened, so they are kept after the first evaluation (once).
    if isinstance(run.test, GameSet) and not (run.rundir.path / "eval.jsonl").is_file():
        run.rundir.write_jsonl("eval.jsonl", write_eval_games(run.rundir.path, run.test))
    record = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
    run.rundir.log_metrics(record)
    return record


def checkpoint_stage(run: Run, step: int) -> None:
    """Rank 0 writes; every rank takes part in gathering sharded weights and per-rank RNG states."""
    rng = run.dist.gather(rng_state(run.dist.device))
    state = {
        "step": step,
        "optimizer": run.dist.optimizer_state(run.optimizer),
        "scheduler": run.scheduler.state_dict(),
        "rng": rng if run.dist.active else rng[0],
        "fsdp": run.dist.fsdp,
        "config": dataclasses.asdict(run.cfg),
    }
    run.rundir.save_checkpoint(step, run.student, state, model_state=run.dist.full_state_dict(run.student))
    run.dist.barrier()


# ----------------------------------------------------------------------------- loop


def train(cfg: TrainConfig, show_progress: bool = True) -> dict:
    run = setup(cfg)
    last_eval: dict = {}
    with run.rundir, progress_bar(f"OPD {cfg.objective}", total=cfg.steps, enabled=show_progress) as bar:
        bar.advance(run.start_step)
        for step in range(run.start_step, cfg.steps):
            t0 = time.perf_counter()
            batch, rows, records = rollout_stage(run, step)
            t1 = time.perf_counter()
            mask_NT = loss_mask(batch, run.special_ids, cfg.mask_special)
            diag_M = diag_index(mask_NT, cfg.diag_positions, step, cfg.seed)
            scores, student_ids = score_stage(run, batch, diag_M)
            mask_NT = scored_loss_mask(mask_NT, scores)  # a cross-tokenizer teacher leaves unaligned positions out
            t2 = time.perf_counter()
            upd = update_stage(run, step, batch, scores, student_ids, mask_NT, diag_M)
            t3 = time.perf_counter()
            timings = {"time/generate": t1 - t0, "time/score": t2 - t1, "time/update": t3 - t2, "time/step": t3 - t0}
            record = log_stage(run, step, rows, batch, scores, upd, mask_NT, timings, records)
            bar.advance(1)
            bar.describe(f"loss {record['train/loss']:.4f}  acc {record['rollout/accuracy']:.2f}")
            last = step == cfg.steps - 1
            if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                last_eval = eval_stage(run, step)
            if last or (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0):
                checkpoint_stage(run, step)
    save_final_model(
        run.rundir.path / "final",
        run.student,
        run.tokenizer,
        run.rundir.enabled,
        model_state=run.dist.full_state_dict(run.student),
    )
    shutdown(run.dist)
    return last_eval
