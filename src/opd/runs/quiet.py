"""transformers' own progress bars and deprecation notices kept out of opd's terminal.

opd's rich bars are the progress; a checkpoint save or a model load would otherwise print a
"Writing model shards" or "Loading weights" bar between them (dozens in an agentic demo, whose
objectives train in worker processes where no global setting of the CLI reaches). Applied around
each load and save opd makes, in whatever process makes it. Warnings other than deprecations
(they may say something about the user's model) still show; opd's own deprecated calls are caught
by the test suite (tests/opd_warnings.py), not hidden from it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
