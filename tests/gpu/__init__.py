"""opd on a GPU, as pytest tests marked ``gpu``: run by ``pytest -m gpu tests/gpu`` on a CUDA machine (or by
benchmarks/gpu_check.py, which writes the card), skipped without CUDA, and left out of a run that does not
ask for them with ``-m gpu``. ``OPD_GPU_DRY_RUN=1`` runs them on the CPU at small shapes: the dry run CI
makes (tests/test_gpu_dry_run.py), so that a lent GPU's one try is not spent on a test's own error."""
