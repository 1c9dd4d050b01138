"""``opd plan``: the memory of a training run on each GPU, from its options and the models' configs alone
(:mod:`opd.planning.memory` the parts, :mod:`opd.planning.shapes` the models' shapes on the meta device,
:mod:`opd.planning.advice` the verdict and the change that fits)."""
