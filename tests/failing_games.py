"""Toy games that fail on purpose, for tests/envs/test_env_workers.py: a module of its own so that an
env worker process imports it (and nothing heavier) to unpickle them."""

from __future__ import annotations

import os
import signal
import time

from opd.envs import EnvError
from opd.envs.toy import ToyEnv, ToySession


class Failing(ToySession):
    """A toy session that fails at its ``at``-th step, the way ``how`` says."""

    def __init__(self, seed: int, rooms: int, at: int, how: str):
        self.at, self.how, self.steps = at, how, 0
        super().__init__(seed, rooms)

    def reset(self) -> str:
        if self.how == "load" and getattr(self, "place", None) is not None:
            raise EnvError("game file failed to load")
        return super().reset()

    def step(self, action: str):
        self.steps += 1
        if self.steps == self.at:
            if self.how == "error":
                raise EnvError("engine crashed")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(3600)
        return super().step(action)


class FailingToy(ToyEnv):
    """The toy environment, with the games named in ``failures`` failing: {game id: (step, how)}."""

    def __init__(self, failures: dict[str, tuple[int, str]], **kw):
        super().__init__(**kw)
        self.failures = failures

    def open(self, game):
        if game.id not in self.failures:
            return super().open(game)
        at, how = self.failures[game.id]
        return Failing(int(game.info["seed"]), self.rooms, at, how)


class NoEngine(ToyEnv):
    """Pickles, but cannot be loaded where its engine is missing (every worker, here)."""

    def __reduce__(self):
        return (__import__, ("opd_engine_that_is_not_installed",))
