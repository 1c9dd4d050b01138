"""What a training step logs: metrics (``metrics.jsonl``) and sample rollouts (``rollouts.jsonl``).

Metric keys are namespaced: ``train/`` (loss, grad norm, clipping, lr), ``rollout/`` (length, EOS
rate, repetition, accuracy over the rollouts with a reference answer), ``diag/`` (the papers' diagnostics), ``depth/`` (per-position values
in equal-width depth buckets, for drift with depth), ``time/``, and with a cross-tokenizer teacher
``cross/`` (one-to-one share, mapped top-K mass, dropped loss positions). The full-vocabulary diagnostics
use the student and teacher logits at the step's sampled diagnostic positions; the cheap ones
(sampled-token rewards, out-of-support share) use every position of the action mask. Lengths and
rates count the tokens the model wrote (the action mask), never the environment's tokens between
the turns of an episode; an episode's rollout record shows those tokens, flagged and unscored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from opd import metrics as M
from opd.losses import Head, topk_and_gather_from_hidden
from opd.rollout.engine import RolloutBatch
from opd.runs.records import MODEL_FIELDS
from opd.tasks import Example
from opd.teachers.scoring import TeacherScores

DEPTH_BUCKETS = 8


@dataclass
class StepUpdate:
    """What the update stage hands to logging: its first update's values, detached.

    Shapes:
        loss_NT: (N, T) per-position loss; diag_hidden_MD: (M, D) the student's final hidden states
        at the step's diagnostic positions; log_hidden_LTD: (L, T, D) those of the logged rollouts
    """

    loss: float
    grad_norm: float
    clipped: bool
    lr: float
    loss_NT: torch.Tensor
    diag_hidden_MD: torch.Tensor
    log_hidden_LTD: torch.Tensor


def _full_vocab_diagnostics(s_MV: torch.Tensor, t_MV: torch.Tensor, k: int) -> dict:
    if s_MV.shape[0] == 0:
        return {}
    s, t = s_MV.unsqueeze(0).float(), t_MV.unsqueeze(0).float()
    ones = torch.ones(s.shape[:2], dtype=torch.bool, device=s.device)
    t_ids = M.topk_ids(t, k)
    kl = (torch.softmax(s, -1) * (torch.log_softmax(s, -1) - torch.log_softmax(t, -1))).sum(-1)
    student_support = M.support_mass(s, t_ids, ones)
    overlap_student, overlap_teacher = M.overlap_mass(s, t, k, ones)
    return {
        "train/kl_to_teacher": float(kl.mean()),
        "diag/overlap": M.topk_overlap_ratio(s, t, k, ones),
        "diag/overlap_advantage": M.overlap_token_advantage(s, t, k, ones),
        "diag/overlap_mass_student": overlap_student,
        "diag/overlap_mass_teacher": overlap_teacher,
        "diag/entropy_gap": M.entropy_gap(s, t, ones),
        "diag/student_entropy": M.entropy(s, ones),
        "diag/teacher_entropy": M.entropy(t, ones),
        "diag/student_support_mass": student_support,
        "diag/teacher_support_mass": M.support_mass(t, t_ids, ones),
        "diag/student_tail_mass": 1.0 - student_support,
    }


def step_metrics(
    batch: RolloutBatch,
    correct: list[float | None],
    scores: TeacherScores,
    upd: StepUpdate,
    mask_NT: torch.Tensor,
    head: Head,
    k: int,
    horizon: int,
    format_ids: list[int],
) -> dict:
    """One rank's metrics of a step; ``horizon`` (max new tokens) fixes the depth buckets;
    ``format_ids``: the special tokens whose share of responses or actions is logged (not EOS).
    ``correct``: each rollout's reward, None for a prompt without a reference answer: the accuracy
    is over the graded rollouts (absent when there is none) and ``rollout/ungraded`` counts the others."""
    resp = cast(torch.Tensor, batch.action_mask_NT)  # set by RolloutBatch.__post_init__
    reward_NT = (scores.sampled_logprobs_NT - batch.logprobs_NT) * resp
    s_MV = head.logits(upd.diag_hidden_MD)  # the step's few diagnostic positions only
    # A fixed horizon keeps bucket b the same depth range at every step, whatever the batch's length.
    depth_reward, _ = M.by_position_bucket(reward_NT, resp, DEPTH_BUCKETS, horizon=horizon)
    depth_loss, _ = M.by_position_bucket(upd.loss_NT, mask_NT, DEPTH_BUCKETS, horizon=horizon)
    return {
        "train/loss": upd.loss,
        "train/grad_norm": upd.grad_norm,
        "train/clipped": upd.clipped,
        "train/lr": upd.lr,
        "train/loss_tokens": int(mask_NT.sum()),
        "rollout/response_len": float(resp.sum(-1).float().mean()),
        "rollout/eos_rate": float(batch.finished_N.float().mean()),
        "rollout/repetition_rate": M.repetition_rate(batch.response_ids_NT, resp),
        **_accuracy(correct),
        "rollout/format_token_rate": _share(*M.format_token_share(batch.response_ids_NT, resp, format_ids)),
        "diag/reward_mean": M.masked_mean(reward_NT, resp),
        "diag/negative_reward": M.negative_reward_share(batch.logprobs_NT, scores.sampled_logprobs_NT, resp),
        "diag/out_of_support": M.out_of_support_share(batch.response_ids_NT, scores.topk_ids_NTK, resp),
        # From the teacher's top-K log-probs at every position: a served teacher's too.
        "diag/teacher_tail_mass": M.tail_mass(scores.topk_logprobs_NTK, resp),
        # A served teacher returns no full logits: those diagnostics are then absent, not faked.
        **(
            {}
            if scores.diag_logits_MV is None
            else _full_vocab_diagnostics(s_MV, scores.diag_logits_MV, min(k, head.vocab))
        ),
        "depth/reward": depth_reward.tolist(),
        "depth/loss": depth_loss.tolist(),
        **scores.metrics,  # cross/ diagnostics of a cross-tokenizer teacher
    }


def _accuracy(correct: list[float | None]) -> dict:
    graded = [c for c in correct if c is not None]
    ungraded = len(correct) - len(graded)
    return {
        **({"rollout/accuracy": sum(graded) / len(graded)} if graded else {}),
        **({"rollout/ungraded": ungraded} if ungraded else {}),
    }


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


FULL_VOCAB_KEYS = (
    "train/kl_to_teacher",
    "diag/overlap",
    "diag/overlap_advantage",
    "diag/overlap_mass_student",
    "diag/overlap_mass_teacher",
    "diag/entropy_gap",
    "diag/student_entropy",
    "diag/teacher_entropy",
    "diag/student_support_mass",
    "diag/teacher_support_mass",
    "diag/student_tail_mass",
)


def metric_weights(
    batch, mask_NT: torch.Tensor, n_diag: int, horizon: int, correct: list[float | None] | None = None
) -> dict:
    """What each of :func:`step_metrics`' values is a mean over, for merging ranks' records
    (:func:`opd.training.distributed.merge_metrics`): rollouts (accuracy: the graded ones), response
    tokens, diagnostic positions, or per depth bucket its positions; loss tokens and ungraded rollouts add
    up (a rank without the count had none), timings take the slowest rank, and the loss, gradient norm and
    learning rate are already global."""
    resp = batch.action_mask_NT
    return {
        "rollout/": batch.num_rollouts,
        "rollout/accuracy": batch.num_rollouts if correct is None else sum(c is not None for c in correct),
        "rollout/ungraded": "sum",
        "diag/": int(resp.sum()),
        "cross/": int(resp.sum()),
        **{k: n_diag for k in FULL_VOCAB_KEYS},
        "rollout/format_token_rate": M.format_token_share(batch.response_ids_NT, resp, [])[1],  # segments
        "train/loss_tokens": "sum",
        "time/": "max",
        "depth/reward": M.by_position_bucket(resp.float(), resp, DEPTH_BUCKETS, horizon=horizon)[1].tolist(),
        "depth/loss": M.by_position_bucket(mask_NT.float(), mask_NT, DEPTH_BUCKETS, horizon=horizon)[1].tolist(),
    }


def _model_fields(
    tok: PreTrainedTokenizerBase,
    student_lp: torch.Tensor,
    batch: RolloutBatch,
    scores: TeacherScores,
    upd: StepUpdate,
    mask_NT: torch.Tensor,
    r: int,
    at: torch.Tensor,
) -> dict:
    """Row ``r``'s per-token fields at response positions ``at``, one list entry per position;
    ``student_lp``: (L, T, K) the student's log-probs of the teacher's top-K ids."""
    ids = batch.response_ids_NT[r, at]
    topk = scores.topk_ids_NTK[r, at]
    uniq = topk.unique().tolist()
    return {
        "tokens": tok.convert_ids_to_tokens(ids.tolist()),
        "token_ids": ids.tolist(),
        "loss_mask": mask_NT[r, at].tolist(),
        "student_logprobs": [round(x, 5) for x in batch.logprobs_NT[r, at].tolist()],
        "teacher_logprobs": [round(x, 5) for x in scores.sampled_logprobs_NT[r, at].float().tolist()],
        "token_loss": [round(x, 6) for x in upd.loss_NT[r, at].float().tolist()],
        "teacher_topk_ids": topk.tolist(),
        "teacher_topk_logprobs": [
            [round(x, 4) for x in row] for row in scores.topk_logprobs_NTK[r, at].float().tolist()
        ],
        "student_topk_logprobs": [[round(x, 4) for x in row] for row in student_lp[r, at].tolist()],
        # Each distinct top-K id once, so the report can label the inspector's bars without a tokenizer.
        "topk_tokens": dict(zip(map(str, uniq), tok.convert_ids_to_tokens(uniq))),
    }


def _episode_fields(fields: dict, tok, batch: RolloutBatch, r: int, episode) -> dict:
    """Widen an episode's action-token fields to its whole response region (replies as context,
    flagged ``action`` 0) and add what happened at each turn."""
    everything = batch.response_mask_NT[r].nonzero().squeeze(-1)
    action = cast(torch.Tensor, batch.action_mask_NT)[r, everything].tolist()  # set by __post_init__
    ids = batch.response_ids_NT[r, everything].tolist()
    widened = {}
    for key in MODEL_FIELDS:
        values = iter(fields[key])
        widened[key] = [next(values) if a else None for a in action]
    loss = iter(fields["loss_mask"])
    # The observation after turn i is the game's reply to it; a turn that ended the episode by the
    # budget or an engine error has none.
    after = episode.observations[1:]
    turns = [
        {
            "start": start,
            "end": end,
            "action": act,
            "reward": reward,
            "observation": after[i] if i < len(after) else None,
        }
        for i, ((start, end), act, reward) in enumerate(
            zip(episode.spans, episode.actions, episode.rewards, strict=True)
        )
    ]
    return {
        **fields,
        **widened,
        "tokens": tok.convert_ids_to_tokens(ids),
        "token_ids": ids,
        "action": [int(a) for a in action],
        "loss_mask": [bool(next(loss)) if a else False for a in action],
        "game": episode.game_id,
        "end": episode.end,
        "won": episode.won,
        "invalid_actions": episode.invalid_actions,
        "turns": turns,
    }


def rollout_records(
    tok: PreTrainedTokenizerBase,
    head: Head,
    step: int,
    batch: RolloutBatch,
    examples: list[Example],
    texts: list[str],
    correct: list[float | None],
    scores: TeacherScores,
    upd: StepUpdate,
    mask_NT: torch.Tensor,
    episodes: list | None = None,
) -> list[dict]:
    """Per-token detail of the first few rollouts, for the report's token inspector.

    A single-turn rollout's record holds the tokens the model wrote (its response up to its end).
    An episode's (``episodes``: its :class:`~opd.rollout.episodes.EpisodeRecord` per row) holds its whole
    response region, so the inspector can show the turns in their context: ``action`` flags the
    model's tokens, the per-token model fields are null at the environment's, and ``turns`` gives
    each turn's span, action, reward and the observation that answered it."""
    h = upd.log_hidden_LTD
    # The student's log-probs of the teacher's top-K ids, from its own head a chunk of positions at a
    # time: no (rows x length x vocabulary) tensor, however long the logged responses.
    _, _, student_lp = topk_and_gather_from_hidden(h, head, 1, scores.topk_ids_NTK[: h.shape[0]])
    records = []
    actions_NT = cast(torch.Tensor, batch.action_mask_NT)  # set by RolloutBatch.__post_init__
    for r in range(h.shape[0]):
        at = actions_NT[r].nonzero().squeeze(-1)  # a prefix in single-turn rollouts
        fields = _model_fields(tok, student_lp, batch, scores, upd, mask_NT, r, at)
        if episodes is not None:
            fields = _episode_fields(fields, tok, batch, r, episodes[r])
        example = examples[r]
        records.append(
            {
                "step": step,
                "prompt": example.prompt,
                "answer": example.answer,
                "response": texts[r],
                "correct": None if correct[r] is None else bool(correct[r]),  # None: no answer to grade
                **fields,
            }
        )
    return records
