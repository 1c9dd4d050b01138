"""A precomputed map between a teacher's and a student's vocabularies, by the bytes of each token.

Two tokens correspond when they stand for the same bytes: byte-level ``Ġhello``, SentencePiece
``▁hello`` and any other spelling of b" hello" meet, and a SentencePiece byte-fallback ``<0xE6>``
meets the byte-level token for byte 0xE6. Special tokens have no bytes; they correspond when they
have the same name (``<|im_end|>`` in both) or through ``special_pairs`` (``{"</s>":
"<|im_end|>"}``, teacher name -> student name).

The map is a pair of index tensors for the hot path: ``teacher_to_student_V[v]`` is the student
id with the bytes of teacher id v, or -1. Where several ids of one side share bytes (a regular
token and its byte-fallback twin), the map points at the regular token, then the lowest id; the
cross-tokenizer loss merges the teacher's mass of such twins.

Departure from TRL's GOLD (``_initialize_vocabulary_mapping``): GOLD compares token *strings*,
so ``Ġhello`` and ``▁hello`` never match, and it crashes (``max()`` of an empty set) when the
vocabularies share nothing; here the comparison is by bytes and a vocabulary overlap below
``min_share`` is a :class:`opd.errors.UserError` that names the fix.

Usage::

    vmap = build_vocab_map(student_tok, teacher_tok, teacher_rows=teacher_head.shape[0])
    vmap.teacher_to_student_V   # (V_t,) int64, -1 where no student token has the same bytes
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from opd.crosstok.token_bytes import VocabBytes
from opd.errors import UserError

__all__ = ["VocabMap", "build_vocab_map"]


@dataclass
class VocabMap:
    """Teacher <-> student id maps (-1: no counterpart) and how much of the teacher maps.

    Shapes:
        teacher_to_student_V: (V_t,) int64; student_to_teacher_V: (V_s,) int64
    """

    teacher_to_student_V: torch.Tensor
    student_to_teacher_V: torch.Tensor
    n_mapped: int  # teacher text tokens with a student token of the same bytes
    n_teacher_text: int  # teacher ids that are text (have bytes)
    special_pairs: dict[int, int] = field(default_factory=dict)  # student special id -> teacher special id

    @property
    def share(self) -> float:
        """Share of the teacher's text tokens that have a student counterpart."""
        return self.n_mapped / max(self.n_teacher_text, 1)

    def to(self, device) -> VocabMap:
        return VocabMap(
            self.teacher_to_student_V.to(device),
            self.student_to_teacher_V.to(device),
            self.n_mapped,
            self.n_teacher_text,
            dict(self.special_pairs),
        )


def _as_bytes(tok_or_bytes, name: str) -> VocabBytes:
    return tok_or_bytes if isinstance(tok_or_bytes, VocabBytes) else VocabBytes.from_tokenizer(tok_or_bytes, name)


def _canonical_ids(vb: VocabBytes) -> dict[bytes, int]:
    """bytes -> the id that stands for them: a regular token before a byte-fallback twin, then the lowest id."""
    out: dict[bytes, int] = {}
    for i, b in enumerate(vb.token_bytes):
        if not b:
            continue
        j = out.get(b)
        if j is None or (j in vb.byte_fallback_ids and i not in vb.byte_fallback_ids):
            out[b] = i
    return out


def _special_pairs(s: VocabBytes, t: VocabBytes, extra: dict[str, str]) -> dict[int, int]:
    pairs = {s.special_names[n]: t.special_names[n] for n in s.special_names.keys() & t.special_names.keys()}
    for t_name, s_name in extra.items():
        for side, name in (("teacher", t_name), ("student", s_name)):
            vb = t if side == "teacher" else s
            if name not in vb.special_names:
                raise UserError(
                    f"special_pairs names {name!r}, which is not a special token of the {side} tokenizer "
                    f"({vb.name}); its special tokens: {', '.join(sorted(vb.special_names)) or 'none'}"
                )
        pairs[s.special_names[s_name]] = t.special_names[t_name]
    return pairs


def build_vocab_map(
    student,
    teacher,
    *,
    special_pairs: dict[str, str] | None = None,
    min_share: float = 0.05,
    warn_share: float = 0.3,
    student_rows: int | None = None,
    teacher_rows: int | None = None,
) -> VocabMap:
    """Map two vocabularies (tokenizers or :class:`VocabBytes`) onto each other by token bytes.

    ``student_rows`` / ``teacher_rows``: the models' head sizes when they exceed the tokenizers
    (padded embeddings); the extra rows map to -1. A teacher whose text tokens map less than
    ``min_share`` is refused (UserError), below ``warn_share`` a warning says so: with little
    overlap the cross-tokenizer LSM support is mostly empty.
    """
    s = _as_bytes(student, "student")
    t = _as_bytes(teacher, "teacher")
    s_rows = max(len(s), student_rows or 0)
    t_rows = max(len(t), teacher_rows or 0)
    t2s = torch.full((t_rows,), -1, dtype=torch.long)
    s2t = torch.full((s_rows,), -1, dtype=torch.long)
    s_by_bytes, t_by_bytes = _canonical_ids(s), _canonical_ids(t)
    n_text = n_mapped = 0
    for v, b in enumerate(t.token_bytes):
        if b is None:
            continue
        n_text += 1
        if b in s_by_bytes:
            t2s[v] = s_by_bytes[b]
            n_mapped += 1
    for v, b in enumerate(s.token_bytes):
        if b is not None and b in t_by_bytes:
            s2t[v] = t_by_bytes[b]
    pairs = _special_pairs(s, t, special_pairs or {})
    for s_id, t_id in pairs.items():
        t2s[t_id], s2t[s_id] = s_id, t_id
    vmap = VocabMap(t2s, s2t, n_mapped, n_text, pairs)
    _check_overlap(vmap, s, t, min_share, warn_share)
    return vmap


def _check_overlap(vmap: VocabMap, s: VocabBytes, t: VocabBytes, min_share: float, warn_share: float) -> None:
    what = (
        f"only {vmap.n_mapped} of the teacher's {vmap.n_teacher_text} text tokens ({vmap.share:.1%}) have a "
        f"student token with the same bytes (student {s.name}, teacher {t.name})"
    )
    if vmap.n_mapped == 0 or vmap.share < min_share:
        raise UserError(
            f"student and teacher vocabularies share almost nothing: {what}, so the cross-tokenizer LSM support "
            "would be empty at most positions. Use a teacher whose tokenizer covers the student's bytes "
            "(byte-level BPE, or SentencePiece with byte fallback), or the sampled-token span reward, which needs "
            "no vocabulary map; lower min_share to accept this teacher anyway"
        )
    if vmap.share < warn_share:
        warnings.warn(
            f"{what}: the cross-tokenizer LSM support will often be small; watch the mapped top-K mass diagnostic",
            stacklevel=3,
        )
