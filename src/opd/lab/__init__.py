"""The lab: what opd's own claims are measured with, apart from the library.

* :mod:`~opd.lab.demos` -- the three demos (``opd demo``) and how their packaged models are made
  (``opd make-demo-models``).
* :mod:`~opd.lab.experiments` -- the experiments that check the papers' claims (``opd experiment``) and
  ``docs/RESULTS.md`` (``opd results``).

No library module imports the lab (an import contract in ``pyproject.toml``): the CLI loads it only when
one of those commands runs, so ``import opd`` and ``opd train`` never do.
"""
