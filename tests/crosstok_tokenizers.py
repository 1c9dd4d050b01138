"""A SentencePiece-style teacher tokenizer for the cross-tokenizer tests (crosstok/test_crosstok.py,
teachers/test_crosstok_teacher.py): a BPE with ``▁`` spellings, ``<0xNN>`` byte fallback, a ``<s>`` BOS it
adds, ``</s>`` EOS, another vocabulary size and a ``[USER]``/``[ASSISTANT]`` chat template, built locally.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

TEACHER_TEXTS = ["the quick brown fox", "héllo world 東 is big smile hello hello world"] * 40
TEACHER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


def metaspace_bpe(texts, vocab_size, special, prepend="first", byte_fallback=True):
    """A trained BPE with Metaspace pre-tokenization, rebuilt with <0xNN> byte-fallback tokens."""
    tok = Tokenizer(models.BPE(unk_token=special[0]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend)
    tok.train_from_iterator(
        texts, trainer=BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    )
    spec = json.loads(tok.to_str())["model"]
    vocab = dict(spec["vocab"])
    if byte_fallback:
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    model = models.BPE(
        vocab=vocab, merges=[tuple(m) for m in spec["merges"]], unk_token=special[0], byte_fallback=byte_fallback
    )
    out = Tokenizer(model)
    out.add_special_tokens(special)
    out.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend)
    return out


def make_teacher_tok(
    decoder: str = "llama", normalizer=None, texts=TEACHER_TEXTS, vocab_size: int = 300
) -> PreTrainedTokenizerFast:
    tok = metaspace_bpe(texts, vocab_size, ["<unk>", "<s>", "</s>"])
    if decoder == "llama":  # Llama-2's decoder: Replace, ByteFallback, Fuse, Strip one leading space
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=TEACHER_TEMPLATE
    )
