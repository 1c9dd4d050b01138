"""Run by tests/training/test_distributed.py: the demo student evaluated on held-out prompts and on games
(sums to answer, a turn an answer) as training evaluates them (the sources' ``evaluate``), each rank of a torchrun launch its share
(:mod:`opd.evaluation.sharing`), or everything in one process (run without a launcher). Each rank writes
its figures to ``OUT/figures<rank>.json``.

Usage: python shared_eval.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import opd
from opd.config import TrainConfig
from opd.envs import Game, StepResult, register_env
from opd.evaluation.sharing import Share
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.registry import local_engine
from opd.training.distributed import init_distributed, shutdown
from opd.training.sources import eval_plan, held_out, task_data

DEMO = Path(opd.__file__).parent / "assets" / "demo"
COMMON = dict(student=str(DEMO / "student"), teacher=str(DEMO / "teacher"), device="cpu", eval_samples=2)
PROMPTS = dict(eval_size=12, max_new_tokens=40, temperature=1.5)
GAMES = dict(env="sums", env_workers=0, eval_size=6, max_new_tokens=120, max_action_tokens=24, max_turns=3)


class Sums:
    """Each game is an arithmetic prompt, won by an action that holds its answer, within 3 turns."""

    name, system_prompt, max_turns = "sums", "", 3

    def __init__(self, level: int = 1):
        from opd.rollout.prompt_set import load_task

        self.examples = load_task("arithmetic").examples("test")[20:26]  # not the prompt set's (its first 12)

    def games(self, split):
        return [Game(id=f"{split}-{i}", goal=e.prompt, info={"answer": e.answer}) for i, e in enumerate(self.examples)]

    def open(self, game):
        answer = game.info["answer"]

        class Session:
            def reset(self):
                return game.goal

            def step(self, action):
                won = answer in action
                return StepResult("Right." if won else "Try again.", float(won), won, won)

            def admissible_commands(self):
                return None

            def expert_actions(self):
                return None

            def close(self):
                pass

        return Session()


register_env("sums", Sums)


def main(out: Path) -> None:
    dist = init_distributed()
    share = Share(dist.rank, dist.world, dist.gather)
    model, tok = load_model(DEMO / "student", "student").eval(), load_tokenizer(DEMO / "student", "student")
    figures = {}
    for name, options in (("prompts", PROMPTS), ("games", GAMES)):
        cfg = TrainConfig.from_flat(**COMMON, **options)
        source = held_out(cfg, tok, task_data(cfg)[1])
        plan = eval_plan(cfg, seed=3, share=share)
        figures[name] = source.evaluate(local_engine(model, tok), tok, cfg, plan).figures
        source.close()
    (out / f"figures{dist.rank}.json").write_text(json.dumps(figures, sort_keys=True))
    shutdown(dist)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
