"""The rollout engines by name (``opd train --rollout-engine NAME``): one entry per engine, a factory
that makes it from an :class:`~opd.rollout.engine.EngineContext`.

The trainer, its staleness worker and the episode loop reach engines only through here and the
interface in :mod:`opd.rollout.engine` (``training/`` imports no engine module: an import-linter
contract). Adding an engine is one module and one entry (docs/architecture.md, "Adding a rollout
engine"): an entry in :data:`ENGINES` below, or :func:`register` from your own code, which makes the
name an ``opd train --rollout-engine`` choice in that process.
"""

from __future__ import annotations

from collections.abc import Callable

from opd.errors import UserError
from opd.rollout.engine import EngineContext, RolloutEngine
from opd.rollout.sampling import HFRollout, start_hf
from opd.rollout.vllm_engine import start_vllm

EngineFactory = Callable[[EngineContext], RolloutEngine]

ENGINES: dict[str, EngineFactory] = {
    "hf": start_hf,  # opd's own sampling loop on the student (the default)
    "vllm": start_vllm,  # a vLLM server given the student's weights (opd vllm-setup)
}


def register(name: str, factory: EngineFactory) -> None:
    """Make ``factory`` the engine ``name``. A name already taken is refused (an engine replaced by a
    typo would go unnoticed). An engine registered at run time is known in this process only: a
    ``--max-staleness`` worker (a process of its own) finds the built-in ones and those its imports register."""
    if name in ENGINES:
        raise ValueError(f"a rollout engine named {name!r} is already registered")
    ENGINES[name] = factory


def check_engine(name: str) -> None:
    """A UserError listing the registered engines when ``name`` is not one of them."""
    if name not in ENGINES:
        raise UserError(
            f"rollout_engine={name!r} is not a registered rollout engine; choose one of {', '.join(ENGINES)} "
            "(or register yours with opd.rollout.registry.register)"
        )


def make_engine(name: str, ctx: EngineContext) -> RolloutEngine:
    """The engine ``name`` made from ``ctx`` (a staleness worker's ``ctx.attach``: reaching the owner's)."""
    check_engine(name)
    return ENGINES[name](ctx)


def local_engine(model, tokenizer) -> RolloutEngine:
    """The engine that samples ``model`` in this process (opd's own loop): what evaluation and SFT's
    teacher sampling use, whatever ``--rollout-engine`` a run trains with."""
    return HFRollout(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
