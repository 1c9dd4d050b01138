"""How a ``--max-staleness`` worker (:mod:`opd.training.ahead`) reaches the trainer's rollout engine from
a process of its own, and who brings the engine back when the worker finds it gone.

None of this is part of the engine interface (:mod:`opd.rollout.engine`): an engine that only rolls
out implements none of it, and the worker makes its own of it (by its registry name, on the worker's
copy of the student). An engine that lives outside the trainer (a server) and should be *reached*
rather than made again implements :class:`Reachable`: :meth:`~Reachable.handle` says how to reach it
(the factory is given it as ``EngineContext.attach`` in the worker), and :meth:`~Reachable.recover`
is its owner's restart policy, which the worker's requests come back to (:class:`EngineDown`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from opd.errors import ServiceUnavailable
from opd.rollout.engine import EngineUnavailable, RolloutEngine


@dataclass(frozen=True)
class EngineHandle:
    """How another process reaches an engine: its registry name and what its factory needs to attach
    (picklable: it travels to the staleness worker with every request; None: make one of its own)."""

    name: str
    address: Any = None


class EngineDown(ServiceUnavailable):
    """A staleness worker's engine got no answer: the engine's owner (the trainer) restarts it or waits
    for it (:meth:`Reachable.recover`) and sends the request again."""


@runtime_checkable
class Reachable(Protocol):
    """An engine a staleness worker reaches rather than makes again (see the module docstring)."""

    def handle(self) -> EngineHandle: ...

    def recover(self, down: EngineDown) -> None:
        """A worker found this engine gone: bring it back (its handle may change), or raise EngineUnavailable."""


def handle_of(engine: RolloutEngine) -> EngineHandle:
    """How a worker reaches ``engine``: its own handle, or its name alone (the worker makes its own)."""
    return engine.handle() if isinstance(engine, Reachable) else EngineHandle(engine.name)


def bring_back(engine: RolloutEngine, down: EngineDown) -> None:
    """``engine``'s owner brings it back for a worker that found it gone; EngineUnavailable where it cannot."""
    if not isinstance(engine, Reachable):
        raise EngineUnavailable(f"the rollout engine {engine.name!r} cannot be brought back ({down})")
    engine.recover(down)
