"""Run by tests/training/test_rollout_engines.py under torchrun: ``opd train`` (the command line given) with
a registered engine, ``dies``, that is opd's own sampler on every rank but one: rank 1's answers steps 0
and 1 (and every greedy evaluation request), then stays unreachable (EngineUnavailable, as a vLLM server that died and could not be brought back).

Usage: python engine_dies.py train --rollout-engine dies ...
"""

from __future__ import annotations

import os

from opd.cli import main
from opd.rollout import registry
from opd.rollout.engine import EngineUnavailable
from opd.rollout.sampling import HFRollout, start_hf


class DiesOnRank1(HFRollout):
    name = "dies"
    calls = 0

    def generate(self, *args, greedy=False, **kw):
        if not greedy:  # a training step's rollouts; the evaluation's greedy pass goes through the engine too
            type(self).calls += 1
            if os.environ.get("RANK") == "1" and self.calls > 2:
                raise EngineUnavailable("the rollout engine of rank 1 died (connection refused)")
        return super().generate(*args, greedy=greedy, **kw)


registry.register(
    "dies", lambda ctx: DiesOnRank1(start_hf(ctx).model, ctx.tokenizer.eos_token_id, ctx.tokenizer.pad_token_id)
)

if __name__ == "__main__":
    main()
