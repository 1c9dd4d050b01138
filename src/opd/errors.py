"""The one exception type for problems the user can fix.

Its message names the problem and the fix; the CLI prints it as one line (no traceback) and
exits with status 2.
"""


class UserError(ValueError):
    """Bad input: a wrong path, mismatched vocabularies, empty data, an invalid setting."""
