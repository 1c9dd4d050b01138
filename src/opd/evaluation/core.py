"""One evaluation for prompts and games: the jobs, their seeds, their batches and the figures.

An evaluation runs a set of items (:class:`Items`: prompts graded by a task, or an environment's
games) through a rollout engine (:class:`~opd.rollout.engine.RolloutEngine`: whichever the run
samples with -- opd's loop with or without its static cache, or vLLM), each item once greedily and
``samples`` times sampled, every rollout with its own seed (:func:`eval_seed`, the one formula).
Jobs are batched by a token budget (:class:`EvalPlan`), so long responses get smaller batches; the
ranks of a launch each evaluate a share of the items (:mod:`opd.evaluation.sharing`).

What it returns (:class:`Evaluation`): the figures (``accuracy``; with samples avg@k, pass@k and
maj@k; response length and truncation rate; the sampling used) and one record per rollout
(:mod:`opd.evaluation.records` writes them).

Usage::

    plan = EvalPlan(samples=4, sampling=EvalSampling("greedy", temperature=1.0, top_p=0.9))
    result = evaluate(engine, PromptItems(prompts, task, tok, max_new_tokens=256), plan)
    result.figures["accuracy"], result.records[0]["response"]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from opd.config.evaluation import EvalOptions
from opd.evaluation.estimators import avg_at_k, maj_at_k, mean_pass_at_k
from opd.evaluation.sharing import ALONE, Share
from opd.rollout.engine import RolloutEngine, Sampling
from opd.rollout.registry import local_engine
from opd.runs.progress import progress_bar

__all__ = ["GREEDY", "EvalPlan", "EvalSampling", "Evaluation", "Items", "Rollout", "eval_seed", "evaluate"]

GREEDY = -1  # the sample index of an item's greedy response (its samples are 0, 1, ...)


def eval_seed(seed: int, item: int, sample: int) -> int:
    """The sampling seed of ``item``'s response ``sample`` (:data:`GREEDY` for the greedy one): a function of
    the item alone, so an outcome does not depend on the batch or the rank it lands in."""
    return seed * 7919 + item * 131 + sample


@dataclass(frozen=True)
class EvalSampling:
    """How an evaluation decodes (``--eval-sampling``): ``greedy`` (a greedy response per item, whose verdict
    is ``accuracy``, and samples at ``temperature`` / ``top_p`` / ``top_k``), ``model`` or ``explicit`` (samples
    only; ``accuracy`` is avg@k). ``top_k`` 0: off. ``note``: what eval.json should say besides."""

    mode: str = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    note: str = ""
    top_k: int = 0

    @property
    def greedy_pass(self) -> bool:
        return self.mode == "greedy"

    def record(self, samples: int) -> dict:
        """What eval.json states about the decoding."""
        out: dict[str, Any] = {"mode": self.mode, "greedy_response": self.greedy_pass, "samples": samples}
        if samples:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return out | ({"note": self.note} if self.note else {})


@functools.lru_cache(maxsize=16)  # once per run and model: an evaluation every N steps warns once
def resolve_sampling(mode: str, temperature: float, top_p: float, model_dir: str = "") -> EvalSampling:
    """The decoding of ``--eval-sampling mode``: ``model`` reads the generation_config.json of ``model_dir``
    (temperature and top-p, 1.0 where it says none; top-k, 0 (off) where it says none). A model whose config
    does not sample (no ``do_sample: true``) is decoded greedily, as the model's own ``generate`` would."""
    if mode != "model":
        return EvalSampling(mode, temperature, top_p)
    gc = _generation_config(model_dir)
    if gc is None or not gc.get("do_sample"):
        why = "none" if gc is None else "one that does not sample (no do_sample: true)"
        return EvalSampling("greedy", temperature, top_p, f"--eval-sampling model: the model has {why}: greedy")
    temperature, top_p = float(gc.get("temperature") or 1.0), float(gc.get("top_p") or 1.0)
    return EvalSampling("model", temperature, top_p, top_k=int(gc.get("top_k") or 0))


def _generation_config(model_dir: str) -> dict | None:
    """The sampling settings the model's directory declares (its generation_config.json), or None."""
    from transformers import GenerationConfig

    if not model_dir or not (Path(model_dir) / "generation_config.json").is_file():
        return None
    return GenerationConfig.from_pretrained(model_dir).to_diff_dict()


@dataclass(frozen=True)
class EvalPlan:
    """What an evaluation does besides its items: ``samples`` per item (avg@k, pass@k), maj@``maj_k``,
    rollouts per batch (``batch_tokens`` over an item's tokens, at most ``max_batch``), the run's ``seed``,
    the records' bound (``record_chars``; 0: none kept), this rank's ``share``."""

    samples: int = 0
    sampling: EvalSampling = field(default_factory=EvalSampling)
    maj_k: int = 0
    batch_tokens: int = 262144
    max_batch: int = 128
    seed: int = 0
    record_chars: int = 8000
    share: Share = ALONE
    show_progress: bool = False

    @classmethod
    def of(
        cls, options: EvalOptions, samples: int, sampling: EvalSampling, seed: int, max_batch: int = 128, **kw: Any
    ) -> EvalPlan:
        """A plan from a config's eval section (its :class:`opd.config.evaluation.EvalOptions`)."""
        return cls(
            samples=samples,
            sampling=sampling,
            maj_k=options.maj_k,
            batch_tokens=options.eval_batch_tokens,
            max_batch=max_batch,
            seed=seed,
            record_chars=options.eval_record_chars,
            **kw,
        )


@dataclass
class Rollout:
    """One response's outcome: its verdict, length (tokens the model wrote), whether it ran out of tokens
    (no EOS, or an episode cut by its limits), its extracted answer (None: none, or a game) and its record
    fields (prompt, response, answer, reference, ...); ``extra``: what the items' own figures read."""

    correct: bool
    tokens: int
    truncated: bool
    record: dict
    answer: str | None = None
    extra: Any = None


class Items(Protocol):
    """What is evaluated: prompts or games, each played through the engine."""

    answers: bool  # its rollouts have answers to vote on (maj@k): prompts do, games do not

    def __len__(self) -> int: ...

    def tokens_per_rollout(self) -> int:
        """The positions one rollout may take (the longest prompt plus the response budget): the batch's unit."""

    def run(self, engine: RolloutEngine, items: list[int], seeds: list[int], sampling: Sampling) -> list[Rollout]:
        """The rollouts of ``items``, one per seed, in order."""

    def figures(self, headline: list[Rollout]) -> dict:
        """Figures of their own from each item's headline rollout (greedy, else its first sample)."""


@dataclass
class Evaluation:
    figures: dict
    records: list[dict]


def evaluate(engine: RolloutEngine, items: Items, plan: EvalPlan) -> Evaluation:
    """Every item of this rank's share, greedily (with ``--eval-sampling greedy``) and ``plan.samples``
    times sampled, batched by the token budget; the outcomes of every rank merged in item order, so every
    rank returns the figures and records of all the items."""
    mine = plan.share.items(len(items))
    passes = ([GREEDY] if plan.sampling.greedy_pass else []) + list(range(plan.samples))
    done: dict[int, dict[int, Rollout]] = {i: {} for i in mine}
    per_batch = max(1, min(plan.max_batch, plan.batch_tokens // max(1, items.tokens_per_rollout())))
    s = plan.sampling
    with progress_bar("evaluating", total=len(mine) * len(passes), enabled=plan.show_progress) as bar:
        # Greedy jobs, then sampled ones: one engine call decodes one way; samples of several items share it.
        for greedy in (True, False):
            jobs = [(i, p) for p in passes if (p == GREEDY) == greedy for i in mine]
            for start in range(0, len(jobs), per_batch):
                chunk = jobs[start : start + per_batch]
                seeds = [eval_seed(plan.seed, i, p) for i, p in chunk]
                got = items.run(engine, [i for i, _ in chunk], seeds, Sampling(s.temperature, s.top_p, greedy, s.top_k))
                for (i, p), rollout in zip(chunk, got, strict=True):
                    rollout.record = _clipped(rollout.record, plan.record_chars)
                    done[i][p] = rollout
                bar.advance(len(chunk))
    merged = plan.share.merged(len(items), [[done[i][p] for p in passes] for i in mine])
    return Evaluation(_figures(items, merged, plan), _records(merged, passes, plan))


def figures_on_model(
    model, tokenizer, items: Items, samples: int, temperature: float, top_p: float, **plan: Any
) -> dict:
    """The figures of ``items`` on ``model`` with opd's own loop: greedy, and ``samples`` sampled at
    ``temperature`` / ``top_p``, no records (the demos' and ``opd sft``'s evaluations); ``plan``: the rest of
    :class:`EvalPlan` (max_batch, seed, share, show_progress)."""
    sampling = EvalSampling("greedy", temperature, top_p)
    full = EvalPlan(samples=samples, sampling=sampling, record_chars=0, **plan)
    return evaluate(local_engine(model, tokenizer), items, full).figures


def _figures(items: Items, outcomes: list[list[Rollout]], plan: EvalPlan) -> dict:
    """The figures of every item's rollouts (each row: greedy first when there is one, then the samples)."""
    n, greedy = len(outcomes), plan.sampling.greedy_pass
    sampled = [row[1:] if greedy else row for row in outcomes]
    ok = [[r.correct for r in row] for row in sampled]
    result: dict[str, Any] = {"n": n}
    result["accuracy"] = sum(row[0].correct for row in outcomes) / n if greedy else avg_at_k(ok)
    if plan.samples:
        result.update(avg_at_k=avg_at_k(ok), pass_at_k=mean_pass_at_k(ok, plan.samples), k=plan.samples)
    if plan.maj_k and items.answers:
        answers = [[r.answer for r in row] for row in sampled]
        result.update(maj_at_k=maj_at_k(answers, ok, plan.maj_k), maj_k=plan.maj_k)
    every = [r for row in outcomes for r in row]
    result["response_tokens_mean"] = sum(r.tokens for r in every) / len(every)
    result["response_tokens_max"] = max(r.tokens for r in every)
    result["truncation_rate"] = sum(r.truncated for r in every) / len(every)
    result.update(items.figures([row[0] for row in outcomes]))
    result["sampling"] = plan.sampling.record(plan.samples)
    return result


def _records(outcomes: list[list[Rollout]], passes: list[int], plan: EvalPlan) -> list[dict]:
    """One record per rollout, item by item: what :mod:`opd.evaluation.records` writes (none: no records)."""
    if not plan.record_chars:
        return []
    out = []
    for i, row in enumerate(outcomes):
        for p, r in zip(passes, row, strict=True):
            base = {"item": i, "sample": p, "correct": r.correct, "tokens": r.tokens, "truncated": r.truncated}
            out.append(r.record | base)
    return out


def _clipped(record: dict, chars: int) -> dict:
    """The record with its long texts cut to ``chars`` characters (0: no record kept)."""
    if not chars:
        return {}
    return {k: clip_text(v, chars) if isinstance(v, str) else v for k, v in record.items()}


def clip_text(text: str, chars: int) -> str:
    """``text`` whole up to ``chars`` characters; a longer one keeps its first quarter and its last three
    quarters (where a final answer is) around a marker saying how many characters were cut."""
    if len(text) <= chars:
        return text
    head = chars // 4
    tail = chars - head
    return f"{text[:head]}\n[... {len(text) - chars} characters cut ...]\n{text[len(text) - tail :]}"
