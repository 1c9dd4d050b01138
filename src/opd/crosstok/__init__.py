"""Foundations of cross-tokenizer on-policy distillation: a teacher with another vocabulary.

The student samples a response; the teacher reads the same *text* in its own tokenization and
chat template. These building blocks relate the two; :class:`opd.teachers.crosstok.CrossTokenizerTeacher`
puts them behind the trainer's teacher protocol (``opd train --cross-tokenizer``; not imported
here, since it depends on the trainer's teacher module):

* :mod:`~opd.crosstok.token_bytes` -- :class:`VocabBytes`: every token's UTF-8 bytes (byte-level
  ``Ġ`` alphabet, SentencePiece ``▁`` and ``<0xNN>`` byte fallback), and each token's exact byte
  span in a decoded text, even for a token holding half of a multi-byte character.
* :mod:`~opd.crosstok.align` -- :func:`align_ids`: groups of student and teacher tokens that
  close where both end at the same byte; special tokens reported (or paired, EOS with EOS); a
  byte mismatch raised, flagged, or re-synchronised past. :func:`alignment_tensors` turns a batch of alignments into the
  index tensors the losses take.
* :mod:`~opd.crosstok.vocab_map` -- :func:`build_vocab_map`: the teacher -> student id map by
  bytes, as an index tensor (and one for the first token of a text, where SentencePiece drops the
  prefix space), with a clear error when the vocabularies share almost nothing.
* :mod:`~opd.crosstok.template` -- :func:`messages_from_prompt`: the messages of a student prompt
  (its template inverted); :func:`render_for_teacher`: messages in the teacher's chat template.

The losses that use them are pure torch, in :mod:`opd.losses.cross` (re-exported here, not in
``opd.losses.__all__``):
:func:`cross_tokenizer_local_support_kl` (LSM over the teacher's top-K tokens that map into the
student vocabulary; equal to :func:`opd.losses.local_support_kl` for identical tokenizers),
:func:`span_reward` (sampled-token OPD per aligned group) and two diagnostics.

How this departs from TRL's GOLD (which re-tokenizes, aligns by byte offsets, merges each group's
probabilities and applies ULD): tokens are compared by bytes, not strings, so ``Ġ``/``▁``
spellings meet; special tokens never enter text alignment; mismatching texts are detected; the
loss is LSM's renormalized reverse KL on the mapped support (no sorted-probability ULD term), at
positions whose text prefix is the same on both sides, instead of merged group distributions.

Usage::

    from opd import crosstok
    s_vb, t_vb = crosstok.VocabBytes.from_tokenizer(s_tok), crosstok.VocabBytes.from_tokenizer(t_tok)
    vmap = crosstok.build_vocab_map(s_vb, t_vb, special_pairs={"</s>": "<|im_end|>"})
    als = [crosstok.align_ids(s, t, s_vb, t_vb, special_pairs=vmap.special_pairs) for s, t in pairs]
    idx = crosstok.alignment_tensors(als, T, U)
    kl_BT, counts = crosstok.cross_tokenizer_local_support_kl(
        student_logits_BTV, t_ids_BUK, t_lp_BUK, idx.teacher_pos_BT, vmap.teacher_to_student_V, mask_BT,
        idx.text_start_BT, vmap.teacher_to_student_start_V,
    )
"""

from opd.crosstok.align import (
    PAIRINGS,
    Alignment,
    AlignmentTensors,
    ByteMismatchError,
    Group,
    align_ids,
    align_spans,
    alignment_tensors,
)
from opd.crosstok.template import messages_from_prompt, render_for_teacher, teacher_prompt_and_response_ids
from opd.crosstok.token_bytes import TokenSpans, VocabBytes, byte_level_alphabet
from opd.crosstok.vocab_map import VocabMap, build_vocab_map
from opd.losses.cross import (
    CrossSupportCounts,
    cross_tokenizer_local_support_kl,
    cross_tokenizer_support,
    mapped_topk_mass,
    one_to_one_share,
    span_reward,
)

__all__ = [
    "PAIRINGS",
    "Alignment",
    "AlignmentTensors",
    "ByteMismatchError",
    "CrossSupportCounts",
    "Group",
    "TokenSpans",
    "VocabBytes",
    "VocabMap",
    "align_ids",
    "align_spans",
    "alignment_tensors",
    "build_vocab_map",
    "byte_level_alphabet",
    "cross_tokenizer_local_support_kl",
    "cross_tokenizer_support",
    "mapped_topk_mass",
    "messages_from_prompt",
    "one_to_one_share",
    "render_for_teacher",
    "span_reward",
    "teacher_prompt_and_response_ids",
]
