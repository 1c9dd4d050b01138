"""A precomputed map between a teacher's and a student's vocabularies, by the bytes of each token.

Two tokens correspond when they stand for the same bytes: byte-level ``Ġhello``, SentencePiece
``▁hello`` and any other spelling of b" hello" meet, and a SentencePiece byte-fallback ``<0xE6>``
meets the byte-level token for byte 0xE6. Special tokens have no bytes; they correspond when they
have the same name (``<|im_end|>`` in both) or through ``special_pairs`` (``{"</s>":
"<|im_end|>"}``, teacher name -> student name).

The map is a pair of index tensors for the hot path: ``teacher_to_student_V[v]`` is the student
id with the bytes of teacher id v, or -1. Where several ids of one side share bytes (a regular
token and its byte-fallback twin), the map points at the regular token, then the lowest id; the
cross-tokenizer loss merges the teacher's mass of such twins. A third tensor,
``teacher_to_student_start_V``, maps the first token of a text, which a SentencePiece decoder
reads without its prefix space.

Departure from TRL's GOLD (``_initialize_vocabulary_mapping``): GOLD compares token *strings*,
so ``Ġhello`` and ``▁hello`` never match, and it crashes (``max()`` of an empty set) when the
vocabularies share nothing; here the comparison is by bytes and a vocabulary overlap below
``min_share`` is a :class:`opd.errors.UserError` that names the fix.

``unmapped="prefix"``: a teacher text token with no student token of the same bytes (``"19"``
where the student writes each digit alone) maps to the longest student token its bytes begin
with (``"1"``), so its mass counts as the teacher's for that first student token instead of
leaving the support. Without it, where the teacher's top-K is mostly such tokens (the first digit
of a number) the mapped support is only what the teacher gives the short tokens as whole tokens
(``"1"`` meaning the number 1), a target that teaches the wrong thing.

Usage::

    vmap = build_vocab_map(student_tok, teacher_tok, teacher_rows=teacher_head.shape[0])
    vmap.teacher_to_student_V   # (V_t,) int64, -1 where no student token has the same bytes
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import cast

import torch

from opd.crosstok.token_bytes import VocabBytes
from opd.errors import UserError

__all__ = ["JOINABLE", "UNMAPPED", "VocabMap", "build_vocab_map", "longest_prefix_id", "student_ids_by_bytes"]

UNMAPPED = ("drop", "prefix")  # a teacher token with no same-bytes student token: left out, or its first student token
# A support token the teacher's tokenizer would have joined to its token before the position ("5"
# after its "1", where it writes "15"): kept, or dropped (opd.teachers.crosstok).
JOINABLE = ("keep", "drop")


@dataclass
class VocabMap:
    """Teacher <-> student id maps (-1: no counterpart) and how much of the teacher maps.

    ``teacher_to_student_start_V`` is the map for the first token of a text, where a decoder
    that strips the prefix space reads ``▁hello`` as b"hello" (so it meets the student's
    ``hello``, not ``Ġhello``); it is ``teacher_to_student_V`` itself when neither tokenizer has
    such a rule.

    Shapes:
        teacher_to_student_V, teacher_to_student_start_V: (V_t,) int64; student_to_teacher_V: (V_s,) int64
    """

    teacher_to_student_V: torch.Tensor
    student_to_teacher_V: torch.Tensor
    n_mapped: int  # teacher text tokens with a student token of the same bytes
    n_teacher_text: int  # teacher ids that are text (have bytes)
    special_pairs: dict[int, int] = field(default_factory=dict)  # student special id -> teacher special id
    teacher_to_student_start_V: torch.Tensor | None = None
    n_prefix: int = 0  # with unmapped="prefix": teacher text tokens mapped to the student token they begin with

    def __post_init__(self):
        if self.teacher_to_student_start_V is None:
            self.teacher_to_student_start_V = self.teacher_to_student_V

    @property
    def share(self) -> float:
        """Share of the teacher's text tokens that have a student counterpart."""
        return self.n_mapped / max(self.n_teacher_text, 1)

    def to(self, device) -> VocabMap:
        same = self.teacher_to_student_start_V is self.teacher_to_student_V
        t2s = self.teacher_to_student_V.to(device)
        return VocabMap(
            t2s,
            self.student_to_teacher_V.to(device),
            self.n_mapped,
            self.n_teacher_text,
            dict(self.special_pairs),
            t2s if same else cast(torch.Tensor, self.teacher_to_student_start_V).to(device),  # set by __post_init__
            self.n_prefix,
        )


def _as_bytes(tok_or_bytes, name: str) -> VocabBytes:
    return tok_or_bytes if isinstance(tok_or_bytes, VocabBytes) else VocabBytes.from_tokenizer(tok_or_bytes, name)


def _canonical_ids(keys: list[bytes | None], fallback: frozenset[int], prefer: frozenset[int]) -> dict[bytes, int]:
    """bytes -> the id that stands for them: a preferred id, then a regular token before a
    byte-fallback twin, then the lowest id."""
    out: dict[bytes, int] = {}
    rank = lambda i: (i not in prefer, i in fallback, i)
    for i, b in enumerate(keys):
        if b and (b not in out or rank(i) < rank(out[b])):
            out[b] = i
    return out


def _index_map(keys: list[bytes | None], target: dict[bytes, int], rows: int) -> tuple[torch.Tensor, int]:
    """(rows,) tensor: target id of each key (-1: none or special), and how many text keys map."""
    out = torch.full((rows,), -1, dtype=torch.long)
    mapped = [(v, target[b]) for v, b in enumerate(keys) if b is not None and b in target]
    if mapped:
        src, dst = zip(*mapped)
        out[list(src)] = torch.tensor(dst, dtype=torch.long)
    return out, len(mapped)


def longest_prefix_id(b: bytes, target: dict[bytes, int], longest: int, proper: bool = False) -> int:
    """The id of the longest prefix of ``b`` (shorter than ``b`` if ``proper``) that ``target``
    holds (``longest``: its longest key), or -1."""
    for n in range(min(len(b) - proper, longest), 0, -1):
        if b[:n] in target:
            return target[b[:n]]
    return -1


def _fill_prefixes(out: torch.Tensor, keys: list[bytes | None], target: dict[bytes, int]) -> int:
    """Map each unmapped key (``out`` -1) to the target id of the longest proper prefix of its
    bytes that has one; returns how many were filled."""
    filled = 0
    longest = max(map(len, target), default=0)
    for v, b in enumerate(keys):
        if b is not None and int(out[v]) < 0:
            out[v] = longest_prefix_id(b, target, longest, proper=True)
            filled += int(out[v]) >= 0
    return filled


def student_ids_by_bytes(student) -> dict[bytes, int]:
    """bytes -> the student id that stands for them (a regular token before a byte-fallback twin)."""
    s = _as_bytes(student, "student")
    return _canonical_ids(s.token_bytes, s.byte_fallback_ids, frozenset())


def _start_keys(vb: VocabBytes) -> tuple[list[bytes | None], frozenset[int]]:
    """Every id's bytes as the first token of a text, and the ids that rule changes (``▁hello``):
    the form the tokenizer itself writes at a text start, so the one to map to."""
    if not vb.has_start_rule:
        return vb.token_bytes, frozenset()
    keys = [vb.start_bytes_of(i) for i in range(len(vb))]
    return keys, frozenset(i for i, (a, b) in enumerate(zip(keys, vb.token_bytes)) if a != b)


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
    unmapped: str = "drop",
) -> VocabMap:
    """Map two vocabularies (tokenizers or :class:`VocabBytes`) onto each other by token bytes.

    ``student_rows`` / ``teacher_rows``: the models' head sizes when they exceed the tokenizers
    (padded embeddings); the extra rows map to -1. A teacher whose text tokens map less than
    ``min_share`` is refused (UserError; a map with no text token in common is refused at any
    ``min_share``), below ``warn_share`` a warning says so: with little overlap the
    cross-tokenizer LSM support is mostly empty. ``unmapped``: ``"drop"`` (a teacher token with no
    student token of the same bytes maps to -1) or ``"prefix"`` (to the longest student token its
    bytes begin with; see the module docstring).
    """
    if unmapped not in UNMAPPED:
        raise ValueError(f"unmapped={unmapped!r}: choose one of {', '.join(UNMAPPED)}")
    s = _as_bytes(student, "student")
    t = _as_bytes(teacher, "teacher")
    s_rows = max(len(s), student_rows or 0)
    t_rows = max(len(t), teacher_rows or 0)
    none: frozenset[int] = frozenset()
    s_ids = _canonical_ids(s.token_bytes, s.byte_fallback_ids, none)
    t2s, n_mapped = _index_map(t.token_bytes, s_ids, t_rows)
    s2t, _ = _index_map(s.token_bytes, _canonical_ids(t.token_bytes, t.byte_fallback_ids, none), s_rows)
    n_prefix = _fill_prefixes(t2s, t.token_bytes, s_ids) if unmapped == "prefix" else 0
    t2s_start = t2s
    if s.has_start_rule or t.has_start_rule:
        (s_keys, s_prefer), (t_keys, _) = _start_keys(s), _start_keys(t)
        s_start_ids = _canonical_ids(s_keys, s.byte_fallback_ids, s_prefer)
        t2s_start, _ = _index_map(t_keys, s_start_ids, t_rows)
        if unmapped == "prefix":
            _fill_prefixes(t2s_start, t_keys, s_start_ids)
    pairs = _special_pairs(s, t, special_pairs or {})
    for s_id, t_id in pairs.items():
        t2s[t_id], t2s_start[t_id], s2t[s_id] = s_id, s_id, t_id
    n_text = sum(b is not None for b in t.token_bytes)
    vmap = VocabMap(t2s, s2t, n_mapped, n_text, pairs, t2s_start, n_prefix)
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
