"""A small byte-level BPE tokenizer, trained locally, that survives a Qwen2 save/reload.

transformers 5 ignores ``tokenizer_class`` for ``qwen2`` model directories: ``AutoTokenizer``
always builds ``Qwen2Tokenizer`` and rebuilds its pipeline (NFC normalizer, Split on Qwen2's
regex, ByteLevel without regex, ByteLevel decoder) around the saved vocab and merges. A
tokenizer with any other pipeline silently changes its ids on reload. So we train with exactly
that pipeline, and the ids and decoded text are identical before and after the round trip.

Usage::

    from opd.models.tokenizer import train_tokenizer, format_prompt
    tok = train_tokenizer(texts, vocab_size=2048)       # texts: prompts and solutions
    tok.save_pretrained(model_dir)                      # next to a Qwen2 config.json
    format_prompt(tok, "Compute 3 + 4.")                # chat-formatted, ends "assistant\\n"

Special tokens: ``<|pad|>``, ``<|im_end|>`` (EOS, ends every chat turn) and ``<|im_start|>``
are special. ``<think>`` and ``</think>`` are single-id added tokens but NOT special (as in
Qwen3), so ``decode(..., skip_special_tokens=True)`` keeps the reasoning markers in the text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

from opd.chat import render_chat
from opd.errors import UserError

__all__ = [
    "PAD",
    "EOS",
    "IM_START",
    "THINK",
    "THINK_END",
    "CHAT_TEMPLATE",
    "QWEN2_PRETOKENIZE_REGEX",
    "train_tokenizer",
    "train_sentencepiece_tokenizer",
    "train_bytelevel_tokenizer",
    "format_prompt",
    "format_chat",
    "special_token_ids",
]

PAD = "<|pad|>"
EOS = "<|im_end|>"
IM_START = "<|im_start|>"
THINK = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (PAD, EOS, IM_START)
ADDED_TOKENS = (THINK, THINK_END)

# Copied from transformers/models/qwen2/tokenization_qwen2.py (PRETOKENIZE_REGEX, v5.23); the
# tokenizer test reloads through Qwen2Tokenizer, so a drift in transformers shows up there.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ADDED_SPLIT = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS))


def _qwen2_pipeline_tokenizer(split_regex: str = QWEN2_PRETOKENIZE_REGEX) -> Tokenizer:
    """An empty BPE with the pipeline Qwen2Tokenizer rebuilds on load (see module docstring);
    ``split_regex``: another pre-tokenization split (then it survives a reload only on its own)."""
    tok = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _without_added_tokens(texts: Iterable[str]) -> Iterator[str]:
    # The BPE trainer does not split on added tokens: "<think>" in the corpus would spend merges
    # on "think>" and "</think>" pieces that can never be used. Train on the text between them.
    for text in texts:
        for piece in _ADDED_SPLIT.split(text):
            if piece:
                yield piece


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for transformers.

    ``vocab_size`` counts everything: 256 byte tokens, the merges, 3 special and 2 added tokens.
    A small corpus may stop short of it (no pair left to merge); ``len(tokenizer)`` is the truth
    to give a model config. Train on what the model will read: prompts and worked solutions.
    """
    return _train_bytelevel(texts, vocab_size, QWEN2_PRETOKENIZE_REGEX)


def _train_bytelevel(texts: Iterable[str], vocab_size: int, split_regex: str) -> PreTrainedTokenizerFast:
    n_fixed = 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    if vocab_size < n_fixed:
        raise UserError(f"vocab_size={vocab_size} is below the {n_fixed} byte and special tokens: use at least 512")
    tok = _qwen2_pipeline_tokenizer(split_regex)
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(_without_added_tokens(texts), trainer=trainer)
    if tok.get_vocab_size() <= n_fixed - len(ADDED_TOKENS):
        raise UserError("train_tokenizer got no text to learn from: pass prompts and solutions")
    # Added after training so they take the two ids after the learned vocabulary.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        # Without an unk_token, Qwen2Tokenizer's reload defaults it to "<|endoftext|>" and adds
        # that as a new token, so len(tokenizer) would exceed the model's vocab by one.
        unk_token=PAD,
        extra_special_tokens=[IM_START],  # so it is in all_special_ids, as in Qwen's tokenizers
        padding_side="left",  # generation batches are left-padded
        chat_template=CHAT_TEMPLATE,
    )


# Llama-3's split: Qwen2's, but numbers in runs of up to three digits where Qwen2 splits each digit.
LLAMA3_PRETOKENIZE_REGEX = QWEN2_PRETOKENIZE_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def train_bytelevel_tokenizer(texts: Iterable[str], vocab_size: int = 1536) -> PreTrainedTokenizerFast:
    """A byte-level BPE with another vocabulary than :func:`train_tokenizer`'s, the kind of pair
    (Qwen and Llama 3) that TRL's GOLD aligns by byte offsets: Llama-3's pre-tokenization (numbers
    in runs of up to three digits, which its merges may join: "41" is one token, not two), its own
    merges and ids, and
    ``vocab_size`` counted as in :func:`train_tokenizer`. The chat markup is the student's (the same
    ``<|im_start|>``/``<|im_end|>`` text and ``<think>`` tokens), because GOLD hands the teacher the
    student's chat text re-tokenized: a teacher trained on other markup would read text it never saw.

    Save it in a directory of its own (``--teacher-tokenizer``): next to a Qwen2 model, transformers
    5 would rebuild it with Qwen2's digit split on reload.
    """
    return _train_bytelevel(texts, vocab_size, LLAMA3_PRETOKENIZE_REGEX)


# A Llama-2-style template: the BOS as text, [INST] ... [/INST], no system role.
SENTENCEPIECE_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{ message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def train_sentencepiece_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE, unlike :func:`train_tokenizer` in every way cross-tokenizer OPD
    must handle: ``▁`` for spaces (Metaspace), digits split one by one and ``<0xNN>`` byte fallback
    (as Llama-2), Llama-2's decoder, ``<s>``/``</s>``/``<unk>``/``<pad>``, no ``<think>`` token
    (it is spelled in pieces) and a ``[INST] ... [/INST]`` chat template without a system role.

    Save it in a directory of its own (``--teacher-tokenizer``): saved next to a Qwen2 model,
    transformers 5 would rebuild it as a byte-level Qwen2 tokenizer on reload.
    """
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre
    n_bytes = 256
    if vocab_size < len(special) + n_bytes + 64:
        raise UserError(f"vocab_size={vocab_size} leaves too few merges beside 256 byte tokens: use at least 512")
    trainer = BpeTrainer(vocab_size=vocab_size - n_bytes, special_tokens=special, show_progress=False)
    learner.train_from_iterator(texts, trainer=trainer)
    spec = json.loads(learner.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):  # byte fallback: any byte stays encodable
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m) for m in spec["merges"]], unk_token="<unk>", byte_fallback=True)
    )
    tok.add_special_tokens(special)
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        chat_template=SENTENCEPIECE_CHAT_TEMPLATE,
    )


def format_chat(
    tokenizer, prompt: str | Sequence[dict], completion: str | None = None, system: str | None = None, tools=None
) -> str:
    """The chat text of one turn: the generation prompt, plus ``completion + EOS`` if given."""
    text = format_prompt(tokenizer, prompt, system, tools)
    return text if completion is None else text + completion + tokenizer.eos_token


def format_prompt(tokenizer, prompt: str | Sequence[dict], system: str | None = None, tools=None) -> str:
    """``prompt`` as a user turn (after a ``system`` turn, if given), or a conversation's messages
    (``Example.chat()``), followed by the assistant header the model continues from; ``tools``: the
    tool schemas the template lists. Rendered by :func:`opd.chat.render_chat`, with the template
    options set on the tokenizer."""
    if isinstance(prompt, str):
        turns = [{"role": "system", "content": system}] if system else []
        prompt = [*turns, {"role": "user", "content": prompt}]
    return render_chat(tokenizer, prompt, add_generation_prompt=True, tools=tools)


def special_token_ids(tokenizer) -> dict[str, int]:
    """Ids of the five reserved tokens, by name: pad, eos, im_start, think, think_end.

    Raises UserError if one is missing or does not encode to exactly one id (a tokenizer
    that was not made by ``train_tokenizer``).
    """
    names = {"pad": PAD, "eos": EOS, "im_start": IM_START, "think": THINK, "think_end": THINK_END}
    ids = {}
    for name, token in names.items():
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise UserError(
                f"tokenizer has no single token for {token!r} (it encodes to "
                f"{len(encoded)} ids): use one made by opd.models.tokenizer.train_tokenizer"
            )
        ids[name] = encoded[0]
    return ids
