"""Evaluation options shared by ``opd train`` (its in-training evaluations) and ``opd eval``: how the
responses are sampled, maj@k, the generation batch's token budget and the per-sample records' bound.
The figures they produce are described in :mod:`opd.evaluation.core`."""

from __future__ import annotations

from dataclasses import dataclass

from opd.config.fields import Section, check_counts, default_of, opt, require
from opd.config.sources import EvalSource, check_eval_schedule

EVAL_SAMPLING = ("greedy", "model", "explicit")


@dataclass(frozen=True)
class EvalOptions(Section):
    """Options of an evaluation (section "eval"), the same in train and eval."""

    eval_sampling: str = opt(
        "greedy",
        "How evaluation decodes. greedy: accuracy is the greedy response's, the samples (avg@k, pass@k, maj@k) "
        "drawn at the sampling temperature and top-p; model: no greedy response, every figure from samples drawn "
        "as the model's generation_config says (its temperature and top-p: thinking models such as Qwen3 loop "
        "when decoded greedily); explicit: the same from samples at the given temperature and top-p. "
        "eval.json states what was used.",
    )
    maj_k: int = opt(
        0,
        "Majority vote over the first K samples of each prompt (maj@K: the most frequent extracted answer, "
        "graded); at most the number of samples; 0: off.",
    )
    eval_batch_tokens: int = opt(
        262144,
        "Token budget of an evaluation's generation batch: rollouts per batch = this over (the longest prompt + "
        "--max-new-tokens), at most --batch-size for opd eval and 128 in training. Bounds the KV cache at long "
        "responses.",
    )
    eval_record_chars: int = opt(
        8000,
        "Per-sample records (eval_samples.jsonl): a prompt or response longer than this many characters keeps "
        "its first quarter and its last three quarters around a marker saying how much was cut; 0: no records.",
    )


@dataclass(frozen=True)
class TrainEvalOptions(EvalSource, EvalOptions):
    """Section "eval" of opd train: its in-training evaluations, with their own sampling (``opd eval`` has
    --temperature and --top-p for it)."""

    eval_temperature: float = opt(
        0.0,
        "Evaluation sampling temperature for --eval-sampling greedy or explicit (0: the rollouts' --temperature).",
    )
    eval_top_p: float = opt(0.0, "Evaluation top-p for --eval-sampling greedy or explicit (0: the rollouts' --top-p).")
    eval_every: int = opt(50, "Evaluate every N steps (0: only at the end).")
    eval_size: int = opt(200, "Number of test prompts for evaluation.", per_task=True)
    eval_samples: int = opt(4, "Samples per prompt for avg@k / pass@k at evaluation (0: greedy only).", per_task=True)

    def check(self) -> None:
        super().check()
        check_counts(self, eval_every=0, eval_size=1, eval_samples=0)
        check_eval_options(self, self.eval_samples, "--eval-samples")
        check_eval_schedule(self, self.eval_every, default_of(TrainEvalOptions, "eval_every"))


@dataclass(frozen=True)
class SFTEvalOptions(EvalSource):
    """Section "eval" of opd sft: what the model is evaluated on, how often, and which checkpoint is kept."""

    eval_every: int = opt(250, "Evaluate greedy accuracy every N steps (0: only at the end).")
    eval_size: int = opt(200, "Test prompts for evaluation.", per_task=True)
    patience: int = opt(0, "Stop after this many evaluations without improvement (0: never).")
    validation_size: int = opt(
        200,
        "Training examples (or games) held out of training, the last ones: the kept checkpoint is the best on "
        "them, and the test set only reports the kept model's accuracy (0: choose on the test set).",
    )

    def check(self) -> None:
        super().check()
        check_counts(self, eval_every=0, eval_size=1, patience=0, validation_size=0)
        check_eval_schedule(self, self.eval_every, default_of(SFTEvalOptions, "eval_every"))


@dataclass(frozen=True)
class EvalCommandOptions(EvalOptions):
    """Section "eval" of opd eval: how many prompts and samples, and the accuracies gap recovery needs."""

    eval_size: int = opt(500, "Test prompts.")
    samples: int = opt(8, "Samples per prompt for avg@k / pass@k / maj@k (0: greedy only).")
    batch_size: int = opt(128, "Rollouts per generation batch at most (--eval-batch-tokens bounds it too).")
    acc_before: float = opt(-1.0, "Student accuracy before OPD (for gap recovery; -1: not given).")
    acc_teacher: float = opt(-1.0, "Teacher accuracy (for gap recovery; -1: not given).")

    def check(self) -> None:
        check_counts(self, samples=0, eval_size=1, batch_size=1)
        check_eval_options(self, self.samples, "--samples")


def check_eval_options(cfg: EvalOptions, samples: int, samples_flag: str) -> None:
    """A ConfigError naming the option and the fix; ``samples``: the samples per prompt (--samples-flag)."""
    require(
        cfg.eval_sampling in EVAL_SAMPLING, f"eval_sampling={cfg.eval_sampling!r}: one of {', '.join(EVAL_SAMPLING)}"
    )
    require(cfg.maj_k >= 0, f"maj_k={cfg.maj_k} must be >= 0 (0: no majority vote)")
    require(
        cfg.maj_k == 0 or samples > 0,
        f"maj_k={cfg.maj_k} votes over samples, and {samples_flag} is 0: set {samples_flag} to {cfg.maj_k} or more",
    )
    require(
        cfg.maj_k <= samples,
        f"maj_k={cfg.maj_k} needs as many samples per prompt; {samples_flag} is {samples}: raise it or lower --maj-k",
    )
    require(
        cfg.eval_sampling == "greedy" or samples > 0,
        f"eval_sampling={cfg.eval_sampling} takes every figure from samples, and {samples_flag} is 0: "
        f"set {samples_flag} to 1 or more (or --eval-sampling greedy)",
    )
    require(cfg.eval_batch_tokens >= 1, f"eval_batch_tokens={cfg.eval_batch_tokens} must be >= 1")
    require(cfg.eval_record_chars >= 0, f"eval_record_chars={cfg.eval_record_chars} must be >= 0 (0: no records)")
    if isinstance(cfg, TrainEvalOptions):
        require(cfg.eval_temperature >= 0, f"eval_temperature={cfg.eval_temperature} must be >= 0 (0: --temperature)")
        require(0 <= cfg.eval_top_p <= 1, f"eval_top_p={cfg.eval_top_p} must lie in [0, 1] (0: --top-p)")
