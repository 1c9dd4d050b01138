"""The suite's deprecation check (tests/opd_warnings.py) catches what opd causes, and only that.

The inner tests pass a deprecated keyword through opd's own ``model(...)`` call, exactly as
``past_key_values=`` reached a model's forward (transformers' real ``deprecate_kwarg`` decorator,
called through torch's module machinery), and compare it with the same warning from other callers.
"""

from __future__ import annotations

from pathlib import Path

INNER = '''
import warnings

import torch
from transformers.utils.deprecation import deprecate_kwarg

from opd.rollout.sampling import prefill


class Stub(torch.nn.Module):
    """A model whose forward renamed ``use_cache`` (opd's prefill passes it)."""

    @deprecate_kwarg("use_cache", "99.0.0", new_name="keep_cache")
    def forward(self, input_ids, attention_mask, position_ids, keep_cache=None, logits_to_keep=0):
        _old_helper()
        return input_ids


def _old_helper():
    warnings.warn("_old_helper is deprecated", DeprecationWarning, stacklevel=2)


IDS = torch.ones(1, 3, dtype=torch.long)


def test_opd_passes_the_deprecated_keyword():
    prefill(Stub(), IDS, IDS)


def test_the_same_warning_from_a_test_is_not_opds():
    Stub()(input_ids=IDS, attention_mask=IDS, position_ids=IDS, use_cache=True)


def test_opd_calls_what_warns_about_its_own_line():
    def forward(self, **kw):
        warnings.warn("this way of calling is deprecated", FutureWarning)  # stacklevel 1
        return kw["input_ids"]

    Stub.forward = forward
    prefill(Stub(), IDS, IDS)


def test_a_library_calling_its_own_deprecated_api_under_opd_is_not_opds():
    Stub.forward = lambda self, **kw: _old_helper() or kw["input_ids"]
    prefill(Stub(), IDS, IDS)
'''


def test_a_deprecated_call_from_opd_fails_and_others_pass(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "opd_warnings", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*FutureWarning caused by opd/rollout/sampling.py:*`use_cache` is deprecated*",
            "*FutureWarning caused by opd/rollout/sampling.py:*this way of calling is deprecated*",
            "FAILED test_inner.py::test_opd_passes_the_deprecated_keyword*",
            "FAILED test_inner.py::test_opd_calls_what_warns_about_its_own_line*",
        ]
    )
