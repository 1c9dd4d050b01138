"""Rollouts: the student samples responses, recording the log-prob of every sampled token.

:class:`RolloutEngine` is the protocol a backend implements (a vLLM engine can be added behind
it); :class:`HFRollout` is the default, an explicit sampling loop over any Hugging Face causal LM
with its KV cache. Writing the loop ourselves (rather than calling ``generate``) gives three
things the trainer relies on:

* the log-prob of each sampled token under the *unmodified* policy (temperature 1, no top-p), the
  quantity the sampled-token reward and importance ratios use;
* exact nucleus sampling by inverse CDF on the sorted, truncated distribution, so a token outside
  the top-p nucleus can never be drawn (and no hidden default top_k=50);
* one uniform random number per prompt and position, drawn from a generator seeded by that
  prompt's own seed: a prompt gets the same rollout whatever batch or process it lands in, which
  makes resumed and data-parallel runs reproduce single-process ones.

The response mask covers tokens up to and including the first EOS: a model may emit the pad
token mid-response, so padding is never inferred from token values. A batch also carries an
action mask, the tokens the model sampled: in a single-turn rollout it equals the response mask;
multi-turn episodes (:mod:`opd.rollout.episodes`) interleave the model's turns with environment tokens
that are real (response mask) but not the model's (action mask), and only the latter are trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers import PreTrainedModel

from opd.errors import UserError
from opd.models.loading import model_device


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
    """

    input_ids_NL: torch.Tensor
    attention_mask_NL: torch.Tensor
    prompt_len: int
    response_ids_NT: torch.Tensor
    response_mask_NT: torch.Tensor
    logprobs_NT: torch.Tensor
    finished_N: torch.Tensor
    action_mask_NT: torch.Tensor | None = None

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
        )


class RolloutEngine(Protocol):
    """What the trainer needs from a generation backend."""

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> RolloutBatch: ...


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
) -> torch.Tensor:
    """Draw one token per row from the top-p nucleus of softmax(logits / temperature).

    The nucleus is the smallest set of most probable tokens whose mass reaches ``top_p`` (the
    most probable token is always in it). ``u_N`` holds uniforms in [0, 1): inverse-CDF sampling
    on the sorted, truncated masses makes the draw a deterministic function of ``u``. A row whose
    ``c`` most probable tokens already hold ``top_p`` of the mass draws from those alone (the same
    token a full sort gives), for each ``c`` of ``candidates`` in turn; only the rows no round
    settles sort the whole vocabulary.

    Shapes: logits_NV: (N, V); u_N: (N,) -> ids_N: (N,) int64
    """
    probs_NV = torch.softmax(logits_NV.float() / temperature, dim=-1)
    out_N = torch.empty(probs_NV.shape[0], dtype=torch.long, device=probs_NV.device)
    todo_R = torch.arange(probs_NV.shape[0], device=probs_NV.device)
    rounds = (candidates,) if isinstance(candidates, int) else candidates
    for c in rounds if top_p < 1.0 else ():  # top-p 1 keeps every token: only the full sort holds it
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


def _inverse_cdf_draw(sorted_p_NC: torch.Tensor, ids_NC: torch.Tensor, u_N: torch.Tensor, top_p: float) -> torch.Tensor:
    """The draw on probabilities sorted descending (a prefix that holds the nucleus is enough)."""
    mass_before = sorted_p_NC.cumsum(-1) - sorted_p_NC
    cdf = (sorted_p_NC * (mass_before < top_p)).cumsum(-1)
    target = (u_N.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=sorted_p_NC.shape[-1] - 1)
    return ids_NC.gather(-1, pick).squeeze(-1)


def _can_drop_rows(cache) -> bool:
    """Whether this cache holds only plain key/value layers, whose rows ``batch_select_indices``
    drops. Hybrid layers (linear attention or Mamba next to attention) inherit that method but
    leave their recurrent states whole, so their batch would fall out of step: never compact them."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    return isinstance(cache, DynamicCache) and all(
        type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers
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


def prompt_uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """One uniform per (prompt, position), each prompt from its own seeded generator: (N, steps).

    Drawn on the CPU whatever device the model is on, so a prompt's rollout does not depend on it."""
    rows = []
    for s in seeds:
        g = torch.Generator().manual_seed(int(s) % (2**63 - 1))
        rows.append(torch.rand(steps, generator=g, dtype=torch.float64, device="cpu"))
    return torch.stack(rows)


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


def sample_next(
    logits_NV: torch.Tensor, u_N: torch.Tensor, temperature: float, top_p: float, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its log-prob under the unmodified policy (temperature 1,
    no top-p): the quantity the sampled-token reward and importance ratios use.

    Shapes: logits_NV: (N, V); u_N: (N,) -> ids_N: (N,) int64, logp_N: (N,) float32
    """
    logits = logits_NV.float()
    tok = logits.argmax(-1) if greedy else nucleus_sample(logits, u_N, temperature, top_p)
    return tok, torch.log_softmax(logits, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def prefill(model: PreTrainedModel, ids_NP: torch.Tensor, attn_NP: torch.Tensor):
    """The forward over left-padded prompts that starts a KV cache: (model output, position ids).

    Positions count real tokens only, so a left-padded row is computed as it would be alone."""
    positions = (attn_NP.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids_NP, attention_mask=attn_NP, position_ids=positions, use_cache=True, logits_to_keep=1)
    return out, positions


class HFRollout:
    """Sampling with the KV cache from a Hugging Face causal LM (the default backend)."""

    def __init__(self, model: PreTrainedModel, eos_id: int, pad_id: int, max_context: int | None = None):
        self.model = model
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None)

    @torch.no_grad()
    def generate(self, prompt_ids, seeds, *, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False) -> RolloutBatch:
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
        out, positions = prefill(self.model, ids, attn)
        cache = out.cache
        compact = _can_drop_rows(cache)
        resp = torch.full((N, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        logp = torch.zeros(N, max_new_tokens, device=dev)
        resp_mask = torch.zeros(N, max_new_tokens, dtype=torch.bool, device=dev)
        finished = torch.zeros(N, dtype=torch.bool, device=dev)
        # rows still in the model's batch (global indices), with their attention mask and next position
        live, live_attn, live_pos = torch.arange(N, device=dev), attn, positions[:, -1] + 1
        for t in range(max_new_tokens):
            tok, lp = sample_next(out.logits[:, -1], u[live, t], temperature, top_p, greedy)
            alive = ~finished[live]
            tok = torch.where(alive, tok, torch.full_like(tok, self.pad_id))
            resp[live, t], resp_mask[live, t] = tok, alive
            logp[live, t] = torch.where(alive, lp, 0.0)
            finished[live] = finished[live] | (alive & (tok == self.eos_id))
            still = ~finished[live]
            n_still = int(still.sum())  # rows outside the batch are finished: one count serves both tests below
            if n_still == 0 or t == max_new_tokens - 1:
                break
            if compact and n_still <= COMPACT_BELOW * live.numel():
                keep = still.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, live_attn, live_pos, tok = live[keep], live_attn[keep], live_pos[keep], tok[keep]
                still = still[keep]
            live_attn = torch.cat([live_attn, still.long().unsqueeze(-1)], dim=-1)
            out = self.model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=live_attn,
                position_ids=live_pos.unsqueeze(-1),
                cache=cache,
                use_cache=True,
            )
            live_pos = live_pos + 1
        self.model.train(was_training)
        resp, logp, resp_mask = resp[:, : t + 1], logp[:, : t + 1], resp_mask[:, : t + 1]
        full_ids = torch.cat([ids, resp], dim=1)
        full_mask = torch.cat([attn, resp_mask.long()], dim=1)
        return RolloutBatch(full_ids, full_mask, P, resp, resp_mask, logp, finished, action_mask_NT=resp_mask)
