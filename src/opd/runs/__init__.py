"""Run directories: what a run leaves behind and how it shows progress.

* :mod:`~opd.runs.rundir` -- ``config.json``, ``metrics.jsonl``, ``rollouts.jsonl``, atomic checkpoints.
* :mod:`~opd.runs.tracking` -- experiment trackers fed from the run directory (``--report-to``).
* :mod:`~opd.runs.records` -- the fields of a rollout record.
* :mod:`~opd.runs.progress` -- rich progress bars, silent on ranks other than 0; :mod:`~opd.runs.quiet`,
  transformers' own bars and deprecation notices kept out of the way around opd's loads and saves.
"""
