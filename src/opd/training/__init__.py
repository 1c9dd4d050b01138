"""Training: the OPD loop and what it is made of.

* :mod:`~opd.training.loop` -- ``opd train``: rollout -> score -> loss -> update -> log/eval/ckpt.
* :mod:`~opd.training.loss` -- the update stage's loss: the objective (:mod:`opd.objectives`) on a
  micro-batch, the loss mask and the reduction over the global batch.
* :mod:`~opd.training.stepstats` -- a step's metrics and rollout records.
* :mod:`~opd.training.schedule` -- multi-task runs: which task trains at which step.
* :mod:`~opd.training.distributed` -- DDP and FSDP under torchrun or accelerate.
* :mod:`~opd.training.optim` -- the optimizer and its schedule.
* :mod:`~opd.training.sft` -- ``opd sft``: supervised fine-tuning and the off-policy cold start;
  :mod:`~opd.training.cloning`, its behaviour-cloning data from a game's expert.
"""
