"""The per-token fields of a ``rollouts.jsonl`` record: one list for the writer
(:mod:`opd.training.stepstats`) and the reader (:mod:`opd.report.load`), which must not import the trainer."""

# Fields that exist only where the model wrote the token; an environment token has null there.
MODEL_FIELDS = (
    "student_logprobs",
    "teacher_logprobs",
    "token_loss",
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "student_topk_logprobs",
)
# What the report's inspector needs of every record; a record missing one is skipped as a whole.
PER_TOKEN_FIELDS = ("tokens", "token_ids", "loss_mask", *MODEL_FIELDS)  # one entry per token
ROLLOUT_FIELDS = ("step", *PER_TOKEN_FIELDS)
