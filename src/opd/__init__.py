"""opd: on-policy distillation of language models, built around teacher top-K local support matching.

The loss functions (:mod:`opd.losses`) and diagnostics (:mod:`opd.metrics`) are pure torch and
can be imported on their own; everything that touches models lives in the other modules.
"""

__version__ = "0.1.0"
