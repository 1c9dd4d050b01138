"""Multi-turn episodes: the student plays text games turn by turn.

:class:`EpisodeRollout` plays a batch of episodes (one :class:`~opd.envs.GameSession` each) with
a rollout engine (a Hugging Face causal LM's, by default) and returns an :class:`Episodes`: a
:class:`~opd.rollout.engine.RolloutBatch` that teacher scoring (in-process and served),
``response_hidden`` and the losses take unchanged, and one :class:`EpisodeRecord` per episode
(actions, observations, rewards, how it ended)::

    from opd.envs import get_env
    env = get_env("toy")
    engine = EpisodeRollout(model, tokenizer)
    eps = engine.play(env, env.games("train")[:8], seeds=range(8), max_new_tokens=512, max_action_tokens=32)
    eps.batch.action_mask_NT        # what trains: the tokens the model sampled
    eps.records[0].won, eps.records[0].actions

Episode format (replayable with plain transformers: encode each piece with
``tokenizer(text, add_special_tokens=False)`` and concatenate)

* prompt: ``tokenizer.apply_chat_template([{"role": "system", "content": env.system_prompt},
  {"role": "user", "content": first_observation}], add_generation_prompt=True, tokenize=False)``;
* each assistant turn: the tokens the model sampled, ending with the end-of-turn token (EOS,
  ``<|im_end|>`` in opd's tokenizer) -- or without it when the turn reached
  ``max_action_tokens``; the action sent to the game is their text decoded with
  ``skip_special_tokens=True`` and stripped;
* after each turn but the last, the environment's reply as the chat template renders it, minus
  the EOS the model already wrote: for opd's template
  ``"\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n"``; after a turn cut
  at ``max_action_tokens`` the template's whole closing (``"<|im_end|>\\n"`` first) is context too.

The reply is derived from the tokenizer's own chat template (:class:`ChatFormat`: the
conversation rendered with and without the new user turn, the difference taken), so other
templates (Qwen's) work the same; one that lacks the roles or re-renders earlier turns when a
turn is added is refused with a UserError. The response region of the batch holds the turns and
replies back to back (compacted), so positions and attention are those of the plain text.

Limits: ``max_turns`` actions (the env's by default); ``max_action_tokens`` per turn; and
``max_new_tokens``, the episode's budget for its whole response region: an episode that cannot
fit the next reply plus one action token ends (truncated), and an action cut by the budget is not
played. Each episode draws one uniform per sampled token from a generator seeded by its own seed
(:func:`opd.rollout.sampling.prompt_uniforms`, the HF engine), so it plays the same whatever batch or
rank it lands in.

The loop is written once, over an engine's episode session (:class:`opd.rollout.engine.EpisodeSession`):
the session writes the turns and takes the replies; how it keeps each episode's history is the
engine's. opd's HF engine (the default, and what ``EpisodeRollout(model, tokenizer)`` plays with)
never re-encodes its KV cache (:class:`opd.rollout.sampling.HFSession`); a server engine sends each
episode's text so far as one request a turn (:class:`opd.rollout.served.HistorySession`). An engine
that checks its policy (:meth:`opd.rollout.engine.RolloutEngine.check_policy`) checks the played batch,
whose ``report`` says so (and what the engine's weight sync took as the session began).

The games run where the environment says (:func:`opd.envs.workers.sessions`): in this process,
or in worker processes for an :class:`opd.envs.workers.EnvWorkers` (``--env-workers``). Either
way an action goes to its game as soon as its row's turn ends, so the games step while the other
rows still write; the turn's replies are fed together once every game has answered, which keeps
each forward pass's rows, and so the results, the same whatever the games' timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from opd.chat import render_chat
from opd.envs.environment import EnvError, Environment, Game, normal_command
from opd.envs.workers import Sessions, sessions
from opd.errors import UserError
from opd.rollout.engine import (
    EngineReport,
    EpisodeSession,
    RolloutBatch,
    RolloutEngine,
    Sample,
    Sampling,
    check_context,
    check_count,
    check_sampling,
    left_pad,
)
from opd.rollout.sampling import HFRollout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ChatFormat", "EpisodeRecord", "Episodes", "EpisodeRollout"]

# Placeholder turns for deriving the template's pieces; any text the template copies verbatim.
_SYSTEM, _USER, _ASSISTANT, _ASSISTANT2 = "SYSTEM-TEXT", "USER-TEXT", "ASSISTANT-TEXT", "ASSISTANT-TEXT-2"


class ChatFormat:
    """The text pieces of an episode, rendered by ``tokenizer``'s chat template."""

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.decode([eos_id])
        head = self.prompt(_SYSTEM, _USER)
        turn = self._render([*self._base(), _msg("assistant", _ASSISTANT)], False)
        if not turn.startswith(head + _ASSISTANT):
            raise self._unstable("an assistant turn does not continue the generation prompt")
        self.closing = turn[len(head + _ASSISTANT) :]  # what the template writes after a turn's text
        if not self.closing.startswith(self.eos_text):
            raise UserError(
                f"the chat template closes an assistant turn with {self.closing!r}, which does not start with "
                f"the end-of-turn token {self.eos_text!r}; pass the template's end-of-turn token id as eos_id"
            )
        # Once, on a whole two-turn conversation: the pieces must add up to the template's own text.
        history = [*self._base(), _msg("assistant", _ASSISTANT), _msg("user", "OBS-TEXT")]
        whole = self._render([*history, _msg("assistant", _ASSISTANT2)], False)
        pieces = head + _ASSISTANT + self.reply("OBS-TEXT", after_eos=False) + _ASSISTANT2 + self.closing
        if whole != pieces:
            raise self._unstable("a two-turn conversation is not its turns rendered one after another")

    def _base(self) -> list[dict]:
        return [_msg("system", _SYSTEM), _msg("user", _USER)]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return render_chat(self.tokenizer, messages, add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja's TemplateError, or no template at all (ValueError)
            raise UserError(
                f"the tokenizer's chat template cannot render system/user/assistant turns ({err}); "
                "episodes need a template with all three roles (set tokenizer.chat_template)"
            ) from None

    def _unstable(self, what: str) -> UserError:
        return UserError(
            f"the tokenizer's chat template is not prefix-stable ({what}); multi-turn episodes append turns "
            "to a KV cache, so the template must render a conversation as its turns one after another"
        )

    def prompt(self, system: str, observation: str) -> str:
        """The episode's prompt: the system turn, the first observation, the generation prompt."""
        text = self._render([_msg("system", system), _msg("user", observation)], True)
        if system not in text or observation not in text:
            raise UserError("the tokenizer's chat template drops the system or user text; episodes need both roles")
        return text

    def reply(self, observation: str, after_eos: bool = True) -> str:
        """The text after an assistant turn's last token up to the next turn's first: the turn's
        closing (less the EOS when the model wrote it), the user turn, the generation prompt."""
        history = [*self._base(), _msg("assistant", _ASSISTANT)]
        before = self._render(history, False)
        after = self._render([*history, _msg("user", observation)], True)
        if not after.startswith(before):
            raise self._unstable("adding a user turn re-renders the turns before it")
        if observation not in after[len(before) :]:
            raise UserError("the tokenizer's chat template drops the user text; episodes need a user role")
        closing = self.closing[len(self.eos_text) :] if after_eos else self.closing
        return closing + after[len(before) :]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


@dataclass
class EpisodeRecord:
    """What happened in one episode. ``observations[0]`` is the first observation and
        ``observations[i]`` the reply to ``actions[i - 1]``; ``rewards[i]`` is action i's reward (0, and
    no observation, for a last action that was not played: cut by the budget, or the game crashed).
        ``spans`` are the [start, end) of each action's tokens in the batch's response region.
        ``end`` says why it ended: "won", "lost" (the game ended it), "max_turns", "budget" (limits:
        ``truncated``), "error" (an EnvError, its message in ``error``). ``invalid_actions`` counts
        actions outside the game's admissible commands (case and spacing ignored); None when the game
        does not list them."""

    game_id: str
    seed: int
    observations: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    won: bool = False
    end: str = ""
    invalid_actions: int | None = None
    error: str | None = None

    @property
    def turns(self) -> int:
        return len(self.actions)

    @property
    def truncated(self) -> bool:
        return self.end in ("max_turns", "budget")

    @property
    def done(self) -> bool:
        """The game ended the episode (won or lost)."""
        return self.end in ("won", "lost")


@dataclass
class Episodes:
    """A played batch: the tokens (row i is episode i) and what happened in each episode."""

    batch: RolloutBatch
    records: list[EpisodeRecord]


@dataclass
class _Episode:
    """One episode's running state: its response region so far (its game is in a Sessions)."""

    record: EpisodeRecord
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def playing(self) -> bool:
        return not self.record.end

    def add(self, ids: list[int], action: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.action += [action] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def finish(self, end: str, error: str | None = None) -> None:
        self.record.end, self.record.error = end, error
        self.record.won = end == "won"


class EpisodeRollout:
    """Plays batches of episodes with a rollout engine: ``engine`` is a
    :class:`~opd.rollout.engine.RolloutEngine`, or a Hugging Face causal LM, played with opd's HF engine
    (``eos_id``, ``pad_id`` and ``max_context`` then override the tokenizer's and the model's)."""

    def __init__(
        self,
        engine: RolloutEngine | torch.nn.Module,
        tokenizer,
        eos_id: int | None = None,
        pad_id: int | None = None,
        max_context: int | None = None,
        chat: ChatFormat | None = None,
    ):
        if isinstance(engine, torch.nn.Module):
            eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
            pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
            if eos_id is None or pad_id is None:
                raise UserError("the tokenizer has no EOS or pad token; pass eos_id and pad_id")
            engine = HFRollout(cast("PreTrainedModel", engine), eos_id, pad_id, max_context)
        self.engine: RolloutEngine = engine
        self.tokenizer, self.eos_id = tokenizer, engine.eos_id
        self.format = chat or ChatFormat(tokenizer, self.eos_id)

    @torch.no_grad()
    def play(
        self,
        env: Environment,
        games: Sequence[Game],
        seeds: Sequence[int],
        *,
        max_new_tokens: int,
        max_action_tokens: int = 64,
        max_turns: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        top_k: int = 0,
        max_prompt_tokens: int | None = None,
    ) -> Episodes:
        """Play ``games[i]`` with seed ``seeds[i]``, all together, until every episode has ended.

        An episode whose prompt (system turn and first observation) is longer than
        ``max_prompt_tokens`` is not played: it ends as an error, counted, like a game that fails."""
        seeds = [int(s) for s in seeds]
        if len(seeds) != len(games) or not games:
            raise ValueError(f"one seed per game is required (got {len(games)} games, {len(seeds)} seeds)")
        check_sampling(max_new_tokens, temperature, greedy)
        if max_action_tokens < 1:
            raise UserError(f"max_action_tokens={max_action_tokens} must be >= 1")
        turns = env.max_turns if max_turns is None else max_turns
        if turns < 1:
            raise UserError(f"max_turns={turns} must be >= 1")
        games_of = sessions(env)
        try:
            episodes = self._start(env, games_of, games, seeds, max_prompt_tokens)
            P = max(len(e.prompt) for e in episodes)
            check_context(
                P,
                max_new_tokens,
                self.engine.max_context,
                "lower max_new_tokens (the episode's token budget) or shorten the system prompt and first observation",
            )
            how = Sampling(temperature, top_p, greedy, top_k)
            session = self.engine.episodes([e.prompt for e in episodes], seeds, budget=max_new_tokens, sampling=how)
            try:
                self._play(episodes, games_of, session, (max_new_tokens, max_action_tokens, turns))
            finally:
                session.close()
        finally:
            games_of.close()
        batch = self._batch(episodes)
        batch.report = EngineReport(self.engine.check_policy(batch), session.sync_seconds)
        return Episodes(batch, [e.record for e in episodes])

    def _start(
        self, env: Environment, games_of: Sessions, games, seeds, max_prompt_tokens: int | None
    ) -> list[_Episode]:
        """Every episode's session opened and reset (at once, where the games run in workers)."""
        for i, game in enumerate(games):
            games_of.open(i, game)
        firsts = games_of.results()
        return [self._first(env, g, s, firsts[i], max_prompt_tokens) for i, (g, s) in enumerate(zip(games, seeds))]

    def _first(self, env: Environment, game: Game, seed: int, first, max_prompt_tokens: int | None) -> _Episode:
        record = EpisodeRecord(game.id, seed)
        if isinstance(first, EnvError):
            return self._unplayed(env, record, str(first))
        prompt = self.format.encode(self.format.prompt(env.system_prompt, first))
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            why = f"its prompt has {len(prompt)} tokens, more than max_prompt_tokens={max_prompt_tokens}"
            return self._unplayed(env, record, why)
        record.observations.append(first)
        return _Episode(record, prompt)

    def _unplayed(self, env: Environment, record: EpisodeRecord, why: str) -> _Episode:
        """An episode that ends before its first turn, counted as an error, with an empty response
        region and the shortest prompt (so it cannot push the batch past the model's context)."""
        ep = _Episode(record, self.format.encode(self.format.prompt(env.system_prompt, "")))
        ep.finish("error", why)
        return ep

    def _play(self, episodes: list[_Episode], games_of: Sessions, session: EpisodeSession, limits) -> None:
        """Turns until every episode has ended: the session writes each playing episode's turn, each action
        goes to its game as soon as its turn is written (the games step while other rows still write), the
        replies go back to the session together once every game has answered (so each forward pass's rows,
        and the results, do not depend on the games' timing)."""
        budget, max_action_tokens, max_turns = limits
        session.end([i for i, e in enumerate(episodes) if not e.playing])
        sent: dict[int, bool] = {}  # this turn's episodes whose action went to their game: {episode: ended with EOS}
        reported: set[int] = set()  # this turn's episodes whose turn the session wrote

        def turn_written(done: list[tuple[int, Sample]]) -> None:
            for i, sample in done:
                reported.add(i)
                if self._played(episodes[i], sample.ids, sample.logprobs, sample.eos, budget):
                    games_of.step(i, episodes[i].record.actions[-1])
                    sent[i] = sample.eos
            games_of.send()

        for _ in range(max_turns):
            playing = [i for i, e in enumerate(episodes) if e.playing]
            if not playing:
                return
            sent.clear()
            reported.clear()
            session.turn({i: min(max_action_tokens, budget - len(episodes[i].tokens)) for i in playing}, turn_written)
            check_count(self.engine.name, len(reported), len(playing), "episodes' turns")
            answers = games_of.results()
            replies = {}
            for i, eos in sent.items():
                reply = self._answered(episodes[i], answers[i], eos, budget, max_turns)
                if reply is not None:
                    replies[i] = reply
            session.end([i for i in playing if not episodes[i].playing])
            if replies:
                session.extend(replies)

    def _played(self, ep: _Episode, ids: list[int], lps: list[float], eos: bool, budget: int) -> bool:
        """Record a written turn; whether it goes to the game (a turn cut by the budget is not played)."""
        start = len(ep.tokens)
        ep.add(ids, True, lps)
        ep.record.spans.append((start, len(ep.tokens)))
        ep.record.actions.append(self.tokenizer.decode(ids, skip_special_tokens=True).strip())
        if not eos and len(ep.tokens) >= budget:  # cut by the budget, not by the turn's own cap: never played
            ep.record.rewards.append(0.0)
            ep.finish("budget")
            return False
        return True

    def _answered(self, ep: _Episode, answer, eos: bool, budget: int, max_turns: int) -> list[int] | None:
        """Record the game's answer to the last action; the reply's tokens (None once the episode ended)."""
        if isinstance(answer, EnvError):
            ep.record.rewards.append(0.0)
            ep.finish("error", str(answer))
            return None
        admissible, result = answer
        if admissible is not None:
            invalid = normal_command(ep.record.actions[-1]) not in {normal_command(c) for c in admissible}
            ep.record.invalid_actions = (ep.record.invalid_actions or 0) + invalid
        ep.record.observations.append(result.observation)
        ep.record.rewards.append(float(result.reward))
        if result.done:
            ep.finish("won" if result.won else "lost")
            return None
        if ep.record.turns >= max_turns:
            ep.finish("max_turns")
            return None
        reply = self.format.encode(self.format.reply(result.observation, after_eos=eos))
        if len(ep.tokens) + len(reply) + 1 > budget:
            ep.finish("budget")
            return None
        ep.add(reply, False)
        return reply

    def _batch(self, episodes: list[_Episode]) -> RolloutBatch:
        """Left-padded prompts, then each response region from its start, right-padded."""
        ids, attn = left_pad([e.prompt for e in episodes], self.engine.pad_id)
        N, P = ids.shape
        T = max(1, max(len(e.tokens) for e in episodes))
        resp = torch.full((N, T), self.engine.pad_id, dtype=torch.long)
        resp_mask = torch.zeros((N, T), dtype=torch.bool)
        action = torch.zeros((N, T), dtype=torch.bool)
        logp = torch.zeros((N, T))
        for n, e in enumerate(episodes):
            L = len(e.tokens)
            resp[n, :L], resp_mask[n, :L] = torch.tensor(e.tokens, dtype=torch.long), True
            action[n, :L], logp[n, :L] = torch.tensor(e.action, dtype=torch.bool), torch.tensor(e.logprobs)
        finished = torch.tensor([e.record.done for e in episodes], dtype=torch.bool)
        dev = self.engine.device
        return RolloutBatch(
            torch.cat([ids, resp], 1).to(dev),
            torch.cat([attn, resp_mask.long()], 1).to(dev),
            P,
            resp.to(dev),
            resp_mask.to(dev),
            logp.to(dev),
            finished.to(dev),
            action_mask_NT=action.to(dev),
        )
