"""The per-token fields of a ``rollouts.jsonl`` record, and the ``config.json`` options whose value is a
mapping: one list for the writer (:mod:`opd.training.stepstats`, :mod:`opd.config`) and the reader
(:mod:`opd.report.load`), which must not import the trainer or the config."""

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
# Options whose value is a mapping (a JSON object): in a flat config.json they are not sections.
MAPPING_OPTIONS = ("chat_template_kwargs", "teacher_chat_template_kwargs")
