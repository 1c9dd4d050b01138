"""Supervised fine-tuning (``opd sft``): makes the demo's teacher and student, and the off-policy cold start.

Targets are, in order of precedence: completions sampled from ``--teacher`` on the task's prompts
(the off-policy cold start of arXiv:2604.13016: SFT on teacher rollouts before OPD), a JSONL file
(``--data``, lines with ``prompt`` and ``solution`` or ``completion``), or the task's own worked
solutions. The loss is cross-entropy on the completion tokens (prompt and padding masked). The
model with the best greedy test accuracy is kept in ``OUT/final`` (early stopping with
``--patience``), so "trained until it plateaus" is measured, not assumed.

With ``--env NAME`` the targets are the environment's expert episodes (behaviour cloning), in the
episode format the student later plays (:func:`opd.training.cloning.expert_sequences`): the loss is on the
action tokens only, and "accuracy" is the greedy success rate on the held-out games.

With ``tasks:`` (:mod:`opd.training.schedule`'s task list, resolved the same way: each entry sets its own
data or environment, ``train_size``, ``batch_size``, lengths) one model learns several tasks at
once, e.g. a few math solutions and a few expert episodes (the multi-task demo's student). In
``mix`` mode (the default) every step holds every task's batch, each forwarded on its own (no
padding of short solutions to an episode's length) and the loss is the token mean over all their
label tokens together; ``alternate`` trains one task per step, as ``opd train`` does. Each task is
evaluated on its own test set (``eval/<name>/accuracy``); ``eval/accuracy``, which picks the kept
model, is their unweighted mean.

Prompts without reference answers train as well (SFT reads their solutions); a task whose held-out
prompts have none is not evaluated (a note says so), nor is any with ``--no-eval``: the model is then
chosen on the other tasks, or, with none evaluated, the last one is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from opd.chat import set_chat_options
from opd.config import SFTConfig, TaskSpec, resolve_tasks
from opd.config.sources import episode_limits
from opd.errors import UserError
from opd.evaluation.model_eval import decode_responses, evaluate_model
from opd.models.loading import (
    checkpoint_layers,
    load_model,
    load_tokenizer,
    model_device,
    parse_arch,
    resolve_device,
    tiny_qwen2,
)
from opd.models.precision import compute_in, configure_device_math, saved_dtype, trained_weights_dtype
from opd.models.tokenizer import format_prompt
from opd.rollout.engine import RolloutEngine, check_context
from opd.rollout.prompt_set import (
    PromptSet,
    batch_indices,
    data_options,
    eval_prompts,
    graded,
    load_task,
    load_tasks,
    sample_seed,
    say_grading_notes,
)
from opd.rollout.registry import local_engine
from opd.runs.card import sft_card, write_card
from opd.runs.progress import progress_bar
from opd.runs.rundir import RunDir, save_final_model
from opd.tasks import Example
from opd.training.optim import make_optimizer, make_scheduler
from opd.training.schedule import for_task, task_schedule


def load_sft_examples(cfg: SFTConfig) -> list[Example]:
    """``--data``, every row trained on: read as ``--task`` data is (:func:`opd.rollout.prompt_set.load_task`,
    with its checks: the encoding, empty prompts, the columns' types), its targets the ``--solution-field``
    column, or a 'completion' column when the data has no such column."""
    p = Path(cfg.data.data)
    if not p.is_file():
        raise UserError(f"SFT data file {p} does not exist; pass a JSONL file with prompt and solution per line")
    if not p.read_bytes().strip():  # bytes: the reader below names an encoding problem
        raise UserError(
            f'SFT data file {p} has no examples; write one {{"prompt": ..., "solution": ...}} object per line'
        )
    options = data_options(cfg.data)
    task = load_task(str(p), cfg.data.task_level, cfg.run.seed, split="0", **options)
    columns = getattr(task, "columns", [])
    if cfg.data.solution_field not in columns and "completion" in columns:
        task = load_task(
            str(p), cfg.data.task_level, cfg.run.seed, split="0", **{**options, "solution_field": "completion"}
        )
    examples = task.examples("train")
    missing = [i for i, e in enumerate(examples, 1) if not e.solution]
    if missing:
        raise UserError(
            f"{p}: {len(missing)} of {len(examples)} rows have no solution, e.g. row {missing[0]}; give each a "
            f"'{cfg.data.solution_field}' (or 'completion') field"
        )
    return examples


def build_model(cfg: SFTConfig):
    """The model to train (float32 masters, its body computing in --dtype: opd.models.precision) and its tokenizer."""
    device = resolve_device(cfg.model.device)
    configure_device_math(device, cfg.model.dtype, cfg.model.tf32, "opd sft")
    if cfg.model.init:
        model = load_model(
            cfg.model.init, "init", trained_weights_dtype(cfg.model.dtype), device, revision=cfg.model.student_revision
        )
        tok = load_tokenizer(cfg.model.init, "init", revision=cfg.model.student_revision)
    else:
        if not cfg.model.tokenizer:
            raise UserError("a new model (--arch) needs --tokenizer DIR (a tokenizer saved with save_pretrained)")
        tok = load_tokenizer(cfg.model.tokenizer, "tokenizer")
        layers, width = parse_arch(cfg.model.arch)
        torch.manual_seed(cfg.run.seed)
        built = tiny_qwen2(len(tok), layers, width, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method
        model = built.to(device)  # type: ignore[arg-type]
    model = compute_in(model, cfg.model.dtype)
    if cfg.optimizer.gradient_checkpointing:  # as opd train does it, after the body is set to compute in --dtype
        checkpoint_layers(model)
    return model, tok


def encode_pairs(
    tok,
    prompts: Sequence[str | Sequence[dict]],
    completions: list[str],
    systems: list[str | None] | None = None,
    tools: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+completion+EOS ids, attention mask, and labels (-100 off the completion);
    a prompt is a user turn's text or a conversation's messages (``Example.chat()``); ``systems``: each
    text prompt's system turn (None: none); ``tools``: each prompt's tool schemas (None: none)."""
    seqs, labels = [], []
    n = len(prompts)
    for prompt, completion, system, listed in zip(prompts, completions, systems or [None] * n, tools or [None] * n):
        p = tok(format_prompt(tok, prompt, system, listed), add_special_tokens=False)["input_ids"]
        c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + c)
        labels.append([-100] * len(p) + c)
    return pad_right(seqs, labels, tok.pad_token_id)


def pad_right(
    seqs: list[list[int]], labels: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token lists right-padded to one length: (ids, attention mask, labels with -100 on padding)."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long, device="cpu")
    lab = torch.full((len(seqs), L), -100, dtype=torch.long, device="cpu")
    att = torch.zeros((len(seqs), L), dtype=torch.long, device="cpu")
    for i, (s, lab_i) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, : len(s)], lab[i, : len(s)] = torch.tensor(s, device="cpu"), torch.tensor(lab_i, device="cpu")
        att[i, : len(s)] = 1
    return ids, att, lab


def teacher_completions(
    engine: RolloutEngine, tok, prompts: PromptSet, idx: list[int], step: int, cfg: SFTConfig
) -> list[str]:
    batch = engine.generate(
        [prompts.prompt_ids[i] for i in idx],
        [sample_seed(cfg.run.seed, step, j) for j in range(len(idx))],
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
    )
    return decode_responses(tok, batch.response_ids_NT, batch.response_mask_NT)


def held_out_for_validation(items: list, cfg: SFTConfig, what: str) -> tuple[list, list]:
    """The training items less the last ``--validation-size`` of them, and those (never trained on)."""
    n = cfg.eval.validation_size
    if not n:
        return items, []
    if n >= len(items):
        raise UserError(
            f"--validation-size {n} leaves none of the {len(items)} training {what} to train on; lower it "
            "(or 0 to choose the checkpoint on the test set)"
        )
    return items[:-n], items[-n:]


def prompt_source(cfg: SFTConfig, tok, model, task, eval_task) -> tuple[Callable, Callable | None, Callable | None]:
    """The batch of a step (ids, attention mask, labels), and the greedy accuracy on the validation
    prompts (what the checkpoint is chosen on) and on the test prompts, for prompts; no accuracy
    (None) without an evaluation task (--no-eval, or nothing to grade: load_tasks)."""
    if cfg.data.data:
        examples = load_sft_examples(cfg)  # --system-prompt applied by the reader, as for --task
    else:
        examples = task.examples("train")
    examples, validation = held_out_for_validation(examples, cfg, "examples") if eval_task else (examples, [])
    validation = graded(validation)
    if cfg.eval.validation_size and eval_task and not validation:
        raise UserError(
            f"--validation-size {cfg.eval.validation_size} holds out training examples to choose the checkpoint on, and "
            "none of them has a reference answer; pass --validation-size 0 (choose on the test set) or --no-eval"
        )
    if cfg.data.train_size > len(examples):
        raise UserError(
            f"--train-size {cfg.data.train_size} is more than the {len(examples)} training examples; "
            "lower it or pass 0 to use them all"
        )
    examples = examples[: cfg.data.train_size or None]
    if not cfg.teacher.teacher and any(not e.solution for e in examples):
        raise UserError(
            "some training examples have no solution; give --data with solutions or --teacher to sample them"
        )
    train_set = PromptSet.build(examples, tok, cfg.data.max_prompt_tokens, "SFT prompts")
    # as opd train's rollouts are checked: the longest prompt and the token budget must fit the model's positions
    longest = max(len(ids) for ids in train_set.prompt_ids)
    positions = getattr(model.config, "max_position_embeddings", None)
    check_context(longest, cfg.rollout.max_new_tokens, positions, "shorten the prompts or lower --max-new-tokens")
    teacher_engine = None
    if cfg.teacher.teacher:
        teacher = load_model(
            cfg.teacher.teacher, "teacher", cfg.model.dtype, model_device(model), revision=cfg.teacher.teacher_revision
        )
        teacher_engine = local_engine(teacher, tok)

    def batch(step: int) -> tuple:
        idx = train_set.batch_indices(step, cfg.optimizer.batch_size, cfg.run.seed)
        chosen = [train_set.examples[i] for i in idx]
        targets = (
            teacher_completions(teacher_engine, tok, train_set, idx, step, cfg)
            if teacher_engine
            else cast(list[str], [e.solution for e in chosen])  # all given, as checked above
        )
        return encode_pairs(tok, [e.chat() for e in chosen], targets, tools=[e.tools for e in chosen])

    def accuracy_on(prompts: PromptSet) -> Callable[[object], float]:
        def accuracy(m) -> float:
            res = evaluate_model(
                m, tok, prompts, eval_task, max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.run.seed
            )
            return res["accuracy"]

        return accuracy

    if eval_task is None:
        return batch, None, None
    on_test = accuracy_on(
        PromptSet.build(eval_prompts(eval_task, cfg.eval.eval_size), tok, cfg.data.max_prompt_tokens, "test prompts")
    )
    if not validation:
        return batch, on_test, on_test
    return (
        batch,
        accuracy_on(PromptSet.build(validation, tok, cfg.data.max_prompt_tokens, "validation prompts")),
        on_test,
    )


def episode_source(cfg: SFTConfig, tok, model) -> tuple[Callable, Callable | None, Callable | None]:
    """The same for an environment: its expert episodes, and the greedy success rate on validation games
    (training games never trained on) and on the held-out games."""
    from opd.evaluation.game_eval import evaluate_agent
    from opd.rollout.game_set import GameSet, check_episode_context, play_env
    from opd.training.cloning import expert_sequences

    if cfg.teacher.teacher or cfg.data.data:
        raise UserError("--env trains on the environment's expert episodes; --teacher and --data are for prompts")
    check_episode_context(model, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens)
    env = play_env(
        cfg.env, cfg.model.device
    )  # sessions opened by hand (the expert's) stay here; played episodes go to its workers
    games = GameSet.build(env, "train").games
    games, validation = held_out_for_validation(games, cfg, "games") if cfg.eval.eval else (games, [])
    games = games[: cfg.data.train_size or None]
    seqs, labels, skipped = expert_sequences(
        env,
        games,
        tok,
        cfg.rollout.max_new_tokens + cfg.data.max_prompt_tokens,
        mistakes=cfg.env.expert_mistakes,
        seed=cfg.run.seed,
    )
    if not seqs:
        raise UserError(
            f"none of the {len(games)} training games of {env.name!r} gave an expert episode that wins within "
            f"{cfg.rollout.max_new_tokens + cfg.data.max_prompt_tokens} tokens; raise --max-new-tokens or check the environment"
        )
    if skipped:
        print(f"opd sft: {skipped} of {len(games)} training games left out (no winning expert episode that fits)")
    for player in cfg.env.dagger_from:
        more, more_labels = dagger_data(cfg, env, games, tok, player, model_device(model))
        seqs, labels = seqs + more, labels + more_labels

    def batch(step: int) -> tuple:
        idx = batch_indices(len(seqs), step, cfg.optimizer.batch_size, cfg.run.seed)
        return pad_right([seqs[i] for i in idx], [labels[i] for i in idx], tok.pad_token_id)

    if not cfg.eval.eval:
        return batch, None, None

    def success_on(games: GameSet) -> Callable[[object], float]:
        def success(m) -> float:
            return evaluate_agent(m, tok, games, seed=cfg.run.seed, **episode_limits(cfg.env, cfg.data, cfg.rollout))[
                "success_rate"
            ]

        return success

    on_test = success_on(GameSet.build(env, "test", cfg.eval.eval_size))
    if not validation:
        return batch, on_test, on_test
    examples = [Example(prompt=g.goal or g.id, answer="", task=env.name) for g in validation]
    return batch, success_on(GameSet(env, validation, examples)), on_test


def dagger_data(cfg: SFTConfig, env, games: list, tok, player: str, device) -> tuple[list, list]:
    """``player`` plays every training game once (sampling at temperature 1, top-p 0.9: how an
    on-policy student explores); the expert labels the states it reached (opd.training.cloning.dagger_sequences)."""
    from opd.rollout.episodes import EpisodeRollout
    from opd.training.cloning import dagger_sequences, require_expert_next

    session = env.open(games[0])  # before any play: can the expert label another player's states?
    try:
        require_expert_next(session)
    finally:
        session.close()
    model, player_tok = load_model(player, "--dagger-from model", cfg.model.dtype, device), load_tokenizer(player)
    engine, played = EpisodeRollout(model, player_tok), []
    with progress_bar(f"{player} plays the training games", total=len(games)) as bar:
        for start in range(0, len(games), 64):
            chunk = games[start : start + 64]
            seeds = [sample_seed(cfg.run.seed, -1, start + j) for j in range(len(chunk))]
            records = engine.play(
                env, chunk, seeds, top_p=0.9, **episode_limits(cfg.env, cfg.data, cfg.rollout)
            ).records
            played += list(zip(chunk, records, strict=True))
            bar.advance(len(chunk))
    limit = cfg.rollout.max_new_tokens + cfg.data.max_prompt_tokens
    seqs, labels, skipped = dagger_sequences(env, played, tok, limit, cfg.env.dagger_branches, cfg.run.seed)
    won = sum(r.won for _, r in played)
    print(
        f"opd sft: {player} won {won} of {len(played)} training games; {len(seqs)} sequences from the states it "
        f"reached ({skipped} episodes gave none: on the expert's path throughout, or no expert there)"
    )
    return seqs, labels


def task_sources(specs: list[TaskSpec[SFTConfig]], data: list, tok, model) -> list[tuple]:
    """Each task's (name, batch of its k-th step, greedy validation accuracy, greedy test accuracy; the
    two accuracies are one function with --validation-size 0, None without evaluation): one task named "" unless
    the config lists several (each resolved into its own checked SFTConfig by opd.config.tasks).
    ``data``: each prompt task's (training task, evaluation task), None for an environment."""
    out = []
    for spec, tasks in zip(specs, data, strict=True):
        if spec.cfg.env.env:
            out.append((spec.name, *for_task(spec.name, episode_source, spec.cfg, tok, model)))
        else:
            out.append((spec.name, *for_task(spec.name, prompt_source, spec.cfg, tok, model, *tasks)))
    return out


def step_parts(sources: list, schedule: list, step: int) -> list[tuple[int, tuple]]:
    """(task, batch) of every part of ``step``: the one task; every task's next batch (mix); the
    scheduled task's next batch (alternate: each task walks its own example order)."""
    if schedule:
        i, visit = schedule[step]
        return [(i, sources[i][1](visit))]
    return [(i, src[1](step)) for i, src in enumerate(sources)]


def parts_loss(model, parts: list[tuple[int, tuple]], step: int) -> tuple[float, dict[int, float]]:
    """Backpropagate the token mean of the cross-entropy over every part's label tokens together
    (each part's own mean weighted by its share of them); the total and each part's own loss."""
    device = model_device(model)
    batches = [tuple(t.to(device) for t in batch) for _, batch in parts]
    counts = [int((lab[:, 1:] != -100).sum()) for _, _, lab in batches]  # what the causal-LM loss averages over
    total, own = 0.0, {}
    for (i, _), (ids, att, lab), n in zip(parts, batches, counts, strict=True):
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        if not torch.isfinite(loss):
            raise UserError(f"SFT loss became {float(loss)} at step {step}; lower --lr")
        (loss * (n / sum(counts))).backward()  # one part: weight 1.0 exactly
        own[i] = loss.item()
        total += own[i] * (n / sum(counts))
    return total, own


def accuracy_record(step: int, acc: float, accs: dict[str, float], split: str = "") -> dict:
    """``eval/[split]accuracy`` and each named task's ``eval/[split]<task>/accuracy``."""
    return {
        "step": step,
        f"eval/{split}accuracy": acc,
        **{f"eval/{split}{n}/accuracy": a for n, a in accs.items() if n},
    }


def kept_on_test(cfg: SFTConfig, rundir: RunDir, sources: list, step: int, multi: bool) -> dict:
    """The kept model (``final/``, chosen on validation data) on the test data, once: logged at the last
    step as ``eval/accuracy`` and returned as the summary's ``test_accuracy`` (and ``test_by_task``)."""
    kept = load_model(rundir.path / "final", "the kept SFT model", cfg.model.dtype, resolve_device(cfg.model.device))
    accs = {name: on_test(kept) for name, _, _, on_test in sources}
    acc = sum(accs.values()) / len(accs)
    rundir.log_metrics(accuracy_record(step, acc, accs))
    return {"test_accuracy": acc, **({"test_by_task": accs} if multi else {})}


def sft(cfg: SFTConfig, show_progress: bool = True) -> dict:
    models = {"init": cfg.model.init, "teacher": cfg.teacher.teacher, "tokenizer": cfg.model.tokenizer}
    rundir = RunDir(cfg.run.out, report_to=cfg.run.report_to, command="sft", models=models)
    specs = resolve_tasks(cfg)
    # before the model: a data problem shows at once
    data = [None if spec.cfg.env.env else for_task(spec.name, load_tasks, spec.cfg) for spec in specs]
    say_grading_notes("sft", specs, data)
    model, tok = build_model(cfg)
    set_chat_options(tok, cfg.data.chat_template_kwargs, check=cfg.data.check_chat_template_kwargs)
    sources = task_sources(specs, data, tok, model)
    rundir.write_config(cfg)  # once data and model passed their checks: a refused run leaves only the marker
    graded_sources = [s for s in sources if s[2] is not None]  # the others: --no-eval, or nothing to grade
    names = [spec.name for spec in specs]
    multi = cfg.multitask.tasks is not None
    alternate = multi and cfg.multitask.task_mode == "alternate"
    schedule = task_schedule(cfg.optimizer.steps, [s.share for s in specs], cfg.run.seed) if alternate else []
    opt = make_optimizer(model, cfg.optimizer.lr)
    sched = make_scheduler(opt, cfg.optimizer.warmup_steps, cfg.optimizer.steps, cfg.optimizer.schedule)
    best, best_by_task, stale, t0 = -1.0, {}, 0, time.time()
    model.train()
    with rundir, progress_bar("SFT", total=cfg.optimizer.steps, enabled=show_progress) as bar:
        for step in range(cfg.optimizer.steps):
            opt.zero_grad(set_to_none=True)
            loss, own = parts_loss(model, step_parts(sources, schedule, step), step)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.max_grad_norm)
            opt.step()
            sched.step()
            record = {
                "step": step,
                "train/loss": loss,
                "train/grad_norm": float(norm),
                "train/lr": sched.get_last_lr()[0],
            }
            record.update({f"{names[i]}/train/loss": v for i, v in own.items() if names[i]})
            rundir.log_metrics(record)
            bar.advance(1)
            bar.describe(f"loss {loss:.3f}" + (f"  best acc {max(best, 0):.3f}" if graded_sources else ""))
            due = (cfg.eval.eval_every and (step + 1) % cfg.eval.eval_every == 0) or step == cfg.optimizer.steps - 1
            if graded_sources and due:
                # several tasks: the model is chosen by the unweighted mean of their accuracies
                accs = {name: accuracy(model) for name, _, accuracy, _ in graded_sources}
                acc = sum(accs.values()) / len(accs)
                model.train()
                rundir.log_metrics(accuracy_record(step, acc, accs, "validation/" if cfg.eval.validation_size else ""))
                if acc > best:
                    best, best_by_task, stale = acc, accs, 0
                    save_final_model(rundir.path / "final", model, tok, dtype=saved_dtype(cfg.model.dtype))
                else:
                    stale += 1
                if cfg.eval.patience and stale >= cfg.eval.patience:
                    break
    summary: dict[str, Any] = {"steps": step + 1, "wall_s": round(time.time() - t0, 1)}
    if not graded_sources:  # no evaluation to choose on: the last model is kept
        save_final_model(rundir.path / "final", model, tok, dtype=saved_dtype(cfg.model.dtype))
        summary["chosen_on"] = "last step"
    else:
        summary["best_accuracy"] = best
    if multi and graded_sources:
        summary["best_by_task"] = best_by_task
    if (
        cfg.eval.validation_size and graded_sources
    ):  # chosen on validation data; the kept model's test accuracy is reported
        summary["chosen_on"] = "validation"
        summary.update(kept_on_test(cfg, rundir, graded_sources, step, multi))
    write_card(rundir.path / "final", sft_card(cfg, rundir.path.name, summary))
    rundir.write_json("summary.json", summary)
    return summary
