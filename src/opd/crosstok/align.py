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
* The two byte strings are compared first. Text that reads differently for the teacher (bytes that
  are not UTF-8 and became U+FFFD, a normaliser's NFKC or lowercasing, a stripped prefix space)
  raises :class:`ByteMismatchError` naming the first byte that differs; ``on_mismatch="flag"``
  aligns the agreeing prefix and reports the rest as unaligned; ``on_mismatch="resync"`` (what
  the trainer uses) finds the stretches where the two texts agree again (:func:`_byte_blocks`)
  and resumes grouping at the first byte after a differing stretch where both tokenizations end
  a token, so only the tokens that overlap a differing stretch are left unaligned. GOLD instead
  walks the two offset lists as if the texts were equal, misaligning everything after the first
  difference without a word.
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
from difflib import SequenceMatcher
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

PAIRINGS = ("group_start", "one_to_one", "within_group")
ON_MISMATCH = ("raise", "flag", "resync")


class ByteMismatchError(UserError):
    """The two tokenizations do not decode to the same bytes, so they cannot be aligned."""


@dataclass(frozen=True)
class Group:
    """Student and teacher token indices covering the same bytes: [byte_start, byte_end) of the
    student's text, [byte_start + teacher_shift, byte_end + teacher_shift) of the teacher's.

    ``teacher_shift`` is 0 unless a differing stretch before the group changed the texts' lengths
    (a U+FFFD for one invalid byte is 3 bytes): the group was re-synchronised.
    """

    student: tuple[int, ...]
    teacher: tuple[int, ...]
    byte_start: int
    byte_end: int
    teacher_shift: int = 0

    @property
    def one_to_one(self) -> bool:
        return len(self.student) == 1 and len(self.teacher) == 1


@dataclass(frozen=True)
class Alignment:
    """The groups of one sequence pair, plus every token that is in no group and why.

    ``*_special``: special tokens left unpaired (never aligned to text; paired specials, such as
    the two EOS, form empty one-to-one groups). ``*_unaligned``: text tokens that overlap bytes
    where the texts differ (with ``on_mismatch="flag"``: every token past the first difference);
    ``mismatch_at`` is the first differing byte of the student's text, None when the texts agree.
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
        "(the student's exact bytes), check at_text_start, or pass on_mismatch='resync' to leave out only the "
        "tokens where the texts differ"
    )


def _byte_blocks(a: bytes, b: bytes, resync: bool) -> list[tuple[int, int, int]]:
    """The stretches (a_start, b_start, length) where ``a`` and ``b`` agree, in order.

    The first is always the common prefix, even when empty (special tokens before any text sit
    in it). Without ``resync`` that is all. With it, the common suffix is cut off as well (cheap,
    and the usual case is one short differing stretch) and difflib's matching blocks (longest
    match first, no junk heuristic) are found in what lies between.
    """
    n = _common_prefix(a, b)
    if not resync or n == len(a) == len(b):
        return [(0, 0, n)]
    m, limit = 0, min(len(a), len(b)) - n
    while m < limit and a[-1 - m] == b[-1 - m]:
        m += 1
    middle = SequenceMatcher(None, a[n : len(a) - m], b[n : len(b) - m], autojunk=False).get_matching_blocks()
    blocks = [(0, 0, n)]
    for i, j, k in [*((n + i, n + j, k) for i, j, k in middle), (len(a) - m, len(b) - m, m)]:
        last = blocks[-1]
        if k and last[0] + last[2] == i and last[1] + last[2] == j:  # difflib may split a match we cut
            blocks[-1] = (last[0], last[1], last[2] + k)
        elif k:
            blocks.append((i, j, k))
    return blocks


def _ends(spans: TokenSpans) -> list[int]:
    """Sorted byte offsets where a token boundary sits: 0 and the end of every non-empty text token."""
    return sorted({0} | {e for (s, e), sp in zip(spans.spans, spans.special) if not sp and s < e})


def _anchors(student: TokenSpans, teacher: TokenSpans, blocks) -> list[tuple[int, int]]:
    """(student byte, teacher byte) pairs where both sides have a token boundary at bytes that
    correspond (inside a block or at its edges), plus both texts' start and end; in order on both
    sides, since the blocks are."""
    s_ends, t_ends = _ends(student), set(_ends(teacher))
    found = {(0, 0), (len(student.text), len(teacher.text))}
    for a0, b0, n in blocks:
        for p in s_ends[bisect_left(s_ends, a0) : bisect_right(s_ends, a0 + n)]:
            if p - a0 + b0 in t_ends:
                found.add((p, p - a0 + b0))
    return sorted(found)


def _in_block(blocks, p0: int, q0: int, p1: int, q1: int) -> bool:
    """Whether one block holds the stretch from (p0, q0) to (p1, q1): the bytes agree there."""
    return any(a0 <= p0 and p1 <= a0 + n and q0 - p0 == b0 - a0 == q1 - p1 for a0, b0, n in blocks)


def _assign(spans: TokenSpans, cuts: list[int], labels: list[int | None]) -> list[int | None]:
    """Group of each token: ``labels[k]`` of the stretch (cuts[k-1], cuts[k]] holding it; None for
    specials and for tokens in a stretch that is not a group."""
    out: list[int | None] = []
    for (start, end), special in zip(spans.spans, spans.special):
        if special:
            out.append(None)
        elif start < end:
            out.append(labels[bisect_left(cuts, end)])
        else:  # an empty text token joins the stretch that starts at its position (at the end: the last)
            out.append(labels[min(bisect_right(cuts, start), len(cuts) - 1)])
    return out


def _special_groups(
    student: TokenSpans, teacher: TokenSpans, pairs: Mapping[int, int], blocks: list[tuple[int, int, int]]
) -> list[Group]:
    """Pair special tokens that sit at corresponding bytes and map to each other, keeping their order.

    Bytes correspond inside a block (and at its edges) only: next to a differing stretch the two
    sides no longer read the same text before the special token.
    """
    by_pos: dict[int, list[int]] = {}
    for j, ((pos, _), sp) in enumerate(zip(teacher.spans, teacher.special)):
        if sp:
            by_pos.setdefault(pos, []).append(j)
    groups: list[Group] = []
    used_up_to: dict[int, int] = {}
    for i, ((pos, _), sp) in enumerate(zip(student.spans, student.special)):
        want = pairs.get(student.ids[i]) if sp else None
        if want is None:
            continue
        for t_pos in sorted({pos - a0 + b0 for a0, b0, n in blocks if a0 <= pos <= a0 + n}):
            candidates = by_pos.get(t_pos, [])
            start = used_up_to.get(t_pos, 0)
            hit = next((n for n in range(start, len(candidates)) if teacher.ids[candidates[n]] == want), None)
            if hit is not None:
                groups.append(Group((i,), (candidates[hit],), pos, pos, t_pos - pos))
                used_up_to[t_pos] = hit + 1
                break
    return groups


def align_spans(
    student: TokenSpans,
    teacher: TokenSpans,
    on_mismatch: str = "raise",
    special_pairs: Mapping[int, int] | None = None,
) -> Alignment:
    """Groups of student and teacher tokens that close where both end at the same byte.

    ``on_mismatch`` (when the two texts differ): "raise" (a :class:`ByteMismatchError` naming the
    first differing byte), "flag" (align the agreeing prefix; the rest goes to ``*_unaligned``)
    or "resync" (align every stretch where the texts agree again; only the tokens that overlap a
    differing stretch go to ``*_unaligned``). A group never spans a differing stretch: it starts
    and ends at token boundaries of both sides inside one agreeing stretch.
    ``special_pairs`` (student special id -> teacher special id, e.g.
    :attr:`opd.crosstok.VocabMap.special_pairs`) pairs special tokens at corresponding bytes with
    each other, in order, as empty one-to-one groups (the two EOS at the end of a response); other
    special tokens are only reported.
    """
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch={on_mismatch!r}: choose one of {', '.join(ON_MISMATCH)}")
    mismatch_at = None
    if student.text != teacher.text:
        mismatch_at = _common_prefix(student.text, teacher.text)
        if on_mismatch == "raise":
            raise ByteMismatchError(_mismatch_message(student, teacher, mismatch_at))
    blocks = _byte_blocks(student.text, teacher.text, on_mismatch == "resync")
    anchors = _anchors(student, teacher, blocks)
    # Stretch k lies between anchors k-1 and k; it is a group when one block holds it.
    labels: list[int | None] = [None]
    bounds: list[tuple[int, int, int]] = []
    for (p0, q0), (p1, q1) in zip(anchors, anchors[1:]):
        aligned = _in_block(blocks, p0, q0, p1, q1)
        labels.append(len(bounds) if aligned else None)
        if aligned:
            bounds.append((p0, p1, q0 - p0))
    g_s = _assign(student, [p for p, _ in anchors], labels)
    g_t = _assign(teacher, [q for _, q in anchors], labels)
    members_s: list[list[int]] = [[] for _ in bounds]
    members_t: list[list[int]] = [[] for _ in bounds]
    for i, k in enumerate(g_s):
        if k is not None:
            members_s[k].append(i)
    for j, k in enumerate(g_t):
        if k is not None:
            members_t[k].append(j)
    text_groups = [Group(tuple(ms), tuple(mt), *b) for ms, mt, b in zip(members_s, members_t, bounds) if ms and mt]
    special_groups = _special_groups(student, teacher, special_pairs or {}, blocks)
    paired_s = {g.student[0] for g in special_groups}
    paired_t = {g.teacher[0] for g in special_groups}
    grouped_s = {i for g in text_groups for i in g.student}
    grouped_t = {j for g in text_groups for j in g.teacher}
    # Order by byte, an empty special group before the text group that starts at the same byte.
    groups = sorted(text_groups + special_groups, key=lambda g: (g.byte_start, g.byte_end > g.byte_start))
    return Alignment(
        tuple(groups),
        tuple(i for i in student.special_indices if i not in paired_s),
        tuple(j for j in teacher.special_indices if j not in paired_t),
        tuple(i for i, sp in enumerate(student.special) if not sp and i not in grouped_s),
        tuple(j for j, sp in enumerate(teacher.special) if not sp and j not in grouped_t),
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
    ``"within_group"``: as ``"group_start"`` here; the cross-tokenizer teacher then also scores the
    later student tokens of a group with one teacher token (:class:`opd.teachers.crosstok.CrossTokenizerTeacher`).
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
            if g.one_to_one or pairing != "one_to_one":
                teacher_pos[b][s_cols[0]] = t_cols[0]
                # a group after a differing stretch at the start is not at the teacher's text start
                text_start[b][s_cols[0]] = al.at_text_start and g.byte_start == 0 < g.byte_end and not g.teacher_shift
    as_long = lambda x, width: torch.tensor(x, dtype=torch.long, device=device).view(B, width)
    as_bool = lambda x: torch.tensor(x, dtype=torch.bool, device=device).view(B, T)
    return AlignmentTensors(
        as_long(teacher_pos, T), as_bool(one_to_one), as_long(s_group, T), as_long(t_group, U), as_bool(text_start)
    )
