"""Teachers: what scores every position of the student's rollouts.

* :mod:`~opd.teachers.scoring` -- the :class:`~opd.teachers.scoring.TeacherScorer` protocol, its scores,
  and :class:`~opd.teachers.scoring.HFTeacher`, the in-process default.
* :mod:`~opd.teachers.sharded` -- the in-process teacher sharded across the ranks by FSDP (``--fsdp``).
* :mod:`~opd.teachers.client` -- a served teacher (``--teacher-url``): vLLM's ``prompt_logprobs``
  format, waiting out a server's restart.
* :mod:`~opd.teachers.crosstok` -- a teacher with another tokenizer, scored in the student's frame.
* :mod:`~opd.teachers.server` -- ``opd serve-teacher``: the app and its API keys (:mod:`~opd.teachers.app`),
  the batched forward passes (:mod:`~opd.teachers.batching`), vLLM's request and answer format
  (:mod:`~opd.teachers.completions`) and opd's binary answer (:mod:`~opd.teachers.wire`).
* :mod:`~opd.teachers.factory` -- :func:`~opd.teachers.factory.make_teacher`, the one module that
  imports every backend (each backend imports only the protocol).
"""
