"""Multi-turn episodes from the vLLM rollout engine (``opd train --env ... --rollout-engine vllm``).

:class:`VLLMEpisodeRollout` plays episodes as :class:`~opd.rollout.episodes.EpisodeRollout` does --
the same prompts, replies, limits, records and batch, so scoring and the losses take its episodes
unchanged -- but each turn of each episode is one completions request to the engine of a
:class:`~opd.rollout.vllm_engine.VLLMRollout`, whose prompt is the episode's text so far (its prompt,
earlier turns and the games' replies). vLLM's prefix cache stands in for opd's KV continuation: the
turns before are not recomputed (the cache is reset at every weight sync, so it never holds keys of
old weights). A turn stops at the end-of-turn token or at its cap (``max_action_tokens``, or what is
left of the episode's budget), as in opd's loop.

Each turn draws with its own seed (the episode's seed and the turn's number), so an episode's
sampling does not depend on the others' in the batch; vLLM's numbers still do (see
:mod:`opd.rollout.vllm_engine`). The policy check runs once per batch, on the sampled tokens of every
turn (replies are not the policy's and are not checked).
"""

from __future__ import annotations

from opd.rollout.episodes import EpisodeRollout, Episodes
from opd.rollout.vllm_engine import VLLMRollout

TURN_SEED_STRIDE = 1_000_003  # a prime: the seeds of (episode seed, turn) pairs do not collide for turns below it


class VLLMEpisodeRollout(EpisodeRollout):
    """Episodes whose turns the vLLM engine writes (see the module's docstring)."""

    def __init__(self, engine: VLLMRollout, tokenizer):
        super().__init__(engine.model, tokenizer)
        self.engine = engine

    @property
    def last_gap(self) -> float:
        return self.engine.last_gap

    def play(self, env, games, seeds, **limits) -> Episodes:
        self.engine.begin()
        played = super().play(env, games, seeds, **limits)
        self.engine.check_policy(played.batch)
        return played

    def _play(self, episodes, games_of, seeds, limits, sampling) -> None:
        budget, max_action_tokens, max_turns = limits
        how = self.engine.sampling(*sampling)
        for turn in range(max_turns):
            playing = [i for i, e in enumerate(episodes) if e.playing]
            if not playing:
                return
            caps = {i: min(max_action_tokens, budget - len(episodes[i].tokens)) for i in playing}
            asked = [i for i in playing if caps[i] > 0]
            payloads = [
                self.engine.payload(
                    episodes[i].prompt + episodes[i].tokens,
                    (seeds[i] * TURN_SEED_STRIDE + turn) % 2**63,
                    caps[i],
                    how,
                )
                for i in asked
            ]
            written = dict(zip(asked, map(self.engine.cut_at_eos, self.engine.complete(payloads)), strict=True))
            sent = {}
            for i in playing:  # an episode with no room left writes an empty turn, which ends it (budget)
                ids, lps, eos = written.get(i, ([], [], False))
                if self._played(episodes[i], ids, lps, eos, budget):
                    games_of.step(i, episodes[i].record.actions[-1])
                    sent[i] = eos
            games_of.send()
            answers = games_of.results()
            for i, eos in sent.items():
                self._answered(episodes[i], answers[i], eos, budget, max_turns)

    def close(self) -> None:
        self.engine.close()
