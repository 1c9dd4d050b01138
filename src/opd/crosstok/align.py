"""Align two tokenizations of one text by UTF-8 byte offsets, and turn alignments into index tensors.

A *group* closes wherever both tokenizations end a token at the same byte: the student tokens
and the teacher tokens of a group cover exactly the same bytes, and both sides' first tokens of
a group are predicted from the same text prefix. One-to-one groups (one token on each side) are
the positions where the two models predict the very same string.

How this departs from TRL's GOLD (``_align_by_byte_offsets``):

* Special tokens (BOS, EOS, template markers) are taken out before aligning, so a BOS on one
  side only never shifts or swallows a group. Specials that the vocabulary map pairs (same name,
  or ``special_pairs`` such as ``</s>`` -> ``<|im_end|>``) and that sit at the same byte form an
  empty one-to-one group -- the EOS positions, where the student learns to stop; the others are
  reported (``Alignment.student_special`` / ``teacher_special``).
* The two byte strings are compared first. Text that one tokenizer normalises differently (NFKC,
  lowercasing, a stripped prefix space) raises :class:`ByteMismatchError` naming the first byte
  that differs, or with ``on_mismatch="flag"`` aligns the agreeing prefix and reports the rest
  as unaligned, instead of misaligning everything after it silently.
* Empty text tokens (a lone ``▁`` stripped at the start of a SentencePiece text) join the group
  that starts where they sit, so they never close a group of their own.

Usage::

    s_vb, t_vb = VocabBytes.from_tokenizer(student_tok), VocabBytes.from_tokenizer(teacher_tok)
    vmap = build_vocab_map(s_vb, t_vb)
    al = align_ids(student_response_ids, teacher_response_ids, s_vb, t_vb, special_pairs=vmap.special_pairs)
    idx = alignment_tensors([al, ...], T=student_len, U=teacher_len)   # for opd.losses.cross
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from opd.crosstok.token_bytes import TokenSpans, VocabBytes
from opd.errors import UserError

__all__ = [
    "PAIRINGS",
    "Alignment",
    "AlignmentTensors",
    "ByteMismatchError",
    "Group",
    "align_ids",
    "align_spans",
    "alignment_tensors",
]

PAIRINGS = ("group_start", "one_to_one")


class ByteMismatchError(UserError):
    """The two tokenizations do not decode to the same bytes, so they cannot be aligned."""


@dataclass(frozen=True)
class Group:
    """Student and teacher token indices covering the same bytes [byte_start, byte_end)."""

    student: tuple[int, ...]
    teacher: tuple[int, ...]
    byte_start: int
    byte_end: int

    @property
    def one_to_one(self) -> bool:
        return len(self.student) == 1 and len(self.teacher) == 1


@dataclass(frozen=True)
class Alignment:
    """The groups of one sequence pair, plus every token that is in no group and why.

    ``*_special``: special tokens left unpaired (never aligned to text; paired specials, such as
    the two EOS, form empty one-to-one groups). ``*_unaligned``: text tokens past a
    byte mismatch (``mismatch_at`` is the first differing byte, None when the texts agree).
    """

    groups: tuple[Group, ...]
    student_special: tuple[int, ...]
    teacher_special: tuple[int, ...]
    student_unaligned: tuple[int, ...] = ()
    teacher_unaligned: tuple[int, ...] = ()
    mismatch_at: int | None = None
    at_text_start: bool = True  # the tokens start a text, so the group at byte 0 reads start-of-text bytes

    @property
    def one_to_one_count(self) -> int:
        return sum(g.one_to_one for g in self.groups)


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _mismatch_message(student: TokenSpans, teacher: TokenSpans, at: int) -> str:
    lo = max(0, at - 12)
    return (
        f"student and teacher tokens decode to different bytes from byte {at} on "
        f"(student {student.text[lo : at + 12]!r}, teacher {teacher.text[lo : at + 12]!r}; "
        f"{len(student.text)} vs {len(teacher.text)} bytes): the teacher's tokenizer normalises the text (NFKC, "
        "lowercase, a prefix space) or was given another text. Tokenize for the teacher VocabBytes.text(student_ids) "
        "(the student's exact bytes), check at_text_start, or pass on_mismatch='flag' to mask everything after "
        "the mismatch"
    )


def _assign(spans: TokenSpans, cuts: list[int], text_len: int, aligned_len: int):
    """Group index of each token: None for specials and for text past the aligned bytes."""
    out: list[int | None] = []
    for (start, end), special in zip(spans.spans, spans.special):
        if special:
            out.append(None)
            continue
        if end > aligned_len:
            out.append(None)
        elif start < end:
            k = bisect_left(cuts, end)
            out.append(k if k < len(cuts) else None)
        else:  # an empty text token joins the group that starts at its position
            k = bisect_right(cuts, start)
            if k == len(cuts) and cuts and start == cuts[-1] == text_len:
                k -= 1  # trailing empty token: the last group
            out.append(k if k < len(cuts) else None)
    return out


def _special_groups(
    student: TokenSpans, teacher: TokenSpans, pairs: Mapping[int, int], aligned_len: int
) -> list[Group]:
    """Pair special tokens that sit at the same byte and map to each other, keeping their order.

    Only up to ``aligned_len``: past a byte mismatch the two sides no longer read the same prefix.
    """
    by_pos: dict[int, list[int]] = {}
    for j, ((pos, _), sp) in enumerate(zip(teacher.spans, teacher.special)):
        if sp and pos <= aligned_len:
            by_pos.setdefault(pos, []).append(j)
    groups, used_up_to = [], {}
    for i, ((pos, _), sp) in enumerate(zip(student.spans, student.special)):
        want = pairs.get(student.ids[i]) if sp else None
        if want is None:
            continue
        candidates = by_pos.get(pos, [])
        start = used_up_to.get(pos, 0)
        for n in range(start, len(candidates)):
            if teacher.ids[candidates[n]] == want:
                groups.append(Group((i,), (candidates[n],), pos, pos))
                used_up_to[pos] = n + 1
                break
    return groups


def align_spans(
    student: TokenSpans,
    teacher: TokenSpans,
    on_mismatch: str = "raise",
    special_pairs: Mapping[int, int] | None = None,
) -> Alignment:
    """Groups of student and teacher tokens that close where both end at the same byte.

    ``on_mismatch``: "raise" (a :class:`ByteMismatchError` naming the first differing byte) or
    "flag" (align the agreeing prefix; the rest goes to ``*_unaligned`` and ``mismatch_at``).
    ``special_pairs`` (student special id -> teacher special id, e.g.
    :attr:`opd.crosstok.VocabMap.special_pairs`) pairs special tokens at the same byte with each
    other, in order, as empty one-to-one groups (the two EOS at the end of a response); other
    special tokens are only reported.
    """
    if on_mismatch not in ("raise", "flag"):
        raise ValueError(f"on_mismatch={on_mismatch!r}: choose 'raise' or 'flag'")
    mismatch_at = None
    aligned_len = len(student.text)
    if student.text != teacher.text:
        mismatch_at = _common_prefix(student.text, teacher.text)
        if on_mismatch == "raise":
            raise ByteMismatchError(_mismatch_message(student, teacher, mismatch_at))
        aligned_len = mismatch_at
    ends_s = {e for (s, e), sp in zip(student.spans, student.special) if not sp and s < e <= aligned_len}
    ends_t = {e for (s, e), sp in zip(teacher.spans, teacher.special) if not sp and s < e <= aligned_len}
    cuts = sorted(ends_s & ends_t)
    g_s = _assign(student, cuts, len(student.text), aligned_len)
    g_t = _assign(teacher, cuts, len(teacher.text), aligned_len)
    members_s: list[list[int]] = [[] for _ in cuts]
    members_t: list[list[int]] = [[] for _ in cuts]
    for i, k in enumerate(g_s):
        if k is not None:
            members_s[k].append(i)
    for j, k in enumerate(g_t):
        if k is not None:
            members_t[k].append(j)
    text_groups = [
        Group(tuple(ms), tuple(mt), cuts[k - 1] if k else 0, cuts[k])
        for k, (ms, mt) in enumerate(zip(members_s, members_t))
    ]
    special_groups = _special_groups(student, teacher, special_pairs or {}, aligned_len)
    paired_s = {g.student[0] for g in special_groups}
    paired_t = {g.teacher[0] for g in special_groups}
    # Order by byte, an empty special group before the text group that starts at the same byte.
    groups = sorted(text_groups + special_groups, key=lambda g: (g.byte_start, g.byte_end > g.byte_start))
    return Alignment(
        tuple(groups),
        tuple(i for i in student.special_indices if i not in paired_s),
        tuple(j for j in teacher.special_indices if j not in paired_t),
        tuple(i for i, (k, sp) in enumerate(zip(g_s, student.special)) if k is None and not sp),
        tuple(j for j, (k, sp) in enumerate(zip(g_t, teacher.special)) if k is None and not sp),
        mismatch_at,
        student.at_text_start and teacher.at_text_start,
    )


def align_ids(
    student_ids,
    teacher_ids,
    student_bytes: VocabBytes,
    teacher_bytes: VocabBytes,
    at_text_start: bool = True,
    on_mismatch: str = "raise",
    special_pairs: Mapping[int, int] | None = None,
) -> Alignment:
    """:func:`align_spans` of two id sequences (lists or 1-D tensors) of the same text.

    Pass only the tokens to align (a response, without left padding): padding ids are usually
    special and would only be reported, but a pad that is a text token would be aligned.
    """
    s = student_bytes.spans(student_ids, at_text_start)
    t = teacher_bytes.spans(teacher_ids, at_text_start)
    return align_spans(s, t, on_mismatch, special_pairs)


class AlignmentTensors(NamedTuple):
    """Alignments of a batch as index tensors for :mod:`opd.losses.cross`.

    Shapes:
        teacher_pos_BT: (B, T) int64, the teacher position whose next-token distribution student
            position t is compared with (-1: none)
        one_to_one_BT: (B, T) bool, student position t is a one-to-one group
        student_group_BT: (B, T) int64, group index of student position t within its row (-1: none)
        teacher_group_BU: (B, U) int64, group index of teacher position u within its row (-1: none)
        text_start_BT: (B, T) bool, student position t is paired at the start of a text, where
            the vocabulary map's ``teacher_to_student_start_V`` applies
    """

    teacher_pos_BT: torch.Tensor
    one_to_one_BT: torch.Tensor
    student_group_BT: torch.Tensor
    teacher_group_BU: torch.Tensor
    text_start_BT: torch.Tensor


def alignment_tensors(
    alignments: Sequence[Alignment],
    T: int,
    U: int,
    student_offsets: Sequence[int] | None = None,
    teacher_offsets: Sequence[int] | None = None,
    pairing: str = "group_start",
    device: torch.device | str = "cpu",
) -> AlignmentTensors:
    """Index tensors of B alignments; token i of row b sits at column ``student_offsets[b] + i``.

    ``pairing`` decides which student positions get a teacher distribution:
    ``"group_start"`` (default): the first student token of every group, paired with the first
    teacher token of the group. Both are predicted from the same text prefix (a group starts at a
    byte where both tokenizations end a token), so their next-token distributions are over the
    same continuations; the other tokens of a many-to-many group have no teacher position with
    the same prefix and are left out. ``"one_to_one"``: only one-to-one groups.
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r}: choose one of {', '.join(PAIRINGS)}")
    B = len(alignments)
    s_off = [0] * B if student_offsets is None else list(student_offsets)
    t_off = [0] * B if teacher_offsets is None else list(teacher_offsets)
    # Python lists, turned into tensors once: per-group tensor writes cost more than the loop.
    teacher_pos = [[-1] * T for _ in range(B)]
    one_to_one = [[False] * T for _ in range(B)]
    s_group = [[-1] * T for _ in range(B)]
    t_group = [[-1] * U for _ in range(B)]
    text_start = [[False] * T for _ in range(B)]
    for b, al in enumerate(alignments):
        for k, g in enumerate(al.groups):
            s_cols = [s_off[b] + i for i in g.student]
            t_cols = [t_off[b] + j for j in g.teacher]
            if max(s_cols) >= T or max(t_cols) >= U or min(s_cols + t_cols) < 0:
                raise ValueError(
                    f"row {b}: group {k} reaches student column {max(s_cols)} / teacher column {max(t_cols)}, "
                    f"outside T={T} / U={U}; pass the tensors' widths and each row's offset of token 0"
                )
            for c in s_cols:
                s_group[b][c] = k
            for c in t_cols:
                t_group[b][c] = k
            if g.one_to_one:
                one_to_one[b][s_cols[0]] = True
            if g.one_to_one or pairing == "group_start":
                teacher_pos[b][s_cols[0]] = t_cols[0]
                text_start[b][s_cols[0]] = al.at_text_start and g.byte_start == 0 < g.byte_end
    as_long = lambda x, width: torch.tensor(x, dtype=torch.long, device=device).view(B, width)
    as_bool = lambda x: torch.tensor(x, dtype=torch.bool, device=device).view(B, T)
    return AlignmentTensors(
        as_long(teacher_pos, T), as_bool(one_to_one), as_long(s_group, T), as_long(t_group, U), as_bool(text_start)
    )
