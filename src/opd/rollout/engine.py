"""The rollout-engine interface: what the trainer, the episode loop and the staleness worker ask of
whatever generates the student's rollouts, so none of them knows which engine it has.

An engine (:class:`RolloutEngine`) does three things:

* **generation** from prompt ids, one seed per prompt, with a token budget and sampling settings
  (temperature, top-k, top-p, or greedy): :meth:`~RolloutEngine.generate` returns a :class:`RolloutBatch`,
  the sampled ids with their log-probs under the *unmodified* policy (temperature 1, no top-p) and
  whether each ended with EOS;
* **episode sessions** (:meth:`~RolloutEngine.episodes`): conversations continued turn by turn. The
  session writes each episode's next turn (up to a cap, ending at EOS) and takes the environment's
  tokens after it; how it keeps the history is its own business -- opd's HF engine keeps its KV cache
  and one seeded stream of uniforms per episode (:mod:`opd.rollout.sampling`), a server engine sends
  the history again with each turn and relies on its prefix cache (:mod:`opd.rollout.served`). The
  multi-turn loop itself (chat format, games, limits, records) is written once, over sessions, in
  :mod:`opd.rollout.episodes`;
* **weight sync and the policy check behind it**: an engine that does not sample the trainer's own
  model object is told when the student's weights changed (:meth:`~RolloutEngine.weights_changed`, which
  the trainer calls after each update) and syncs them as its next rollout begins; it checks each batch it
  sampled against the student's own log-probs (:meth:`~RolloutEngine.check_policy`). Both come back with
  the batch (:class:`EngineReport`, ``RolloutBatch.report``): the policy check's gap and what the sync
  took. opd's HF engine samples the model itself and has nothing to sync or check (``None`` for both).

Engines are made by name through :mod:`opd.rollout.registry` (``--rollout-engine``) from an
:class:`EngineContext`. How a ``--max-staleness`` worker reaches an engine in another process, and who
brings it back when the worker finds it gone, is no part of this interface: :mod:`opd.rollout.reach`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from opd.config import EvalConfig, TrainConfig
from opd.errors import ServiceUnavailable, UserError
from opd.models.loading import model_device


@dataclass(frozen=True)
class EngineReport:
    """What an engine says of a batch it sampled, returned with it (:attr:`RolloutBatch.report`)."""

    policy_gap: float | None = None  # the policy check's gap, nats per sampled token; None: nothing checked
    sync_seconds: float | None = None  # giving the engine the weights (and waking it) as it began; None: no sync


NO_REPORT = EngineReport()


@dataclass
class RolloutBatch:
    """N rollouts: left-padded prompts of common length P followed by T response slots.

    ``response_mask_NT`` marks the real tokens of the response region (a prefix of each row: the
    region is compact, so positions and attention come from it); ``action_mask_NT`` the tokens the
    model sampled (EOS included), which are what trains and what the metrics measure. Left out, it
    is the response mask (a single-turn rollout). ``logprobs_NT`` is 0 outside the action mask.

    Shapes:
        input_ids_NL, attention_mask_NL: (N, P + T)
        response_ids_NT, response_mask_NT, logprobs_NT, action_mask_NT: (N, T)
        finished_N: (N,) -- an EOS was produced (episodes: the game ended the episode)

    ``report``: what the engine that sampled the batch says of it (the policy check, the weight sync).
    """

    input_ids_NL: torch.Tensor
    attention_mask_NL: torch.Tensor
    prompt_len: int
    response_ids_NT: torch.Tensor
    response_mask_NT: torch.Tensor
    logprobs_NT: torch.Tensor
    finished_N: torch.Tensor
    action_mask_NT: torch.Tensor | None = None
    report: EngineReport = NO_REPORT

    def __post_init__(self):
        if self.action_mask_NT is None:
            self.action_mask_NT = self.response_mask_NT

    @property
    def num_rollouts(self) -> int:
        return self.response_ids_NT.shape[0]

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        """A sub-batch (micro-batches for gradient accumulation)."""
        return RolloutBatch(
            self.input_ids_NL[rows],
            self.attention_mask_NL[rows],
            self.prompt_len,
            self.response_ids_NT[rows],
            self.response_mask_NT[rows],
            self.logprobs_NT[rows],
            self.finished_N[rows],
            cast(torch.Tensor, self.action_mask_NT)[rows],  # set by __post_init__
            self.report,
        )

    def narrow(self, width: int) -> RolloutBatch:
        """The first ``width`` response positions after the prompt's last token only (a padding
        micro-batch's: every layer runs, on a few tokens). Prompts are left-padded, so that token is real."""
        P = self.prompt_len
        return RolloutBatch(
            self.input_ids_NL[:, P - 1 : P + width],
            self.attention_mask_NL[:, P - 1 : P + width],
            1,
            self.response_ids_NT[:, :width],
            self.response_mask_NT[:, :width],
            self.logprobs_NT[:, :width],
            self.finished_N,
            cast(torch.Tensor, self.action_mask_NT)[:, :width],
            self.report,
        )


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: softmax(logits / temperature) cut to its ``top_k`` most probable tokens (0: all)
    and then to its top-p nucleus, or argmax."""

    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    top_k: int = 0


@dataclass
class Sample:
    """What an engine wrote for one prompt or one turn: the sampled ids, each one's log-prob under the
    unmodified policy, and whether it ended with EOS (the last id; else it ran out of tokens)."""

    ids: list[int]
    logprobs: list[float]
    eos: bool


# A session's report of finished turns: [(episode, what it wrote), ...].
Written = Callable[[list[tuple[int, Sample]]], None]


@dataclass
class EngineContext:
    """What an engine factory is given (:mod:`opd.rollout.registry`).

    ``model``: the student whose policy it samples (the trainer's, or the staleness worker's copy), loaded
    from ``model_dir``; ``cfg``: the run's config, whose engine options it reads, and ``task_cfgs`` each
    task's (a multi-task run: the longest prompt plus response is any task's); ``folder``: its files in the
    run directory (a server's log, synced weights), made only when used; ``world``: the launch's ranks.
    ``attach``: set in a staleness worker, the address the owner's engine gave (:mod:`opd.rollout.reach`):
    reach that engine instead of starting one."""

    model: Any
    tokenizer: Any
    cfg: TrainConfig | EvalConfig
    model_dir: str = ""
    task_cfgs: Sequence[TrainConfig] = ()
    folder: Path = field(default_factory=Path)
    world: int = 1
    attach: Any = None


class EngineUnavailable(ServiceUnavailable):
    """The rollout engine stopped answering and could not be brought back: the trainer checkpoints the
    last completed step and stops."""


class EpisodeSession(Protocol):
    """Conversations an engine continues turn by turn; episode ``i`` started from ``prompts[i]``.
    ``sync_seconds``: what giving the engine the weights took as the session began (None: no sync), for
    the played batch's :class:`EngineReport`."""

    sync_seconds: float | None

    def turn(self, caps: dict[int, int], written: Written) -> None:
        """Each episode of ``caps`` writes its next turn: up to ``caps[i]`` tokens, ending at EOS (a cap of 0
        writes nothing). ``written`` is called with turns as they finish, possibly several times, every
        episode of ``caps`` once by the return; the games step on those while the other turns are written."""

    def extend(self, tokens: dict[int, list[int]]) -> None:
        """Tokens that follow an episode's last turn (the environment's reply), before its next turn."""

    def end(self, episodes: Iterable[int]) -> None:
        """These episodes ended: they write no more turns (their state may be freed)."""

    def close(self) -> None:
        """The episodes are over."""


class RolloutEngine(Protocol):
    """What the trainer needs from a generation backend (see the module docstring)."""

    name: str  # its registry name, in errors and logs
    eos_id: int
    pad_id: int
    max_context: int | None  # positions a prompt plus its response may take (None: unknown)

    @property
    def device(self) -> torch.device: ...

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        top_k: int = 0,
    ) -> RolloutBatch:
        """The rollouts, with the engine's :class:`EngineReport` of them (``report``)."""

    def episodes(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, budget: int, sampling: Sampling
    ) -> EpisodeSession:
        """A session of ``len(prompts)`` episodes, each with its seed and ``budget`` tokens of response
        region (its turns and replies together)."""

    def check_policy(self, batch: RolloutBatch) -> float | None:
        """The policy check on a batch this engine sampled (episodes: once played): the gap, nats per sampled
        token (None: nothing to check); past the engine's bound, a UserError."""

    def weights_changed(self) -> None:
        """The student's weights changed (the trainer calls it after each update): the next rollout syncs
        them first. An engine syncs then, before its first rollout, and where it lost its weights: a
        restarted server, or one put to sleep at level 2 (``--vllm-sleep 2``) after each rollout."""

    def close(self) -> None: ...


class EngineBase:
    """Defaults for an engine that samples the trainer's own model object: nothing to sync or check,
    nothing to close. Engines override what they do."""

    name = "engine"
    model: Any

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def check_policy(self, batch: RolloutBatch) -> float | None:
        return None

    def weights_changed(self) -> None:
        return None

    def close(self) -> None:
        return None


def check_count(engine: str, got: int, asked: int, what: str = "prompts") -> None:
    """A UserError naming the engine when it answered another number of sequences than it was asked for."""
    if got != asked:
        raise UserError(
            f"the rollout engine {engine!r} returned {got} sequences for {asked} {what}; an engine must answer "
            "every prompt, in order (a bug in the engine: check its generate() or complete())"
        )


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to one length: (ids_NP, mask_NP)."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise UserError("empty prompt: every prompt must have at least one token")
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(prompt_ids), P), dtype=torch.long, device="cpu")
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p) :] = torch.as_tensor(list(p), dtype=torch.long, device="cpu")
        mask[i, P - len(p) :] = 1
    return ids, mask


def check_sampling(max_new_tokens: int, temperature: float, greedy: bool) -> None:
    """ValueError for a token budget or temperature no sampler can use."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0; pass greedy=True for argmax decoding")


def check_context(prompt_len: int, max_new_tokens: int, max_context: int | None, fix: str) -> None:
    """UserError when the longest prompt plus the token budget cannot fit the model's positions."""
    if max_context and prompt_len + max_new_tokens > max_context:
        raise UserError(
            f"a prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} exceeds the model's context of "
            f"{max_context} positions; {fix}"
        )
