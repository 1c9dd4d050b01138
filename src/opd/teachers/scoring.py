"""Teacher scoring: the teacher's view of every position of the student's rollouts.

:class:`TeacherScorer` is the protocol (a served teacher speaking vLLM's ``prompt_logprobs``
format implements it: :class:`opd.teachers.client.HTTPTeacher`, ``--teacher-url``); :class:`HFTeacher`
is the in-process default. The teacher sees
exactly the student's token ids and returns, per position the student wrote (a multi-turn
episode's environment tokens are read as context but not scored), its top-K tokens with
full-vocabulary log-probs, its log-prob of the sampled token, and optionally its log-probs of
other query tokens (for student-side or union supports). Nothing here builds a gradient.

A teacher with another tokenizer (``--cross-tokenizer``, detected by comparing vocabularies) is
wrapped in :class:`opd.teachers.crosstok.CrossTokenizerTeacher`, which scores the teacher's own
tokenization of the same text and returns its scores in the student's frame. The trainer's
teacher is built by :func:`opd.teachers.factory.make_teacher`, the one module that imports every
backend (each backend imports this protocol).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from opd.errors import ServiceUnavailable, UserError
from opd.losses import Head, topk_and_gather_from_hidden
from opd.losses.head import logits_no_grad
from opd.models.head import model_head
from opd.rollout.forward import response_hidden
from opd.rollout.sampling import RolloutBatch


@dataclass
class TeacherScores:
    """Per-response-position teacher outputs.

    Shapes:
        topk_ids_NTK, topk_logprobs_NTK: (N, T, K), sorted descending
        sampled_logprobs_NT: (N, T) -- teacher log-prob of the student's sampled token
        query_logprobs_NTQ: (N, T, Q) or None -- teacher log-probs of the requested query ids
        diag_logits_MV: (M, V) or None -- full teacher logits at the requested diagnostic positions
        position_mask_NT: (N, T) bool or None -- the positions the teacher scored (None: all); a
            cross-tokenizer teacher leaves unaligned positions out, and the loss mask drops them
    ``metrics``: scalar diagnostics of the scoring, logged with the step (``cross/...``).
    """

    topk_ids_NTK: torch.Tensor
    topk_logprobs_NTK: torch.Tensor
    sampled_logprobs_NT: torch.Tensor
    query_logprobs_NTQ: torch.Tensor | None = None
    diag_logits_MV: torch.Tensor | None = None
    position_mask_NT: torch.Tensor | None = None
    metrics: dict = field(default_factory=dict)

    def select(self, rows: slice | torch.Tensor) -> TeacherScores:
        """The rows of a micro-batch (diagnostic logits and metrics are not per row and are dropped)."""
        q = None if self.query_logprobs_NTQ is None else self.query_logprobs_NTQ[rows]
        pos = None if self.position_mask_NT is None else self.position_mask_NT[rows]
        return TeacherScores(
            self.topk_ids_NTK[rows], self.topk_logprobs_NTK[rows], self.sampled_logprobs_NT[rows], q, None, pos
        )

    def narrow(self, width: int) -> TeacherScores:
        """The first ``width`` response positions (:meth:`opd.rollout.engine.RolloutBatch.narrow`)."""
        cut = lambda t: None if t is None else t[:, :width]
        q, pos = cut(self.query_logprobs_NTQ), cut(self.position_mask_NT)
        return TeacherScores(
            self.topk_ids_NTK[:, :width],
            self.topk_logprobs_NTK[:, :width],
            self.sampled_logprobs_NT[:, :width],
            q,
            None,
            pos,
        )


class TeacherUnavailable(ServiceUnavailable):
    """A served teacher stayed unreachable for all of ``--teacher-wait``: the trainer checkpoints the
    last completed step and stops (an answer the server refuses is a plain :class:`UserError`)."""


class TeacherScorer(Protocol):
    """What the trainer needs from a teacher backend."""

    def score(
        self,
        batch: RolloutBatch,
        k: int,
        query_ids_NTQ: torch.Tensor | None = None,
        diag_index_M: torch.Tensor | None = None,
    ) -> TeacherScores: ...

    def hidden_and_head(self, batch: RolloutBatch) -> tuple[torch.Tensor, Head]:
        """The final hidden states (N, T, E) that predict each response position, and the output
        head (weight (V, E), bias, scale, soft-cap), for the full-vocabulary objectives: the loss projects them a chunk of
        positions at a time, so no (N, T, V) tensor is ever formed."""
        ...


def filler_scores(
    N: int, T: int, k: int, q: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a teacher reports at positions past a rollout's end, which every loss masks out: distinct
    ids (a valid support never repeats an id), a uniform top-K and zero query log-probs.

    Shapes: returns ids_NTK (N, T, K) int64, logprobs_NTK (N, T, K) and query_logprobs_NTQ (N, T, Q)
    """
    ids = torch.arange(k, device=device).expand(N, T, k).clone()
    lps = torch.full((N, T, k), -math.log(k), dtype=dtype, device=device)
    return ids, lps, torch.zeros(N, T, q, dtype=dtype, device=device)


class HFTeacher:
    """In-process teacher: one forward pass, then a chunked pass over its output head."""

    def __init__(self, model: PreTrainedModel, chunk_size: int = 256):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.chunk_size = chunk_size

    @torch.no_grad()
    def score(self, batch, k, query_ids_NTQ=None, diag_index_M=None) -> TeacherScores:
        h_NTD = response_hidden(self.model, batch)
        head = model_head(self.model)
        N, T, D = h_NTD.shape
        sampled = batch.response_ids_NT.unsqueeze(-1)
        query = sampled if query_ids_NTQ is None else torch.cat([sampled, query_ids_NTQ], dim=-1)
        # The head runs on the positions the model wrote only: padding, and the environment's tokens
        # between an episode's turns (context every loss masks), can be a large share of a batch.
        active_A = batch.action_mask_NT.reshape(-1).nonzero().squeeze(-1)
        ids_A, lps_A, q_A = topk_and_gather_from_hidden(
            h_NTD.reshape(N * T, 1, D)[active_A], head, k, query.reshape(N * T, 1, -1)[active_A], self.chunk_size
        )
        # The losses mask non-finite teacher log-probs (a -inf is a token the softmax underflows), so NaN
        # ones would train nothing, silently. A NaN logit sorts first: the top-1 column shows every NaN row.
        nan_rows = int(torch.isnan(lps_A[..., 0]).sum())
        if nan_rows:
            raise UserError(
                f"the teacher's log-probs are NaN at {nan_rows} of {lps_A.shape[0]} scored positions: its forward "
                "pass overflows on these rollouts (its weights are finite); run it in a wider dtype (--teacher-dtype "
                "float32), or check the --teacher model"
            )
        ids, lps, q_lps = filler_scores(N, T, k, query.shape[-1], h_NTD.device, lps_A.dtype)
        ids.view(N * T, k)[active_A] = ids_A.squeeze(1)
        lps.view(N * T, k)[active_A] = lps_A.squeeze(1)
        q_lps.view(N * T, -1)[active_A] = q_A.squeeze(1)
        diag = None
        if diag_index_M is not None:
            diag = logits_no_grad(head, h_NTD.reshape(-1, D)[diag_index_M])
        return TeacherScores(
            topk_ids_NTK=ids,
            topk_logprobs_NTK=lps,
            sampled_logprobs_NT=q_lps[..., 0],
            query_logprobs_NTQ=None if query_ids_NTQ is None else q_lps[..., 1:],
            diag_logits_MV=diag,
        )

    @torch.no_grad()
    def hidden_and_head(self, batch: RolloutBatch) -> tuple[torch.Tensor, Head]:
        # In the teacher's own dtype: the loss computes in float32 whatever it is given.
        return response_hidden(self.model, batch), model_head(self.model)
