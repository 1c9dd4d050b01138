"""Multi-turn environments for agentic OPD (see :mod:`opd.envs.environment` for the protocol).

``get_env("alfworld", ...)`` builds the default agentic environment (ALFWorld's engine on
generated household games, or the real ALFWorld games under ``ALFWORLD_DATA``);
``get_env("textworld", ...)`` TextWorld's own generated games (tw-cooking); ``get_env("toy")`` a
tiny pure-Python game, for tests and as a template for your own environment.
"""

from typing import Any

from opd.envs.environment import (
    ENV_SPLITS,
    EnvError,
    Environment,
    Game,
    GameSession,
    StepResult,
    env_names,
    get_env,
    normal_command,
    register_env,
)


# Imports inside the factories: the engines (alfworld, textworld) are optional and slow to import.
def _make_alfworld(**kwargs: Any) -> Environment:
    from opd.envs.alfworld import make_alfworld

    return make_alfworld(**kwargs)


def _make_textworld(**kwargs: Any) -> Environment:
    from opd.envs.textworld_games import make_textworld

    return make_textworld(**kwargs)


def _make_toy(**kwargs: Any) -> Environment:
    from opd.envs.toy import ToyEnv

    return ToyEnv(**kwargs)


register_env("alfworld", _make_alfworld)
register_env("textworld", _make_textworld)
register_env("toy", _make_toy)

__all__ = [
    "ENV_SPLITS",
    "EnvError",
    "Environment",
    "Game",
    "GameSession",
    "StepResult",
    "env_names",
    "get_env",
    "normal_command",
    "register_env",
]
