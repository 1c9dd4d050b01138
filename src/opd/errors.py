"""The one exception type for problems the user can fix.

Its message names the problem and the fix; the CLI prints it as one line (no traceback) and
exits with status 2.
"""


class UserError(ValueError):
    """Bad input: a wrong path, mismatched vocabularies, empty data, an invalid setting."""


class ServiceUnavailable(UserError):
    """A server the trainer depends on (a served teacher, a vLLM rollout engine) stayed unreachable: the
    trainer checkpoints the last completed step and stops, so ``--resume`` loses nothing."""
