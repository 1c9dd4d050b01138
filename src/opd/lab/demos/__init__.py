"""The three demos (``opd demo``, ``--agentic``, ``--multitask``) and how their models
are made (``opd make-demo-models``), with the helper that trains objectives side by side.

* :mod:`~opd.lab.demos.demo` -- single-task: sampled-token OPD vs LSM on arithmetic.
* :mod:`~opd.lab.demos.agentic` -- ALFWorld games.
* :mod:`~opd.lab.demos.multitask` -- math and games in one student, a teacher per task.
* :mod:`~opd.lab.demos.parallel` -- a process per objective, the CPU threads shared out.
"""
