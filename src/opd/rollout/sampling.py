"""opd's own rollout engine (``--rollout-engine hf``, the default): the student samples with its KV cache,
recording the log-prob of every sampled token.

:class:`HFRollout` implements :class:`opd.rollout.engine.RolloutEngine` over any Hugging Face causal LM:
single-turn batches (:meth:`HFRollout.generate`) and episode sessions (:class:`HFSession`, the KV cache
continued turn by turn). Writing the loop ourselves (rather than calling ``generate``) gives three
things the trainer relies on:

* the log-prob of each sampled token under the *unmodified* policy (temperature 1, no top-p), the
  quantity the sampled-token reward and importance ratios use;
* exact nucleus sampling by inverse CDF on the sorted, truncated distribution, so a token outside
  the top-p nucleus (within the top-k tokens when a top-k is asked for) can never be drawn (and no
  hidden default top_k=50);
* one uniform random number per prompt and position, drawn from a generator seeded by that
  prompt's own seed (an episode: one stream for all its turns): a prompt gets the same rollout
  whatever batch or process it lands in, which makes resumed and data-parallel runs reproduce
  single-process ones.

The response mask covers tokens up to and including the first EOS: a model may emit the pad
token mid-response, so padding is never inferred from token values. A batch also carries an
action mask, the tokens the model sampled: in a single-turn rollout it equals the response mask;
multi-turn episodes (:mod:`opd.rollout.episodes`) interleave the model's turns with environment tokens
that are real (response mask) but not the model's (action mask), and only the latter are trained.

Episode sessions never re-encode the KV cache: a turn's sampled tokens are fed as they are drawn
(rows whose turn is over wait with attention 0), and the replies of all episodes still playing go in
one forward, left-padded to the longest with per-row positions. Episodes that end leave the batch
(their cache rows are dropped) where the cache allows it (:func:`_can_drop_rows`).

With ``--static-cache`` (:mod:`opd.rollout.static_cache`) both keep their batch in a cache of fixed shape
instead, its decode step a CUDA graph on a GPU: every row stays in the model's batch (a finished one writes
nowhere it is read), the sampler draws for the rows still writing, and the samples are the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from opd.config import TrainConfig
from opd.errors import UserError
from opd.models.loading import model_device
from opd.rollout.engine import (
    EngineBase,
    EngineContext,
    RolloutBatch,
    Sample,
    Sampling,
    Written,
    check_context,
    check_sampling,
    left_pad,
)
from opd.rollout.static_cache import StaticDecoder, StaticPool

if TYPE_CHECKING:
    from transformers import Cache

__all__ = ["HFRollout", "HFSession", "RolloutBatch", "left_pad", "nucleus_sample", "prefill", "start_hf"]


# Finished rows leave the decoding batch (their KV-cache rows are dropped) once the rows still
# generating are at most this share of it: responses end at very different lengths, and a batch
# that keeps its finished rows spends its late steps on rows whose output is thrown away.
COMPACT_BELOW = 0.75

# Candidates nucleus_sample takes with topk, in rounds, before it falls back to sorting the whole
# vocabulary. A top-p 0.9 nucleus of a trained model is mostly one token and rarely more than a
# few dozen, topk's cost grows with k, and a full sort of every row at every step dominates
# generation at small widths (measurements in docs/benchmarks.md, "Where opd's step goes"). Rows the
# first round cannot settle go to the next.
NUCLEUS_CANDIDATES = (16, 256)


def nucleus_sample(
    logits_NV: torch.Tensor,
    u_N: torch.Tensor,
    temperature: float,
    top_p: float,
    candidates: int | Sequence[int] = NUCLEUS_CANDIDATES,
    top_k: int = 0,
) -> torch.Tensor:
    """Draw one token per row from the top-p nucleus of softmax(logits / temperature), within its ``top_k``
    most probable tokens when ``top_k`` > 0.

    The nucleus is the smallest set of most probable tokens whose mass reaches ``top_p`` (the most probable
    token is always in it); with ``top_k`` it is taken on the top-k tokens' distribution renormalized, the
    order in which Hugging Face's ``generate`` and vLLM apply the two. ``u_N`` holds uniforms in [0, 1):
    inverse-CDF sampling on the sorted, truncated masses makes the draw a deterministic function of ``u``.
    A row whose ``c`` most probable tokens already settle the draw (they hold ``top_p`` of the mass; at
    top-p 1, the mass before ``u``'s point) draws from those alone (the same token a full sort gives), for
    each ``c`` of ``candidates`` in turn; only the rows no round settles sort the whole vocabulary.

    Shapes: logits_NV: (N, V); u_N: (N,) -> ids_N: (N,) int64
    """
    probs_NV = torch.softmax(logits_NV.float() / temperature, dim=-1)
    if 0 < top_k < probs_NV.shape[-1]:
        top_NK, ids_NK = probs_NV.topk(top_k, dim=-1)
        limit = top_p * top_NK.sum(-1, keepdim=True) if top_p < 1.0 else None
        return _inverse_cdf_draw(top_NK, ids_NK, u_N, limit)
    rounds = (candidates,) if isinstance(candidates, int) else tuple(candidates)
    if top_p >= 1.0:
        return _whole_draw(probs_NV, u_N, rounds)
    out_N = torch.empty(probs_NV.shape[0], dtype=torch.long, device=probs_NV.device)
    todo_R = torch.arange(probs_NV.shape[0], device=probs_NV.device)
    for c in rounds:
        if todo_R.numel() == 0:
            return out_N
        top_RC, top_ids_RC = probs_NV[todo_R].topk(min(c, probs_NV.shape[-1]), dim=-1)
        done_R = top_RC.sum(-1) >= top_p  # else the nucleus may reach past the candidates
        rows = todo_R[done_R]
        out_N[rows] = _inverse_cdf_draw(top_RC[done_R], top_ids_RC[done_R], u_N[rows], top_p)
        todo_R = todo_R[~done_R]
    if todo_R.numel():
        sorted_p, sorted_ids = probs_NV[todo_R].sort(dim=-1, descending=True)
        out_N[todo_R] = _inverse_cdf_draw(sorted_p, sorted_ids, u_N[todo_R], top_p)
    return out_N


def _inverse_cdf_draw(
    sorted_p_NC: torch.Tensor, ids_NC: torch.Tensor, u_N: torch.Tensor, limit: float | torch.Tensor | None
) -> torch.Tensor:
    """The draw on probabilities sorted descending (a prefix that holds the nucleus is enough): the tokens whose
    mass before them is under ``limit`` (a float, or one per row (N, 1)); None: every token given."""
    if limit is None:
        cdf = sorted_p_NC.cumsum(-1)
    else:
        mass_before = sorted_p_NC.cumsum(-1) - sorted_p_NC
        cdf = (sorted_p_NC * (mass_before < limit)).cumsum(-1)
    target = (u_N.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=sorted_p_NC.shape[-1] - 1)
    return ids_NC.gather(-1, pick).squeeze(-1)


def _whole_draw(probs_NV: torch.Tensor, u_N: torch.Tensor, rounds: Sequence[int]) -> torch.Tensor:
    """The draw from every token (top-p 1, no top-k) by inverse CDF on the descending order, without sorting the
    vocabulary for the rows whose point ``u`` x (total mass) falls within their ``c`` most probable tokens."""
    target_N = u_N.to(probs_NV.dtype) * probs_NV.sum(-1)
    out_N = torch.empty(probs_NV.shape[0], dtype=torch.long, device=probs_NV.device)
    todo_R = torch.arange(probs_NV.shape[0], device=probs_NV.device)
    for c in (*rounds, probs_NV.shape[-1]):  # the last round: every token, the full sort
        if todo_R.numel() == 0:
            break
        top_RC, ids_RC = probs_NV[todo_R].topk(min(c, probs_NV.shape[-1]), dim=-1)
        cdf_RC = top_RC.cumsum(-1)
        done_R = (cdf_RC[:, -1] > target_N[todo_R]) | (c >= probs_NV.shape[-1])
        at = target_N[todo_R[done_R]].unsqueeze(-1)
        pick = torch.searchsorted(cdf_RC[done_R], at, right=True)
        # a point at the very end (u within float32 rounding of 1) takes the last token with mass, never one without
        pick = torch.minimum(pick, (top_RC[done_R] > 0).sum(-1, keepdim=True) - 1)
        out_N[todo_R[done_R]] = ids_RC[done_R].gather(-1, pick).squeeze(-1)
        todo_R = todo_R[~done_R]
    return out_N


def _can_drop_rows(cache) -> bool:
    """Whether this cache holds only plain key/value layers, whose rows ``batch_select_indices``
    drops. Hybrid layers (linear attention or Mamba next to attention) inherit that method but
    leave their recurrent states whole, so their batch would fall out of step: never compact them."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    return isinstance(cache, DynamicCache) and all(
        type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers
    )


def prompt_uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """One uniform per (prompt, position), each prompt from its own seeded generator: (N, steps).

    Drawn on the CPU whatever device the model is on, so a prompt's rollout does not depend on it."""
    rows = []
    for s in seeds:
        g = torch.Generator().manual_seed(int(s) % (2**63 - 1))
        rows.append(torch.rand(steps, generator=g, dtype=torch.float64, device="cpu"))
    return torch.stack(rows)


def sample_next(
    logits_NV: torch.Tensor, u_N: torch.Tensor, temperature: float, top_p: float, greedy: bool, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its log-prob under the unmodified policy (temperature 1,
    no top-p or top-k): the quantity the sampled-token reward and importance ratios use.

    Shapes: logits_NV: (N, V); u_N: (N,) -> ids_N: (N,) int64, logp_N: (N,) float32
    """
    logits = logits_NV.float()
    tok = logits.argmax(-1) if greedy else nucleus_sample(logits, u_N, temperature, top_p, top_k=top_k)
    return tok, torch.log_softmax(logits, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def prefill(model: PreTrainedModel, ids_NP: torch.Tensor, attn_NP: torch.Tensor):
    """The forward over left-padded prompts that starts a KV cache: (model output, position ids).

    Positions count real tokens only, so a left-padded row is computed as it would be alone."""
    positions = (attn_NP.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids_NP, attention_mask=attn_NP, position_ids=positions, use_cache=True, logits_to_keep=1)
    return out, positions


def start_hf(ctx: EngineContext) -> HFRollout:
    """The registry's ``hf`` engine: this process's student (the trainer's, or a staleness worker's copy), with
    the run's ``--static-cache`` (``auto``, unless FSDP shards the weights: its forward gathers them in hooks
    that a CUDA graph cannot hold, and the configuration refuses ``on`` with it)."""
    cfg = ctx.cfg
    mode = cfg.rollout.static_cache
    if mode == "auto" and isinstance(cfg, TrainConfig) and cfg.run.fsdp:  # opd eval's config has no FSDP
        mode = "off"
    return HFRollout(ctx.model, ctx.tokenizer.eos_token_id, ctx.tokenizer.pad_token_id, static_cache=mode)


class HFRollout(EngineBase):
    """Sampling with the KV cache from a Hugging Face causal LM (the default engine). It samples the
    trainer's own model object: nothing to sync, no policy check (its batches' ``report`` is empty)."""

    name = "hf"

    def __init__(
        self,
        model: PreTrainedModel,
        eos_id: int,
        pad_id: int,
        max_context: int | None = None,
        static_cache: str = "off",
    ):
        self.model = model
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None)
        # --static-cache: a KV cache of fixed shape, its decode step a CUDA graph on a GPU (opd.rollout.static_cache)
        self.static = StaticPool(model, static_cache)

    def episodes(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, budget: int, sampling: Sampling
    ) -> HFSession:
        return HFSession(self, prompts, seeds, budget, sampling)

    @torch.no_grad()
    def generate(
        self, prompt_ids, seeds, *, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, top_k=0
    ) -> RolloutBatch:
        if len(seeds) != len(prompt_ids):
            raise ValueError("one seed per prompt is required")
        check_sampling(max_new_tokens, temperature, greedy)
        dev = model_device(self.model)
        ids, attn = (t.to(dev) for t in left_pad(prompt_ids, self.pad_id))
        N, P = ids.shape
        check_context(P, max_new_tokens, self.max_context, "shorten the prompts or lower --max-new-tokens")
        was_training = self.model.training
        self.model.eval()
        u = prompt_uniforms(seeds, max_new_tokens).to(dev)
        resp = torch.full((N, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        logp = torch.zeros(N, max_new_tokens, device=dev)
        resp_mask = torch.zeros(N, max_new_tokens, dtype=torch.bool, device=dev)
        finished = torch.zeros(N, dtype=torch.bool, device=dev)
        steps: _DynamicSteps | _StaticSteps | None = None
        try:
            steps = self._steps(ids, attn, max_new_tokens)
            live, logits = torch.arange(N, device=dev), steps.logits  # the rows the sampler draws for (global indices)
            for t in range(max_new_tokens):
                tok, lp = sample_next(logits, u[live, t], temperature, top_p, greedy, top_k)
                alive = ~finished[live]
                tok = torch.where(alive, tok, torch.full_like(tok, self.pad_id))
                resp[live, t], resp_mask[live, t] = tok, alive
                logp[live, t] = torch.where(alive, lp, 0.0)
                finished[live] = finished[live] | (alive & (tok == self.eos_id))
                still = ~finished[live]
                n_still = int(still.sum())  # rows outside the batch are finished: one count serves both tests
                if n_still == 0 or t == max_new_tokens - 1:
                    break
                live, logits = steps.advance(live, tok, still, n_still)
        finally:
            if steps is not None:
                steps.close()
            self.model.train(was_training)
        resp, logp, resp_mask = resp[:, : t + 1], logp[:, : t + 1], resp_mask[:, : t + 1]
        full_ids = torch.cat([ids, resp], dim=1)
        full_mask = torch.cat([attn, resp_mask.long()], dim=1)
        return RolloutBatch(full_ids, full_mask, P, resp, resp_mask, logp, finished, action_mask_NT=resp_mask)

    def _steps(self, ids_NP: torch.Tensor, attn_NP: torch.Tensor, max_new_tokens: int) -> _DynamicSteps | _StaticSteps:
        """generate()'s decoding batch, its prompts prefilled: the static cache where --static-cache and the
        model allow it and it fits, else the dynamic one."""
        dec = self.static.take(ids_NP.shape[0], ids_NP.shape[1] + max_new_tokens)
        logits = self.static.prefill(dec, ids_NP, attn_NP, max_new_tokens) if dec is not None else None
        if dec is not None and logits is not None:
            return _StaticSteps(self, dec, logits)
        return _DynamicSteps(self.model, ids_NP, attn_NP)


class _DynamicSteps:
    """generate()'s decoding with the dynamic cache: finished rows leave the model's batch (their KV-cache
    rows dropped) once few enough are still generating (COMPACT_BELOW)."""

    def __init__(self, model: PreTrainedModel, ids_NP: torch.Tensor, attn_NP: torch.Tensor):
        out, positions = prefill(model, ids_NP, attn_NP)
        self.model, self.cache, self.logits = model, out.cache, out.logits[:, -1]
        self.compact = _can_drop_rows(self.cache)
        # the rows' attention mask and next position, for the rows still in the model's batch
        self.attn, self.pos = attn_NP, positions[:, -1] + 1

    def advance(self, live, tok, still, n_still: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each live row's token (rows no longer ``still`` writing with attention 0): (live, their logits)."""
        if self.compact and n_still <= COMPACT_BELOW * live.numel():
            keep = still.nonzero().squeeze(-1)
            self.cache.batch_select_indices(keep)
            live, self.attn, self.pos, tok, still = live[keep], self.attn[keep], self.pos[keep], tok[keep], still[keep]
        self.attn = torch.cat([self.attn, still.long().unsqueeze(-1)], dim=-1)
        out = self.model(
            input_ids=tok.unsqueeze(-1),
            attention_mask=self.attn,
            position_ids=self.pos.unsqueeze(-1),
            cache=self.cache,
            use_cache=True,
        )
        self.pos = self.pos + 1
        return live, out.logits[:, -1]

    def close(self) -> None:
        return None


class _StaticSteps:
    """generate()'s decoding with the static cache (:mod:`opd.rollout.static_cache`): the model's batch keeps
    every row at its fixed shape (a finished row writes to the trash slot); the sampler draws for the live
    rows only, which drop out under the same rule as the dynamic cache's rows."""

    def __init__(self, engine: HFRollout, dec: StaticDecoder, logits_NV: torch.Tensor):
        self.engine, self.dec, self.logits = engine, dec, logits_NV
        self.ids_N1 = torch.full((dec.rows, 1), engine.pad_id, dtype=torch.long, device=logits_NV.device)
        self.writing_N1 = torch.zeros(dec.rows, 1, dtype=torch.long, device=logits_NV.device)

    def advance(self, live, tok, still, n_still: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.ids_N1[live, 0], self.writing_N1[live, 0] = tok, still.long()
        logits = self.dec.feed(self.ids_N1, self.writing_N1)
        if n_still <= COMPACT_BELOW * live.numel():
            live = live[still]
        return live, logits[live]

    def close(self) -> None:
        self.engine.static.give(self.dec)


@dataclass
class _Rows:
    """The model's batch in a session: which episodes its rows are, their attention mask and next positions.

    ``cache`` is the dynamic cache, or a static decoder (which keeps its own masks and positions, and all its rows).

    Shapes: rows_R, next_pos_R: (R,); attn_RL: (R, L); logits_RV: (R, V) the next-token logits
    """

    rows_R: torch.Tensor
    attn_RL: torch.Tensor
    next_pos_R: torch.Tensor
    cache: Cache | StaticDecoder
    logits_RV: torch.Tensor
    can_drop: bool


class HFSession:
    """Episodes continued in one KV cache (see the module docstring): the prompts prefilled together,
    each episode drawing its uniforms from one stream seeded by its seed, ``budget`` of them (one per
    token it may write). The model is in eval mode until :meth:`close`."""

    sync_seconds: float | None = None  # the trainer's own model: nothing to sync

    @torch.no_grad()
    def __init__(
        self, engine: HFRollout, prompts: Sequence[Sequence[int]], seeds: Sequence[int], budget: int, sampling: Sampling
    ):
        self.model, self.pad_id, self.eos_id = engine.model, engine.pad_id, engine.eos_id
        self.budget, self.sampling, self.static = budget, sampling, engine.static
        self.was_training = self.model.training
        self.model.eval()
        dev = model_device(self.model)
        self.u_NB = prompt_uniforms(seeds, budget).to(dev)
        self.sampled = [0] * len(prompts)  # tokens each episode has drawn: the index of its next uniform
        self.fed = [0] * len(prompts)  # tokens of each episode's response region in the cache (turns and replies)
        self.ended: set[int] = set()
        self.closed = False
        ids, attn = (t.to(dev) for t in left_pad(prompts, self.pad_id))
        rows = torch.arange(len(prompts), device=dev)
        dec = engine.static.take(len(prompts), ids.shape[1] + budget)
        try:
            logits = engine.static.prefill(dec, ids, attn, budget) if dec is not None else None
        except UserError:  # --static-cache on, and the cache does not fit: no session to close
            self.model.train(self.was_training)
            raise
        if dec is not None and logits is not None:
            self.state = _Rows(rows, attn, attn.sum(-1), dec, logits, can_drop=False)
            return
        out, positions = prefill(self.model, ids, attn)
        self.state = _Rows(rows, attn, positions[:, -1] + 1, out.cache, out.logits[:, -1], _can_drop_rows(out.cache))

    @torch.no_grad()
    def turn(self, caps: dict[int, int], written: Written) -> None:
        """Sample until each episode of ``caps`` writes EOS or reaches its cap; rows whose turn is over are
        reported at once, while the others may still be writing."""
        state, budget, how = self.state, self.budget, self.sampling
        dev, rows = state.rows_R.device, state.rows_R.tolist()
        playing = [i in caps for i in rows]
        cap_R = torch.tensor([caps.get(i, 0) for i in rows], device=dev)
        sampled_R = torch.tensor([self.sampled[i] for i in rows], device=dev)
        writing_R = torch.tensor(playing, dtype=torch.bool, device=dev) & (cap_R > 0)
        R, A = len(rows), max(caps.values(), default=0)
        ids_RA = torch.full((R, A), self.pad_id, dtype=torch.long, device=dev)
        lps_RA = torch.zeros(R, A, device=dev)
        eos_R = torch.zeros(R, dtype=torch.bool, device=dev)
        n_R = torch.zeros(R, dtype=torch.long, device=dev)
        unreported = {r for r in range(R) if playing[r]}
        self._check_room({i: cap for i, cap in caps.items() if i not in self.ended})

        def report(rows_done: list[int]) -> None:
            if not rows_done:
                return
            ns, eos = n_R[rows_done].tolist(), eos_R[rows_done].tolist()
            ids, lps = ids_RA[rows_done].tolist(), lps_RA[rows_done].tolist()
            done = [(rows[r], Sample(ids[j][: ns[j]], lps[j][: ns[j]], eos[j])) for j, r in enumerate(rows_done)]
            for i, sample in done:
                self.sampled[i] += len(sample.ids)
                self.fed[i] += len(sample.ids)
            written(done)
            unreported.difference_update(rows_done)

        report([r for r in sorted(unreported) if not bool(writing_R[r])])  # no room left to write
        for t in range(A):
            if not unreported:
                break
            u_R = self.u_NB[state.rows_R, (sampled_R + t).clamp(max=budget - 1)]
            tok, lp = sample_next(state.logits_RV, u_R, how.temperature, how.top_p, how.greedy, how.top_k)
            tok = torch.where(writing_R, tok, torch.full_like(tok, self.pad_id))
            ids_RA[:, t], lps_RA[:, t] = tok, torch.where(writing_R, lp, 0.0)
            n_R += writing_R
            # The written token joins the cache even when it ends the turn: the reply comes after it.
            self._feed(tok.unsqueeze(-1), writing_R.long().unsqueeze(-1))
            eos_R |= writing_R & (tok == self.eos_id)
            was_R = writing_R.clone()
            writing_R &= (tok != self.eos_id) & (n_R < cap_R)
            report((was_R & ~writing_R).nonzero().squeeze(-1).tolist())

    @torch.no_grad()
    def extend(self, tokens: dict[int, list[int]]) -> None:
        """All the episodes' replies in one forward, left-padded to the longest."""
        state = self.state
        rows = state.rows_R.tolist()
        self._check_room({i: len(t) for i, t in tokens.items()})
        for i, t in tokens.items():
            self.fed[i] += len(t)
        C = max(len(r) for r in tokens.values())
        ids = torch.full((len(rows), C), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), C), dtype=torch.long)
        for r, i in enumerate(rows):
            if i in tokens:
                ids[r, C - len(tokens[i]) :], mask[r, C - len(tokens[i]) :] = torch.tensor(tokens[i]), 1
        self._feed(ids.to(state.rows_R.device), mask.to(state.rows_R.device))

    def end(self, episodes: Iterable[int]) -> None:
        """Drop the rows of ended episodes from the model's batch, where the cache allows it."""
        self.ended.update(episodes)
        state = self.state
        playing = torch.tensor([i not in self.ended for i in state.rows_R.tolist()], dtype=torch.bool)
        if state.can_drop and not bool(playing.all()):
            assert not isinstance(state.cache, StaticDecoder)  # it keeps every row: never can_drop
            keep = playing.nonzero().squeeze(-1).to(state.rows_R.device)
            state.cache.batch_select_indices(keep)
            state.rows_R, state.attn_RL = state.rows_R[keep], state.attn_RL[keep]
            state.next_pos_R, state.logits_RV = state.next_pos_R[keep], state.logits_RV[keep]

    def close(self) -> None:
        self.model.train(self.was_training)
        if isinstance(self.state.cache, StaticDecoder) and not self.closed:
            self.static.give(self.state.cache)
        self.closed = True

    def _check_room(self, adding: dict[int, int]) -> None:
        """A ValueError before an episode's turns and replies would pass the session's ``budget``: a static
        cache has no room past it (the dynamic one grows, but the session's contract is the same)."""
        if not isinstance(self.state.cache, StaticDecoder):
            return
        over = [i for i, n in adding.items() if self.fed[i] + n > self.budget]
        if over:
            i = over[0]
            raise ValueError(
                f"episode {i} would hold {self.fed[i] + adding[i]} tokens after its prompt, more than the session's "
                f"budget of {self.budget} (a caller must keep every episode's turns and replies within it)"
            )

    def _feed(self, ids_RC: torch.Tensor, mask_RC: torch.Tensor) -> None:
        """Append tokens to the cache (left-padded, mask 0 where a row has none) and keep the
        next-token logits of each row's last real token (the last column)."""
        state = self.state
        if isinstance(state.cache, StaticDecoder):
            logits = state.cache.feed(ids_RC, mask_RC)
        else:
            positions = state.next_pos_R.unsqueeze(-1) + (mask_RC.cumsum(-1) - 1).clamp(min=0)
            state.attn_RL = torch.cat([state.attn_RL, mask_RC], dim=-1)
            out = self.model(
                input_ids=ids_RC,
                attention_mask=state.attn_RL,
                position_ids=positions,
                cache=state.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            state.next_pos_R = state.next_pos_R + mask_RC.sum(-1)
            state.cache, logits = out.cache, out.logits[:, -1]
        # rows that added nothing keep their logits: they were computed at their last real token
        state.logits_RV = torch.where(mask_RC.any(-1, keepdim=True), logits, state.logits_RV)
