"""Evaluation options shared by ``opd train`` (its in-training evaluations) and ``opd eval``: how the
responses are sampled, maj@k, the generation batch's token budget and the per-sample records' bound.
The figures they produce are described in :mod:`opd.evaluation.core`."""

from __future__ import annotations

from dataclasses import dataclass

from opd.config.fields import opt, require

EVAL_SAMPLING = ("greedy", "model", "explicit")


@dataclass(frozen=True)
class EvalOptions:
    """Options of an evaluation (section "eval"), the same in train and eval."""

    eval_sampling: str = opt(
        "greedy",
        "How evaluation decodes. greedy: accuracy is the greedy response's, the samples (avg@k, pass@k, maj@k) "
        "drawn at the sampling temperature and top-p; model: no greedy response, every figure from samples drawn "
        "as the model's generation_config says (its temperature and top-p: thinking models such as Qwen3 loop "
        "when decoded greedily); explicit: the same from samples at the given temperature and top-p. "
        "eval.json states what was used.",
        section="eval",
    )
    maj_k: int = opt(
        0,
        "Majority vote over the first K samples of each prompt (maj@K: the most frequent extracted answer, "
        "graded); at most the number of samples; 0: off.",
        section="eval",
    )
    eval_batch_tokens: int = opt(
        262144,
        "Token budget of an evaluation's generation batch: rollouts per batch = this over (the longest prompt + "
        "--max-new-tokens), at most --batch-size for opd eval and 128 in training. Bounds the KV cache at long "
        "responses.",
        section="eval",
    )
    eval_record_chars: int = opt(
        8000,
        "Per-sample records (eval_samples.jsonl): a prompt or response longer than this many characters keeps "
        "its first quarter and its last three quarters around a marker saying how much was cut; 0: no records.",
        section="eval",
    )


@dataclass(frozen=True)
class TrainEvalOptions(EvalOptions):
    """Training's explicit evaluation sampling (``opd eval`` has --temperature and --top-p for it)."""

    eval_temperature: float = opt(
        0.0,
        "Evaluation sampling temperature for --eval-sampling greedy or explicit (0: the rollouts' --temperature).",
        section="eval",
    )
    eval_top_p: float = opt(
        0.0, "Evaluation top-p for --eval-sampling greedy or explicit (0: the rollouts' --top-p).", section="eval"
    )


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
