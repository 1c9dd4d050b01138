"""Engines that answer whole requests, as a server does: the base of the vLLM engine
(:mod:`opd.rollout.vllm_engine`) and of any engine added the same way (docs/architecture.md).

A :class:`ServerEngine` implements one method, :meth:`~ServerEngine.complete`: each :class:`Request`
(a prompt's ids, a seed, a token budget, the sampling) answered with the ids it sampled and their
log-probs under the unmodified policy. Engines that hold a copy of the weights of their own also
implement :meth:`~ServerEngine.sync`. The base makes the rest of :class:`~opd.rollout.engine.RolloutEngine`
of it:

* single-turn batches (:meth:`~ServerEngine.generate`), each response cut after its first EOS, laid out
  as opd's own sampler lays them out;
* episode sessions (:class:`HistorySession`): each turn of each episode is one request whose prompt is
  the episode so far (its prompt, earlier turns and the environment's replies); the server's prefix
  cache stands in for opd's KV continuation. Turn k of an episode draws with the seed
  ``(episode seed * TURN_SEED_STRIDE + k) mod 2**63``, so an episode's sampling does not depend on the
  others' in the batch (a server's numbers may still: vLLM's depend on which requests run together);
* the weights: synced as a rollout begins when the student changed since the last sync (the trainer says
  so after each update, :meth:`~ServerEngine.weights_changed`; and before the first rollout), the sync's
  seconds reported with the batch (``RolloutBatch.report``);
* sleeping between rollouts (:class:`SleepMode`, vLLM's sleep mode, ``--vllm-sleep``): an engine that shares
  a GPU with the trainer gives its memory back when a rollout's requests are answered (:meth:`~ServerEngine.end`)
  and takes it again as the next rollout begins, before the weights are synced into it;
* **the policy check**: an engine could serve other weights than the trainer's (a failed or skipped
  sync, another dtype, a kernel bug) and nothing else would fail: the run would train on another
  policy's samples. So after each rollout the student scores the sampled tokens itself (one forward
  pass without gradients); the mean absolute gap between the two log-probs per sampled token is the
  batch's ``report.policy_gap`` (logged as ``rollout/engine_logprob_gap``), and past ``max_gap`` the run
  stops with an error. Replies of the environment are not the policy's and are not checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from opd.errors import UserError
from opd.losses import topk_and_gather_from_hidden
from opd.models.head import model_head
from opd.rollout.engine import (
    EngineBase,
    EngineReport,
    RolloutBatch,
    Sample,
    Sampling,
    Written,
    check_count,
    check_sampling,
)
from opd.rollout.forward import response_hidden

TURN_SEED_STRIDE = 1_000_003  # a prime: the seeds of (episode seed, turn) pairs do not collide for turns below it


@dataclass
class Request:
    """One completion to write: after ``prompt``, at most ``max_tokens`` tokens, stopping at EOS."""

    prompt: list[int]
    seed: int
    max_tokens: int
    sampling: Sampling


class ServerEngine(EngineBase):
    """The base of engines that complete whole requests (see the module docstring). ``model``: the
    student, whose log-probs the policy check compares with the engine's; ``max_gap``: the check's bound,
    set by the option ``gap_option`` (named in its error)."""

    name = "server"
    gap_option = "max_gap"

    def __init__(self, model, eos_id: int, pad_id: int, *, max_gap: float = 1e-3, max_context: int | None = None):
        self.model, self.eos_id, self.pad_id, self.max_gap = model, eos_id, pad_id, max_gap
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None)
        self.stale = True  # the weights changed since the last sync (or none ran yet)
        self.sleep_mode: SleepMode | None = None  # set by an engine that sleeps between rollouts
        self.request_failed = False  # a request of this rollout failed: the engine is not put to sleep

    # ------------------------------------------------------------------ what an engine implements
    def complete(self, requests: list[Request]) -> list[Sample]:
        """Each request's sampled ids and their log-probs (``eos`` is recomputed: the base cuts each
        answer after its first EOS), in the requests' order."""
        raise NotImplementedError(f"the rollout engine {self.name!r} does not implement complete()")

    def sync(self) -> None:
        """The student's current weights into the engine (an engine that samples ``model`` itself has none to sync)."""
        return None

    # ------------------------------------------------------------------ weights
    def weights_changed(self) -> None:
        """Synced as the next rollout begins, once: the tasks of a multi-task step share one sync (but for
        ``--vllm-sleep 2``, whose sleep drops the weights after each rollout: each task syncs again)."""
        self.stale = True

    # The engine's rollout cycle: begin (wake, sync) ... requests ... end (sleep). One place, so that a
    # later trigger of the sync moves the sleeping with it.
    def begin(self) -> float:
        """A rollout starts: the engine is given the current weights when they changed since its last sync,
        after it wakes when it sleeps between rollouts; returns the seconds both took (the batch's
        ``sync_seconds``). Here, where every rank's rollout starts, rather than at its first request: an
        engine that several ranks share syncs collectively."""
        self.request_failed = False
        t0 = time.perf_counter()
        if self.sleep_mode is not None:
            self.sleep_mode.wake(self._sync_if_stale)
        else:
            self._sync_if_stale()
        return time.perf_counter() - t0

    def end(self) -> None:
        """A rollout's requests are all answered: an engine that sleeps between rollouts goes to sleep (one
        that drops its weights asleep is given them again at its next :meth:`begin`). Not after a failed
        request: the run stops on that error, which a failed ``/sleep`` would replace, and an engine that
        died (restarted when it is next asked) is not woken only to be put to sleep."""
        if self.sleep_mode is not None and not self.request_failed and self.sleep_mode.sleep():
            self.stale = True

    def _sync_if_stale(self) -> None:
        if self.stale:
            self.sync()
            self.stale = False

    def answer(self, requests: list[Request]) -> list[Sample]:
        """Each request's sample, cut after its first EOS (the rollout began: the engine has the weights)."""
        if not requests:
            return []
        try:
            samples = self.complete(requests)
            check_count(self.name, len(samples), len(requests))
            return [self._cut(s, r.max_tokens) for s, r in zip(samples, requests, strict=True)]
        except BaseException:
            self.request_failed = True
            raise

    def _cut(self, sample: Sample, max_tokens: int) -> Sample:
        ids, lps = [int(t) for t in sample.ids], [float(x) for x in sample.logprobs]
        if len(ids) != len(lps) or len(ids) > max_tokens:
            raise UserError(
                f"the rollout engine {self.name!r} returned {len(ids)} tokens and {len(lps)} log-probs for a request "
                f"of at most {max_tokens} tokens; it must return one log-prob per sampled token, within the budget"
            )
        if self.eos_id in ids:
            end = ids.index(self.eos_id) + 1
            return Sample(ids[:end], lps[:end], True)
        return Sample(ids, lps, False)

    # ------------------------------------------------------------------ rollouts
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
        """Single-turn rollouts of the student's current weights, checked against it (the policy check)."""
        if len(seeds) != len(prompt_ids):
            raise ValueError("one seed per prompt is required")
        check_sampling(max_new_tokens, temperature, greedy)
        synced = self.begin()
        how = Sampling(temperature, top_p, greedy, top_k)
        try:
            samples = self.answer([Request(list(p), int(s), max_new_tokens, how) for p, s in zip(prompt_ids, seeds)])
        finally:
            self.end()
        batch = single_turn_batch(prompt_ids, samples, self.pad_id, self.device)
        batch.report = EngineReport(self.check_policy(batch), synced)
        return batch

    def episodes(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, budget: int, sampling: Sampling
    ) -> HistorySession:
        synced = self.begin()
        return HistorySession(self, prompts, seeds, sampling, synced)

    @torch.no_grad()
    def check_policy(self, batch: RolloutBatch) -> float:
        """The engine's log-probs of the sampled tokens against the student's own (see the module docstring):
        their mean absolute gap per sampled token, refused past ``max_gap``."""
        # The forward goes by chunks of rows (response_hidden) and the head by chunks of the sampled
        # positions only: no stage holds (rows x length x vocabulary) logits.
        at_A = cast(torch.Tensor, batch.action_mask_NT)  # set by RolloutBatch.__post_init__
        h_AD = response_hidden(self.model, batch)[at_A]
        _, _, ours_A1 = topk_and_gather_from_hidden(
            h_AD[None], model_head(self.model), 1, batch.response_ids_NT[at_A].view(1, -1, 1)
        )
        gap = (ours_A1[0, :, 0].float() - batch.logprobs_NT[at_A].float()).abs()
        policy_gap = float(gap.mean()) if gap.numel() else 0.0
        if policy_gap > self.max_gap:
            raise UserError(
                f"the rollout engine {self.name!r} does not serve the policy being trained: its log-probs of the "
                f"sampled tokens differ from the student's by {policy_gap:.3g} nats on average (largest "
                f"{float(gap.max()):.3g}; {self.gap_option} {self.max_gap:g}); the weight sync failed, or the engine "
                f"runs another dtype or model: check its log, or raise {self.gap_option} for a lower-precision engine"
            )
        return policy_gap


class HistorySession:
    """Episodes continued by a :class:`ServerEngine`: every turn one request holding the episode so far."""

    def __init__(
        self,
        engine: ServerEngine,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        sampling: Sampling,
        sync_seconds: float | None = None,
    ):
        self.engine, self.sampling, self.sync_seconds = engine, sampling, sync_seconds
        self.history = [list(p) for p in prompts]
        self.seeds = [int(s) for s in seeds]
        self.turns = 0

    def turn(self, caps: dict[int, int], written: Written) -> None:
        asked = [i for i in sorted(caps) if caps[i] > 0]  # an episode with no room left writes an empty turn
        seed = lambda i: (self.seeds[i] * TURN_SEED_STRIDE + self.turns) % 2**63
        requests = [Request(self.history[i], seed(i), caps[i], self.sampling) for i in asked]
        answers = dict(zip(asked, self.engine.answer(requests), strict=True))
        self.turns += 1
        done = [(i, answers.get(i, Sample([], [], False))) for i in sorted(caps)]
        for i, sample in done:
            self.history[i] += sample.ids
        written(done)

    def extend(self, tokens: dict[int, list[int]]) -> None:
        for i, ids in tokens.items():
            self.history[i] += ids

    def end(self, episodes: Iterable[int]) -> None:
        return None

    def close(self) -> None:
        self.engine.end()


class SleepMode:
    """vLLM's sleep mode between rollouts (``--vllm-sleep LEVEL``), for an engine that shares its GPU with a
    trainer: after its rollout the engine frees its memory for the trainer's step, and takes it again as
    the next rollout begins. ``post(path)``: one POST to the engine (its dev-mode endpoints ``/sleep`` and
    ``/wake_up``, which vLLM opens with ``VLLM_SERVER_DEV_MODE=1`` on a server started with
    ``--enable-sleep-mode``; GPUs only).

    Level 1 keeps a copy of the weights in CPU memory and drops the KV cache: woken, the engine has its
    weights back. Level 2 drops both: woken, it holds no weights until the sync writes them, so the sync
    runs between waking the weights' memory and the KV cache's, and the cache is not yet allocated while
    the weights load (as TRL wakes its colocated engine)."""

    def __init__(self, level: int, post: Callable[[str], Any]):
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} must be 1 or 2")
        self.level, self.post = level, post
        self.asleep = False

    def sleep(self) -> bool:
        """Put the engine to sleep; whether its weights are gone (level 2)."""
        self.post(f"/sleep?level={self.level}")
        self.asleep = True
        return self.level == 2

    def wake(self, sync: Callable[[], None]) -> None:
        """Wake the engine (when asleep) and run ``sync``, the weights' sync, where the level needs it."""
        if not self.asleep:
            sync()
            return
        if self.level == 2:
            self.post("/wake_up?tags=weights")
            sync()
            self.post("/wake_up?tags=kv_cache")
        else:
            self.post("/wake_up")
            sync()
        self.asleep = False


def single_turn_batch(
    prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sample], pad_id: int, device: torch.device
) -> RolloutBatch:
    """Left-padded prompts and their responses, as opd's own sampler lays them out."""
    N, P = len(prompt_ids), max(len(p) for p in prompt_ids)
    T = max(1, max(len(s.ids) for s in samples))
    input_NL = torch.full((N, P + T), pad_id, dtype=torch.long)
    attn_NL = torch.zeros((N, P + T), dtype=torch.long)
    mask_NT, lp_NT = torch.zeros((N, T), dtype=torch.bool), torch.zeros((N, T))
    for n, (p, s) in enumerate(zip(prompt_ids, samples, strict=True)):
        input_NL[n, P - len(p) : P] = torch.as_tensor(list(p))
        attn_NL[n, P - len(p) : P + len(s.ids)] = 1
        input_NL[n, P : P + len(s.ids)] = torch.as_tensor(s.ids, dtype=torch.long)
        mask_NT[n, : len(s.ids)] = True
        lp_NT[n, : len(s.ids)] = torch.as_tensor(s.logprobs)
    finished_N = torch.tensor([s.eos for s in samples])
    return RolloutBatch(
        input_NL.to(device),
        attn_NL.to(device),
        P,
        input_NL[:, P:].to(device),
        mask_NT.to(device),
        lp_NT.to(device),
        finished_N.to(device),
    )
