"""Recipes: the three demos (``opd demo``, ``--agentic``, ``--multitask``) and how their models
are made (``opd make-demo-models``), with the helper that trains objectives side by side.

* :mod:`~opd.recipes.demo` -- single-task: sampled-token OPD vs LSM on arithmetic.
* :mod:`~opd.recipes.agentic` -- ALFWorld games.
* :mod:`~opd.recipes.multitask` -- math and games in one student, a teacher per task.
* :mod:`~opd.recipes.parallel` -- a process per objective, the CPU threads shared out.
"""
