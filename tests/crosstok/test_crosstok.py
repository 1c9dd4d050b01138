"""Cross-tokenizer building blocks: byte spans, alignment, vocabulary map, template, losses.

Two clearly different tokenizers are built locally: opd's byte-level BPE (``Ġ`` spellings, no
BOS, ``<|im_end|>`` EOS) as the student, and a SentencePiece-style BPE (``▁`` spellings,
``<0xNN>`` byte fallback, a ``<s>`` BOS it adds, ``</s>`` EOS, another vocabulary size) as the
teacher (``make_teacher_tok``, in tests/crosstok_tokenizers.py). The losses are checked against float64
references written here with explicit loops.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from crosstok_tokenizers import make_teacher_tok, metaspace_bpe
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from opd import crosstok
from opd import losses as L
from opd.errors import UserError
from opd.losses import cross as X
from opd.models.tokenizer import train_tokenizer

INF = math.inf
TEXT = "héllo 東京 🙂"
STUDENT_TEXTS = [
    "héllo world, hello there 東京 is big 🙂🙃🙁 smile",
    "the quick brown fox jumps over the lazy dog",
] * 50 + ["😀😁😂🙂🙃 東京タワー hello héllo"] * 30


# No 京 and no emoji: the teacher spells them with byte-fallback tokens.
@pytest.fixture(scope="module")
def student_tok():
    return train_tokenizer(STUDENT_TEXTS, vocab_size=600)


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def teacher_tok(request):
    return make_teacher_tok(request.param)


@pytest.fixture(scope="module")
def vbs(student_tok, teacher_tok):
    return crosstok.VocabBytes.from_tokenizer(student_tok), crosstok.VocabBytes.from_tokenizer(teacher_tok)


def _is_char_boundary(text: bytes, i: int) -> bool:
    return i == len(text) or (text[i] & 0xC0) != 0x80


# ---------------------------------------------------------------- byte spans


@pytest.mark.parametrize("text", [TEXT, "hello  world ", "東京", "🙂 the fox", "the lazy dog, héllo!"])
def test_token_bytes_equal_decoded_text(student_tok, teacher_tok, vbs, text):
    for tok, vb, ids in (
        (student_tok, vbs[0], student_tok.encode(text, add_special_tokens=False) + [student_tok.eos_token_id]),
        (teacher_tok, vbs[1], teacher_tok(text)["input_ids"] + [teacher_tok.eos_token_id]),
    ):
        spans = vb.spans(ids)
        assert spans.text == tok.decode(ids, skip_special_tokens=True).encode("utf-8") == text.encode("utf-8")
        # spans tile the text in order; specials are empty and flagged
        pos = 0
        for (start, end), special, i in zip(spans.spans, spans.special, ids):
            assert start == pos and end >= start
            assert special == (i in tok.all_special_ids)
            assert not special or start == end
            pos = end
        assert pos == len(spans.text)


def test_tokenizers_reloaded_from_disk_give_the_same_bytes(student_tok, teacher_tok, tmp_path):
    from transformers import AutoTokenizer

    for i, tok in enumerate((student_tok, teacher_tok)):
        tok.save_pretrained(tmp_path / str(i))
        reloaded = AutoTokenizer.from_pretrained(tmp_path / str(i))
        before, after = crosstok.VocabBytes.from_tokenizer(tok), crosstok.VocabBytes.from_tokenizer(reloaded)
        assert after.token_bytes == before.token_bytes and after.decoding == before.decoding
        ids = reloaded(TEXT)["input_ids"]
        assert after.text(ids) == reloaded.decode(ids, skip_special_tokens=True) == TEXT


def test_response_cut_inside_a_character_is_a_flagged_mismatch(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    ids = student_tok.encode("hello 🙂", add_special_tokens=False)
    assert student_tok.convert_ids_to_tokens(ids)[-2:] == ["ĠðŁĻ", "Ĥ"]  # " " + 3 bytes of 🙂, then its last
    cut = ids[:-1]  # a response that stopped inside the emoji
    text = s_vb.text(cut)
    assert text == "hello \ufffd"
    t_ids = teacher_tok(text)["input_ids"]
    al = crosstok.align_ids(cut, t_ids, s_vb, t_vb, on_mismatch="flag")
    assert al.mismatch_at == len(b"hello ")
    # "hello" aligns; the token " \xf0\x9f\x99" runs into the mismatch and is left unaligned
    assert [(g.byte_start, g.byte_end) for g in al.groups] == [(0, 5)]
    assert al.student_unaligned == (len(cut) - 1,)


def test_added_special_token_outside_the_special_map_is_special():
    tok = train_tokenizer(STUDENT_TEXTS[:2], vocab_size=400)
    tok.backend_tokenizer.add_special_tokens([AddedToken("<|tool|>", special=True)])
    ids = tok.encode("hello<|tool|> world <think>", add_special_tokens=False)
    tool = tok.backend_tokenizer.token_to_id("<|tool|>")
    assert tool in ids and tool not in tok.all_special_ids
    spans = crosstok.VocabBytes.from_tokenizer(tok).spans(ids)
    assert spans.text == tok.decode(ids, skip_special_tokens=True).encode() == b"hello world <think>"
    assert spans.special[ids.index(tool)]


def test_spans_split_multibyte_characters_exactly(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    raw = TEXT.encode()
    s = s_vb.spans(student_tok.encode(TEXT, add_special_tokens=False))
    t = t_vb.spans(teacher_tok(TEXT)["input_ids"])
    # The byte-level student ends a token inside 🙂, and so does the byte-fallback teacher inside 京.
    assert any(not _is_char_boundary(raw, e) for _, e in s.spans)
    assert any(not _is_char_boundary(raw, e) for _, e in t.spans)
    for spans in (s, t):
        for (start, end), i in zip(spans.spans, spans.ids):
            piece = (s_vb if spans is s else t_vb).bytes_of(i)
            assert piece is None or raw[start:end] == piece.lstrip(b" ") or raw[start:end] == piece
    # byte-fallback tokens are exactly one byte
    fallback = [i for i in t.ids if i in t_vb.byte_fallback_ids]
    assert fallback and all(len(t_vb.bytes_of(i)) == 1 for i in fallback)


def test_metaspace_first_token_rule_and_continuation(teacher_tok, vbs):
    t_vb = vbs[1]
    ids = teacher_tok("hello world", add_special_tokens=False)["input_ids"]
    assert teacher_tok.convert_ids_to_tokens(ids)[0] == "▁hello"
    assert t_vb.spans(ids).text == b"hello world"  # the prefix space is stripped at the text start
    assert t_vb.spans(ids, at_text_start=False).text == b" hello world"  # not in the middle of a text


def test_byte_fallback_space_at_text_start_is_kept(teacher_tok, vbs):
    # Metaspace strips the "▁" of the first token, not a <0x20> byte; Llama's Strip removes one space.
    ids = [teacher_tok.convert_tokens_to_ids("<0x20>"), teacher_tok.convert_tokens_to_ids("▁hello")]
    decoded = teacher_tok.decode(ids)
    assert decoded in (" hello", "  hello")
    assert vbs[1].spans(ids).text == decoded.encode()


def test_unsupported_decoder_is_a_user_error():
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(UserError, match="WordPiece decoder step"):
        crosstok.VocabBytes.from_tokenizer(wrapped)


# ---------------------------------------------------------------- alignment


def _spans(pieces):
    """TokenSpans from a list of byte strings (None: a special token)."""
    spans, special, pos = [], [], 0
    for p in pieces:
        n = len(p or b"")
        spans.append((pos, pos + n))
        special.append(p is None)
        pos += n
    ids = tuple(100 + i if p is None else i for i, p in enumerate(pieces))
    return crosstok.TokenSpans(b"".join(p for p in pieces if p), tuple(spans), tuple(special), ids)


def test_alignment_by_hand_on_split_multibyte_characters():
    # "hé 東" = 68 c3 a9 20 e6 9d b1; student splits é, teacher splits 東, teacher has a BOS.
    student = _spans([b"h\xc3", b"\xa9", b" \xe6\x9d\xb1"])
    teacher = _spans([None, b"h", b"\xc3\xa9 ", b"\xe6", b"\x9d\xb1"])
    al = crosstok.align_spans(student, teacher)
    got = [(g.student, g.teacher, g.byte_start, g.byte_end, g.one_to_one) for g in al.groups]
    assert got == [((0, 1, 2), (1, 2, 3, 4), 0, 7, False)]
    assert al.teacher_special == (0,) and al.student_special == ()

    student = _spans([b"h", b"\xc3\xa9", b" ", b"\xe6\x9d\xb1", None])
    teacher = _spans([b"h", b"\xc3\xa9", b" \xe6", b"\x9d\xb1", None])
    al = crosstok.align_spans(student, teacher)
    got = [(g.student, g.teacher, g.one_to_one) for g in al.groups]
    assert got == [((0,), (0,), True), ((1,), (1,), True), ((2, 3), (2, 3), False)]
    assert al.student_special == (4,) and al.teacher_special == (4,)  # no pairs given: reported


def test_alignment_pairs_eos_and_reports_one_sided_bos():
    student = _spans([b"ab", b"c", None])  # ids 0, 1, 102
    teacher = _spans([None, b"a", b"bc", None])  # ids 100, 1, 2, 103
    al = crosstok.align_spans(student, teacher, special_pairs={102: 103})
    got = [(g.student, g.teacher, g.byte_start, g.byte_end, g.one_to_one) for g in al.groups]
    assert got == [((0, 1), (1, 2), 0, 3, False), ((2,), (3,), 3, 3, True)]
    assert al.student_special == () and al.teacher_special == (0,)
    # a pair at another byte, or of other ids, is not made
    assert crosstok.align_spans(student, teacher, special_pairs={102: 100}).student_special == (2,)
    # an EOS on the student side only is reported, and the text groups are unchanged
    no_eos = crosstok.align_spans(student, _spans([None, b"a", b"bc"]), special_pairs={102: 103})
    assert no_eos.student_special == (2,) and no_eos.groups == al.groups[:1]


def test_alignment_of_real_tokenizers(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    vmap = crosstok.build_vocab_map(s_vb, t_vb, special_pairs={"</s>": "<|im_end|>"})
    s_ids = student_tok.encode(TEXT, add_special_tokens=False) + [student_tok.eos_token_id]
    t_ids = teacher_tok(TEXT)["input_ids"] + [teacher_tok.eos_token_id]  # BOS on the teacher side only
    al = crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, special_pairs=vmap.special_pairs)
    raw = TEXT.encode()
    s_spans, t_spans = s_vb.spans(s_ids), t_vb.spans(t_ids)
    # independent check: group ends are exactly the byte positions where both sides end a text token
    s_ends = {e for (b, e), sp in zip(s_spans.spans, s_spans.special) if not sp}
    t_ends = {e for (b, e), sp in zip(t_spans.spans, t_spans.special) if not sp}
    text_groups = [g for g in al.groups if g.byte_end > g.byte_start]
    assert [g.byte_end for g in text_groups] == sorted(s_ends & t_ends)
    for g in text_groups:
        assert b"".join(raw[slice(*s_spans.spans[i])] for i in g.student) == raw[g.byte_start : g.byte_end]
        assert b"".join(raw[slice(*t_spans.spans[j])] for j in g.teacher) == raw[g.byte_start : g.byte_end]
    covered_s = sorted(i for g in al.groups for i in g.student)
    assert covered_s == list(range(len(s_ids)))  # every student token, the EOS included
    assert al.teacher_special == (0,)  # the BOS
    assert al.groups[-1].student == (len(s_ids) - 1,) and al.groups[-1].teacher == (len(t_ids) - 1,)
    assert any(g.one_to_one for g in text_groups) and any(not g.one_to_one for g in text_groups)


def test_byte_mismatch_raises_or_flags(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    # A response starting with a space: the SentencePiece teacher's text loses it.
    text = " hello world"
    s_ids = student_tok.encode(text, add_special_tokens=False)
    t_ids = teacher_tok(text)["input_ids"]
    with pytest.raises(crosstok.ByteMismatchError, match="from byte 0 on"):
        crosstok.align_ids(s_ids, t_ids, s_vb, t_vb)
    al = crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, on_mismatch="flag")
    assert al.mismatch_at == 0 and al.groups == ()
    assert al.student_unaligned == tuple(range(len(s_ids)))


def test_byte_mismatch_from_a_normalizer_is_flagged_after_the_agreeing_prefix(student_tok):
    teacher = make_teacher_tok(normalizer=normalizers.NFKC())
    s_vb, t_vb = crosstok.VocabBytes.from_tokenizer(student_tok), crosstok.VocabBytes.from_tokenizer(teacher)
    text = "the ﬁsh hello"  # NFKC turns the ligature ﬁ (3 bytes) into "fi" (2 bytes)
    s_ids = student_tok.encode(text, add_special_tokens=False) + [student_tok.eos_token_id]
    t_ids = teacher(text)["input_ids"] + [teacher.eos_token_id]
    pairs = crosstok.build_vocab_map(s_vb, t_vb, special_pairs={"</s>": "<|im_end|>"}).special_pairs
    with pytest.raises(UserError, match="from byte 4 on"):
        crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, special_pairs=pairs)
    al = crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, on_mismatch="flag", special_pairs=pairs)
    assert al.mismatch_at == 4
    # the EOS come after the mismatch, so they are reported, not paired
    assert al.student_special == (len(s_ids) - 1,) and al.teacher_special == (0, len(t_ids) - 1)
    assert all(g.byte_end <= 4 for g in al.groups) and al.groups
    assert al.student_unaligned and al.teacher_unaligned
    assert max(i for g in al.groups for i in g.student) < min(al.student_unaligned)

    # A lowercasing teacher keeps the length, so both EOS sit at the same byte: still not paired.
    lower = make_teacher_tok(normalizer=normalizers.Lowercase())
    l_vb = crosstok.VocabBytes.from_tokenizer(lower)
    s_ids = student_tok.encode("the Fox", add_special_tokens=False) + [student_tok.eos_token_id]
    t_ids = lower("the Fox")["input_ids"] + [lower.eos_token_id]
    al = crosstok.align_ids(s_ids, t_ids, s_vb, l_vb, on_mismatch="flag", special_pairs=pairs)
    assert al.mismatch_at == 4 and l_vb.spans(t_ids).spans[-1] == s_vb.spans(s_ids).spans[-1] == (7, 7)
    assert al.student_special == (len(s_ids) - 1,) and all(g.byte_end <= 4 for g in al.groups)


def test_resync_after_an_invalid_byte_by_hand():
    # The student wrote a lone continuation byte 0x80 (not UTF-8); the teacher read U+FFFD (ef bf bd) there.
    student = _spans([b"ab", b"\x80", b"cd", b"e", None])  # bytes 0-2, 2-3, 3-5, 5-6; EOS at 6
    teacher = _spans([None, b"a", b"b", b"\xef", b"\xbf", b"\xbd", b"c", b"de", None])  # BOS; 0-1 ... 6-8; EOS at 8
    pairs = {104: 108}  # the two EOS
    al = crosstok.align_spans(student, teacher, on_mismatch="resync", special_pairs=pairs)
    got = [(g.student, g.teacher, g.byte_start, g.byte_end, g.teacher_shift) for g in al.groups]
    assert got == [
        ((0,), (1, 2), 0, 2, 0),  # "ab"
        ((2, 3), (6, 7), 3, 6, 2),  # "cde", after the stretch: student bytes 3-6 are teacher bytes 5-8
        ((4,), (8,), 6, 6, 2),  # the EOS pair, at corresponding bytes
    ]
    assert al.mismatch_at == 2 and al.student_unaligned == (1,) and al.teacher_unaligned == (3, 4, 5)
    assert al.student_special == () and al.teacher_special == (0,)
    # "flag" keeps the old rule: everything from the first differing byte on is left out
    flagged = crosstok.align_spans(student, teacher, on_mismatch="flag", special_pairs=pairs)
    assert [g.student for g in flagged.groups] == [(0,)] and flagged.student_unaligned == (1, 2, 3)
    assert flagged.student_special == (4,)
    with pytest.raises(ValueError, match="raise, flag, resync"):
        crosstok.align_spans(student, teacher, on_mismatch="skip")


def test_resync_needs_a_boundary_on_both_sides_and_never_spans_a_difference():
    # student "x" "\x80y" "z" "w" vs teacher "x" U+FFFD "y" "zw": the two texts agree again from "y" on,
    # but the student token "\x80y" straddles the difference, so the next group starts after it, at "z"
    student = _spans([b"x", b"\x80y", b"z", b"w"])  # 0-1, 1-3, 3-4, 4-5
    teacher = _spans([b"x", b"\xef\xbf\xbd", b"y", b"zw"])  # 0-1, 1-4, 4-5, 5-7
    al = crosstok.align_spans(student, teacher, on_mismatch="resync")
    got = [(g.student, g.teacher, g.byte_start, g.byte_end, g.teacher_shift) for g in al.groups]
    # "z" is student byte 3 and teacher byte 5 (one byte became three); the teacher's "y" is left out too
    assert got == [((0,), (0,), 0, 1, 0), ((2, 3), (3,), 3, 5, 2)]
    assert al.student_unaligned == (1,) and al.teacher_unaligned == (1, 2)
    # a difference at the very start: the first group is not at the teacher's text start
    idx = crosstok.alignment_tensors(
        [crosstok.align_spans(_spans([b"\x80", b"ab"]), _spans([b"\xef\xbf\xbd", b"ab"]), on_mismatch="resync")],
        T=2,
        U=2,
    )
    assert idx.teacher_pos_BT.tolist() == [[-1, 1]] and not idx.text_start_BT.any()


def test_resync_on_real_tokenizers_keeps_the_rest_of_the_response(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    pairs = crosstok.build_vocab_map(s_vb, t_vb, special_pairs={"</s>": "<|im_end|>"}).special_pairs
    head = student_tok.encode("hello", add_special_tokens=False)
    bad = student_tok.convert_tokens_to_ids("ĠðŁĻ")  # " " + 3 bytes of a 4-byte emoji: not UTF-8 on its own
    tail = student_tok.encode(" the lazy dog", add_special_tokens=False)
    s_ids = head + [bad] + tail + [student_tok.eos_token_id]
    text = s_vb.text(s_ids)
    assert text == "hello \ufffd the lazy dog"
    t_ids = teacher_tok(text)["input_ids"] + [teacher_tok.eos_token_id]
    al = crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, on_mismatch="resync", special_pairs=pairs)
    assert al.mismatch_at == len(b"hello ")
    assert al.student_unaligned == (len(head),)  # only the byte token; the rest of the response stays
    # the tail's groups are those of the tail aligned on its own (shifted by the tokens before it)
    t_tail = teacher_tok(" the lazy dog", add_special_tokens=False)["input_ids"]
    alone = crosstok.align_ids(tail, t_tail, s_vb, t_vb, at_text_start=False)
    first_t = t_ids.index(t_tail[0], 1)
    want = [(tuple(len(head) + 1 + i for i in g.student), tuple(first_t + j for j in g.teacher)) for g in alone.groups]
    tail_groups = [(g.student, g.teacher) for g in al.groups if g.student[0] > len(head) and g.byte_end > g.byte_start]
    assert tail_groups == want and want
    # the 3 bytes f0 9f 99 became one U+FFFD, also 3 bytes: the texts keep their lengths
    assert all(g.teacher_shift == 0 for g in al.groups)
    assert al.groups[-1].student == (len(s_ids) - 1,) and al.groups[-1].teacher == (len(t_ids) - 1,)  # EOS pair
    flagged = crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, on_mismatch="flag", special_pairs=pairs)
    assert len(flagged.student_unaligned) == len(tail) + 1


def test_alignment_tensors_pairings_and_offsets():
    a = crosstok.Alignment(
        groups=(
            crosstok.Group((0,), (1,), 0, 1),
            crosstok.Group((1, 2), (2,), 1, 3),
            crosstok.Group((3,), (3, 4), 3, 5),
        ),
        student_special=(),
        teacher_special=(0,),
    )
    idx = crosstok.alignment_tensors([a, a], T=6, U=7, student_offsets=[0, 2], teacher_offsets=[0, 1])
    assert idx.teacher_pos_BT.tolist() == [[1, 2, -1, 3, -1, -1], [-1, -1, 2, 3, -1, 4]]
    assert idx.one_to_one_BT.tolist() == [[True] + [False] * 5, [False, False, True] + [False] * 3]
    assert idx.student_group_BT.tolist() == [[0, 1, 1, 2, -1, -1], [-1, -1, 0, 1, 1, 2]]
    assert idx.teacher_group_BU.tolist() == [[-1, 0, 1, 2, 2, -1, -1], [-1, -1, 0, 1, 2, 2, -1]]
    assert idx.text_start_BT.tolist() == [[True] + [False] * 5, [False, False, True] + [False] * 3]
    mid_text = dataclasses.replace(a, at_text_start=False)
    assert not crosstok.alignment_tensors([mid_text], T=6, U=7).text_start_BT.any()
    strict = crosstok.alignment_tensors([a], T=4, U=5, pairing="one_to_one")
    assert strict.teacher_pos_BT.tolist() == [[1, -1, -1, -1]]
    with pytest.raises(ValueError, match="outside T=3"):
        crosstok.alignment_tensors([a], T=3, U=5)


# ---------------------------------------------------------------- vocabulary map


def test_vocab_map_meets_g_and_metaspace_spellings(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    vmap = crosstok.build_vocab_map(s_vb, t_vb, special_pairs={"</s>": "<|im_end|>"})
    t2s, s2t = vmap.teacher_to_student_V, vmap.student_to_teacher_V
    s_id, t_id = student_tok.convert_tokens_to_ids("Ġhello"), teacher_tok.convert_tokens_to_ids("▁hello")
    assert student_tok.convert_ids_to_tokens(s_id) == "Ġhello" and teacher_tok.convert_ids_to_tokens(t_id) == "▁hello"
    assert t2s[t_id] == s_id and s2t[s_id] == t_id
    # a byte-fallback token meets the byte-level token of its byte (0xE4 is spelled "ä")
    assert t2s[teacher_tok.convert_tokens_to_ids("<0xE4>")] == student_tok.convert_tokens_to_ids("ä")
    # specials: by the pair given; the BOS has no student counterpart
    assert t2s[teacher_tok.eos_token_id] == student_tok.eos_token_id
    assert t2s[teacher_tok.bos_token_id] == -1
    # every mapped pair has the same bytes; every unmapped text token's bytes are missing from the student
    student_bytes = {b for b in s_vb.token_bytes if b is not None}
    for v in range(len(t_vb)):
        b = t_vb.bytes_of(v)
        if b is None:
            continue
        assert (t2s[v] >= 0) == (b in student_bytes)
        if t2s[v] >= 0:
            assert s_vb.bytes_of(int(t2s[v])) == b
    assert vmap.n_mapped == int((t2s >= 0).sum()) - 1  # the EOS pair is not a text token
    assert 0 < vmap.share < 1


def test_text_start_map_reads_metaspace_tokens_without_their_space(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    vmap = crosstok.build_vocab_map(s_vb, t_vb)
    s_id = student_tok.convert_tokens_to_ids
    t_id = teacher_tok.convert_tokens_to_ids
    assert vmap.teacher_to_student_V[t_id("▁the")] == s_id("Ġthe")
    assert vmap.teacher_to_student_start_V[t_id("▁the")] == s_id("the")  # "▁the" opening a text is b"the"
    assert vmap.teacher_to_student_start_V[t_id("the")] == s_id("the")
    assert vmap.teacher_to_student_start_V[t_id("▁hello")] == -1  # the student has no "hello" without a space
    # byte-level tokenizers have no start-of-text rule: one map serves both
    same = crosstok.build_vocab_map(s_vb, s_vb)
    assert same.teacher_to_student_start_V is same.teacher_to_student_V

    # the loss at the first response position goes through the start map
    text = "the lazy dog"
    s_ids, t_ids = student_tok.encode(text, add_special_tokens=False), teacher_tok(text)["input_ids"]
    idx = crosstok.alignment_tensors([crosstok.align_ids(s_ids, t_ids, s_vb, t_vb)], len(s_ids), len(t_ids))
    assert idx.text_start_BT[0].tolist() == [True] + [False] * (len(s_ids) - 1)
    assert idx.teacher_pos_BT[0, 0] == 1  # after the teacher's BOS
    top_ids = torch.tensor([t_id("▁the"), t_id("the"), t_id("▁hello")]).expand(1, len(t_ids), 3)
    top_lp = torch.log(torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64)).expand(1, len(t_ids), 3)
    mask = torch.ones(1, len(s_ids), dtype=torch.bool)
    args = (top_ids, top_lp, idx.teacher_pos_BT, vmap.teacher_to_student_V, mask)
    ids, lp, valid, _, _ = X.cross_tokenizer_support(*args, idx.text_start_BT, vmap.teacher_to_student_start_V)
    assert ids[0, 0][valid[0, 0]].tolist() == [s_id("the")]
    torch.testing.assert_close(lp[0, 0, 0], torch.tensor(0.7, dtype=torch.float64).log())  # ▁the + the
    assert ids[0, 1][valid[0, 1]].tolist() == [s_id("Ġthe"), s_id("the"), s_id("Ġhello")]  # mid-text: plain map
    plain_ids, _, plain_valid, _, _ = X.cross_tokenizer_support(*args)
    assert plain_ids[0, 0][plain_valid[0, 0]].tolist() == [s_id("Ġthe"), s_id("the"), s_id("Ġhello")]
    with pytest.raises(ValueError, match="together"):
        X.cross_tokenizer_support(*args, idx.text_start_BT)


def test_vocab_map_prefers_regular_token_over_byte_fallback_twin(vbs):
    t_vb = vbs[1]
    # "o" is in the teacher's corpus, so it has both a regular token and the fallback <0x6F>
    o_regular = next(i for i, b in enumerate(t_vb.token_bytes) if b == b"o" and i not in t_vb.byte_fallback_ids)
    o_fallback = next(i for i, b in enumerate(t_vb.token_bytes) if b == b"o" and i in t_vb.byte_fallback_ids)
    vmap = crosstok.build_vocab_map(t_vb, t_vb)  # teacher vs itself: twins map to the regular token
    assert vmap.teacher_to_student_V[o_fallback] == o_regular == vmap.teacher_to_student_V[o_regular]


def test_vocab_map_pads_to_head_rows(student_tok, vbs):
    vmap = crosstok.build_vocab_map(vbs[0], vbs[0], student_rows=len(vbs[0]) + 3, teacher_rows=len(vbs[0]) + 5)
    assert vmap.teacher_to_student_V.shape == (len(vbs[0]) + 5,)
    assert vmap.student_to_teacher_V.shape == (len(vbs[0]) + 3,)
    assert (vmap.teacher_to_student_V[len(vbs[0]) :] == -1).all()
    assert torch.equal(vmap.teacher_to_student_V[: len(vbs[0])], torch.arange(len(vbs[0])))


def _disjoint_tok(texts, special):
    tok = metaspace_bpe(texts, 60, special, prepend="never", byte_fallback=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=special[0], eos_token=special[1])


def test_vocabularies_that_share_nothing_are_a_clear_error():
    letters = _disjoint_tok(["abcabcbca", "cabbac"] * 10, ["<unk>", "<eos>"])
    digits = _disjoint_tok(["123123231", "312213"] * 10, ["<unk>", "</s>"])
    with pytest.raises(UserError, match=r"share almost nothing: only 0 of the teacher's .* lower min_share"):
        crosstok.build_vocab_map(letters, digits)
    with pytest.raises(UserError, match="share almost nothing"):  # nothing mapped is refused at any min_share
        crosstok.build_vocab_map(letters, digits, min_share=0.0)
    mixed = _disjoint_tok(["a1a2a3", "123321"] * 10, ["<unk>", "</s>"])
    with pytest.warns(UserWarning, match="have a student token with the same bytes"):
        vmap = crosstok.build_vocab_map(letters, mixed, min_share=0.0, warn_share=0.99)
    assert vmap.n_mapped >= 1
    with pytest.raises(UserError, match="not a special token of the teacher"):
        crosstok.build_vocab_map(letters, mixed, min_share=0.0, warn_share=0.0, special_pairs={"<s>": "<eos>"})


# ---------------------------------------------------------------- chat template


def test_render_for_teacher_uses_the_teachers_template(student_tok, teacher_tok):
    messages = [{"role": "user", "content": "Compute 3 + 4."}]
    text = crosstok.render_for_teacher(teacher_tok, messages)
    assert text == "<s>[USER] Compute 3 + 4.\n[ASSISTANT] "
    assert "<|im_start|>" not in text
    prompt_ids, response_ids = crosstok.teacher_prompt_and_response_ids(teacher_tok, messages, "7", end_token="</s>")
    assert prompt_ids[0] == teacher_tok.bos_token_id and prompt_ids.count(teacher_tok.bos_token_id) == 1
    assert response_ids[-1] == teacher_tok.eos_token_id
    assert teacher_tok.decode(response_ids, skip_special_tokens=True) == "7"
    with pytest.raises(UserError, match="end_token '<\\|im_end\\|>' is not a token"):
        crosstok.teacher_prompt_and_response_ids(teacher_tok, messages, "7", end_token="<|im_end|>")


def test_render_for_teacher_errors_name_the_role(student_tok):
    teacher = make_teacher_tok()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(UserError, match="cannot render the roles system, user: System role not supported"):
        crosstok.render_for_teacher(teacher, messages)
    teacher.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(UserError, match="dropped the 'system' message"):
        crosstok.render_for_teacher(teacher, messages)
    teacher.chat_template = None
    with pytest.raises(UserError, match="has no chat template"):
        crosstok.render_for_teacher(teacher, messages)


# ---------------------------------------------------------------- losses: float64 references


def ref_cross_lsm(z_BTV, t_ids_BUK, t_lp_BUK, pos_BT, t2s, mask_BT):
    """Loop reference: LSM on the mapped teacher top-K (twins' masses added); value and grad."""
    z, ids, tlp = z_BTV.tolist(), t_ids_BUK.tolist(), t_lp_BUK.tolist()
    pos, mask, t2s = pos_BT.tolist(), mask_BT.tolist(), t2s.tolist()
    out, grad = [], []
    for b in range(len(z)):
        out.append([])
        grad.append([])
        for t in range(len(z[b])):
            V = len(z[b][t])
            g = [0.0] * V
            kl = 0.0
            u = pos[b][t]
            if mask[b][t] and u >= 0:
                mass: dict[int, float] = {}
                for v, lq in zip(ids[b][u], tlp[b][u]):
                    s = t2s[v]
                    if s >= 0 and lq > -INF:
                        mass[s] = mass.get(s, 0.0) + math.exp(lq)
                support = sorted(mass)
                zs = [z[b][t][s] for s in support]
                if support and max(zs) > -INF:
                    m = max(zs)
                    lse = m + math.log(sum(math.exp(x - m) for x in zs))
                    total = sum(mass.values())
                    for s, x in zip(support, zs):
                        if x > -INF:
                            kl += math.exp(x - lse) * ((x - lse) - math.log(mass[s] / total))
                    for s, x in zip(support, zs):
                        if x > -INF:
                            p = math.exp(x - lse)
                            g[s] = p * ((x - lse) - math.log(mass[s] / total) - kl)
            out[b].append(kl)
            grad[b].append(g)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(grad, dtype=torch.float64)


def _random_case(seed, B, T, U, K, V_s, V_t):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    z = torch.randn(B, T, V_s, generator=gen, dtype=torch.float64) * 2
    z[0, 0, : V_s // 2] = -INF  # banned student tokens
    t_logits = torch.randn(B, U, V_t, generator=gen, dtype=torch.float64) * 2
    t_logits[0, 0, 1:] = -INF  # a teacher with one possible token: -inf log-probs in its top-K
    t_ids, t_lp = L.teacher_topk(t_logits, K)
    t2s = torch.tensor([rng.choice([-1, *range(V_s)]) for _ in range(V_t)])
    # Teacher position 0: its one finite slot maps to nothing, its -inf slots do map, so the
    # student position paired with it has no mapped support.
    top0 = int(t_ids[0, 0, 0])
    t2s[top0] = -1
    for k in range(1, K):
        t2s[t_ids[0, 0, k]] = k % V_s
    twins = [v for v in range(V_t) if v != top0][:2]
    t2s[twins] = V_s - 1  # twins: two teacher tokens with the same bytes
    pos = torch.tensor([[rng.choice([-1, *range(U)]) for _ in range(T)] for _ in range(B)])
    pos[0, 0] = 0
    mask = torch.rand(B, T, generator=gen) > 0.25
    mask[0, 0] = True
    mask[-1] = False  # an all-masked row
    if B > 1:
        mask[0, -1], pos[0, -1] = True, 1
    return z, t_ids, t_lp, pos, t2s, mask


@pytest.mark.parametrize(
    "seed,B,T,U,K,V_s,V_t",
    [(0, 2, 5, 6, 4, 9, 11), (1, 1, 1, 1, 1, 3, 3), (2, 3, 7, 4, 5, 6, 13), (3, 2, 3, 8, 8, 5, 9)],
)
def test_cross_lsm_matches_loop_reference(seed, B, T, U, K, V_s, V_t):
    z, t_ids, t_lp, pos, t2s, mask = _random_case(seed, B, T, U, K, V_s, V_t)
    z.requires_grad_(True)
    kl, counts = X.cross_tokenizer_local_support_kl(z, t_ids, t_lp, pos, t2s, mask)
    gout = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    (kl * gout).sum().backward()
    ref, ref_grad = ref_cross_lsm(z.detach(), t_ids, t_lp, pos, t2s, mask)
    torch.testing.assert_close(kl.detach(), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z.grad, ref_grad * gout.unsqueeze(-1), rtol=1e-12, atol=1e-12)
    assert (kl[~mask] == 0).all() and (z.grad[~mask] == 0).all()
    assert torch.isfinite(kl).all() and torch.isfinite(z.grad).all()
    # the counts, by loops
    paired = mask & (pos >= 0)
    has = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            if paired[b, t]:
                u = int(pos[b, t])
                has[b, t] = any(t2s[v] >= 0 and lq > -INF for v, lq in zip(t_ids[b, u].tolist(), t_lp[b, u].tolist()))
    assert counts.positions == mask.sum() and counts.unpaired == (mask & ~paired).sum()
    assert counts.compared == has.sum() and counts.no_mapped_support == (paired & ~has).sum()
    assert counts.positions == counts.compared + counts.unpaired + counts.no_mapped_support


def test_cross_lsm_twins_are_merged():
    # teacher ids 0 and 1 both map to student id 2: one slot with their summed mass
    z = torch.tensor([[[0.3, -0.2, 1.1, 0.5]]], dtype=torch.float64)
    t_ids = torch.tensor([[[0, 3, 1]]])
    t_lp = torch.tensor([[[math.log(0.4), math.log(0.3), math.log(0.2)]]], dtype=torch.float64)
    t2s = torch.tensor([2, 2, -1, 0])
    kl, _ = X.cross_tokenizer_local_support_kl(z, t_ids, t_lp, torch.tensor([[0]]), t2s, torch.tensor([[True]]))
    p = torch.softmax(torch.tensor([1.1, 0.3], dtype=torch.float64), 0)  # student ids 2, 0
    q = torch.tensor([0.6, 0.3], dtype=torch.float64) / 0.9
    torch.testing.assert_close(kl[0, 0], (p * (p.log() - q.log())).sum(), rtol=1e-12, atol=1e-12)
    # no positions at all
    empty, counts = X.cross_tokenizer_local_support_kl(
        z[:, :0], t_ids, t_lp, torch.zeros(1, 0, dtype=torch.long), t2s, torch.ones(1, 0, dtype=torch.bool)
    )
    assert empty.shape == (1, 0) and counts.positions == 0


def test_cross_lsm_float32_and_from_hidden_agree_with_float64():
    z, t_ids, t_lp, pos, t2s, mask = _random_case(5, 2, 5, 6, 4, 9, 11)
    kl64, _ = X.cross_tokenizer_local_support_kl(z, t_ids, t_lp, pos, t2s, mask)
    kl32, _ = X.cross_tokenizer_local_support_kl(z.float(), t_ids, t_lp.float(), pos, t2s, mask)
    assert kl32.dtype == torch.float32
    torch.testing.assert_close(kl32.double(), kl64, rtol=1e-5, atol=1e-6)
    # the same support through the hidden-state LSM
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen)
    W = torch.randn(9, 3, dtype=torch.float64, generator=gen)
    ids, lp, valid, lmask, _ = X.cross_tokenizer_support(t_ids, t_lp, pos, t2s, mask)
    from_h = L.local_support_kl_from_hidden(h, W, ids, lp, lmask, support_mask=valid)
    from_logits, _ = X.cross_tokenizer_local_support_kl(h @ W.T, t_ids, t_lp, pos, t2s, mask)
    torch.testing.assert_close(from_h, from_logits, rtol=1e-10, atol=1e-12)


def test_cross_lsm_with_identical_tokenizers_is_ordinary_lsm(student_tok):
    vb = crosstok.VocabBytes.from_tokenizer(student_tok)
    vmap = crosstok.build_vocab_map(vb, vb)
    V = len(vb)
    assert torch.equal(vmap.teacher_to_student_V, torch.arange(V))  # by bytes and special names, not a shortcut
    texts = [TEXT, "the lazy dog 🙃"]
    rows = [student_tok.encode(x, add_special_tokens=False) + [student_tok.eos_token_id] for x in texts]
    als = [crosstok.align_ids(r, r, vb, vb, special_pairs=vmap.special_pairs) for r in rows]
    T = max(len(r) for r in rows) + 1
    idx = crosstok.alignment_tensors(als, T, T, student_offsets=[1, 0], teacher_offsets=[1, 0])
    mask = idx.student_group_BT >= 0
    assert torch.equal(idx.teacher_pos_BT[mask], torch.arange(T).expand(2, T)[mask])
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, T, V, generator=gen)
    z[0, 2, 5:40] = -INF
    t_ids, t_lp = L.teacher_topk(torch.randn(2, T, V, generator=gen) * 3, 8)
    t_lp[1, 1, 4:] = -INF
    mask[1, 0] = False
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    cross, counts = X.cross_tokenizer_local_support_kl(
        z1, t_ids, t_lp, idx.teacher_pos_BT, vmap.teacher_to_student_V, mask
    )
    plain = L.local_support_kl(z2, t_ids, t_lp, mask)
    assert torch.equal(cross, plain)
    cross.sum().backward()
    plain.sum().backward()
    assert torch.equal(z1.grad, z2.grad)
    assert counts.compared == mask.sum() and counts.unpaired == 0
    assert X.one_to_one_share(idx.one_to_one_BT, mask) == 1.0
    assert X.mapped_topk_mass(t_ids, t_lp, idx.teacher_pos_BT, vmap.teacher_to_student_V, mask) == 1.0


# ---------------------------------------------------------------- span reward and diagnostics


def test_span_reward_by_hand():
    # row 0: groups s[0,0,1,-1], t[0,1,1]; row 1: one-to-one groups, last position masked out
    s_lp = torch.tensor([[-0.5, -1.0, -2.0, -9.0], [-0.1, -0.2, -0.3, -INF]], dtype=torch.float64)
    t_lp = torch.tensor([[-0.7, -0.4, -0.25], [-0.15, -0.1, -0.6]], dtype=torch.float64)
    s_grp = torch.tensor([[0, 0, 1, -1], [0, 1, 2, -1]])
    t_grp = torch.tensor([[0, 1, 1], [0, 1, 2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    r = X.span_reward(s_lp, t_lp, s_grp, t_grp, mask)
    expected = [
        [0.0, -0.7 - (-0.5 - 1.0), (-0.4 - 0.25) - (-2.0), 0.0],
        [-0.15 + 0.1, -0.1 + 0.2, 0.0, 0.0],  # group 2 lands on a masked position: dropped
    ]
    torch.testing.assert_close(r, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)
    # with gamma=1 every token of a group sees its reward through the reward-to-go
    adv = L.sampled_token_advantages(torch.zeros_like(r), r, mask, gamma=1.0)
    torch.testing.assert_close(adv[0, :3], torch.tensor([0.8 + 1.35, 0.8 + 1.35, 1.35], dtype=torch.float64))
    assert X.span_reward(s_lp[:, :0], t_lp[:, :0], s_grp[:, :0], t_grp[:, :0], mask[:, :0]).shape == (2, 0)


def test_span_reward_on_real_alignment_matches_a_loop_over_groups(student_tok, teacher_tok, vbs):
    s_vb, t_vb = vbs
    vmap = crosstok.build_vocab_map(s_vb, t_vb, special_pairs={"</s>": "<|im_end|>"})
    texts = [TEXT, "the quick brown fox 東京"]
    s_rows = [student_tok.encode(x, add_special_tokens=False) + [student_tok.eos_token_id] for x in texts]
    t_rows = [teacher_tok(x)["input_ids"] + [teacher_tok.eos_token_id] for x in texts]
    als = [crosstok.align_ids(s, t, s_vb, t_vb, special_pairs=vmap.special_pairs) for s, t in zip(s_rows, t_rows)]
    T, U = max(map(len, s_rows)), max(map(len, t_rows))
    idx = crosstok.alignment_tensors(als, T, U)
    gen = torch.Generator().manual_seed(3)
    s_lp = -torch.rand(2, T, generator=gen, dtype=torch.float64) * 3
    t_lp = -torch.rand(2, U, generator=gen, dtype=torch.float64) * 3
    mask = torch.zeros(2, T, dtype=torch.bool)
    for b, s in enumerate(s_rows):
        mask[b, : len(s)] = True
    r = X.span_reward(s_lp, t_lp, idx.student_group_BT, idx.teacher_group_BU, mask)
    expected = torch.zeros(2, T, dtype=torch.float64)
    for b, al in enumerate(als):
        for g in al.groups:
            expected[b, g.student[-1]] = sum(t_lp[b, j] for j in g.teacher) - sum(s_lp[b, i] for i in g.student)
    torch.testing.assert_close(r, expected, rtol=0, atol=1e-14)
    assert (r[0] != 0).sum() == len(als[0].groups)


def test_diagnostics_by_hand():
    assert crosstok.one_to_one_share is X.one_to_one_share and crosstok.mapped_topk_mass is X.mapped_topk_mass
    one = torch.tensor([[True, False, True, True]])
    mask = torch.tensor([[True, True, True, False]])
    assert X.one_to_one_share(one, mask).item() == pytest.approx(2 / 3)
    t_ids = torch.tensor([[[0, 1, 2], [2, 1, 0]]])
    t_lp = torch.tensor([[[math.log(0.5), math.log(0.2), math.log(0.1)], [math.log(0.6), -INF, -INF]]])
    t2s = torch.tensor([0, -1, 1])
    pos = torch.tensor([[0, 1, -1]])
    share = X.mapped_topk_mass(t_ids, t_lp, pos, t2s, torch.tensor([[True, True, True]]))
    assert share.item() == pytest.approx(((0.5 + 0.1) / 0.8 + 1.0) / 2)


def test_unmapped_prefix_counts_a_longer_teacher_token_for_the_student_token_it_begins_with():
    from opd.models.tokenizer import train_bytelevel_tokenizer

    texts = [f"{a} + {b} = {a + b}." for a in range(40) for b in range(40)]
    student = train_tokenizer(texts, vocab_size=600)  # every digit alone
    teacher = train_bytelevel_tokenizer(texts, vocab_size=600)  # runs of digits: "41" is one token
    t_id, s_id = teacher.convert_tokens_to_ids, student.convert_tokens_to_ids
    assert teacher.tokenize("41") == ["41"] and student.tokenize("41") == ["4", "1"]
    drop = crosstok.build_vocab_map(student, teacher)
    prefix = crosstok.build_vocab_map(student, teacher, unmapped="prefix")
    assert drop.teacher_to_student_V[t_id("41")] == -1 and prefix.teacher_to_student_V[t_id("41")] == s_id("4")
    assert prefix.teacher_to_student_V[t_id("Ġ=")] == drop.teacher_to_student_V[t_id("Ġ=")] == s_id("Ġ=")
    # what the bytes map keeps, the prefix map keeps; every other text token gets its longest student prefix
    kept = drop.teacher_to_student_V >= 0
    assert torch.equal(prefix.teacher_to_student_V[kept], drop.teacher_to_student_V[kept])
    s_bytes = crosstok.VocabBytes.from_tokenizer(student).token_bytes
    t_bytes = crosstok.VocabBytes.from_tokenizer(teacher).token_bytes
    for v in (~kept).nonzero().squeeze(-1).tolist():
        got = s_bytes[int(prefix.teacher_to_student_V[v])]
        assert t_bytes[v].startswith(got) and len(got) < len(t_bytes[v])
        assert not any(b and t_bytes[v].startswith(b) and len(got) < len(b) < len(t_bytes[v]) for b in s_bytes)
    assert prefix.n_prefix == int((~kept).sum()) > 0
    assert prefix.n_mapped == drop.n_mapped  # the diagnostic still counts same-bytes tokens only
    # at a position where the teacher writes "41" (0.6), "4" (0.1), "5" (0.2): the student's "4" gets 0.7
    lp = torch.tensor([[[0.6, 0.1, 0.2]]]).log()
    ids = torch.tensor([[[t_id("41"), t_id("4"), t_id("5")]]])
    pos, mask = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    sup, slp, valid, _, _ = X.cross_tokenizer_support(ids, lp, pos, prefix.teacher_to_student_V, mask)
    assert sup[0, 0][valid[0, 0]].tolist() == [s_id("4"), s_id("5")]
    torch.testing.assert_close(slp[0, 0][valid[0, 0]].exp(), torch.tensor([0.7, 0.2]))
    sup, slp, valid, _, _ = X.cross_tokenizer_support(ids, lp, pos, drop.teacher_to_student_V, mask)
    assert sup[0, 0][valid[0, 0]].tolist() == [s_id("4"), s_id("5")]  # "41" left out
    torch.testing.assert_close(slp[0, 0][valid[0, 0]].exp(), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="unmapped"):
        crosstok.build_vocab_map(student, teacher, unmapped="first")
