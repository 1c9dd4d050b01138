"""The locally trained tokenizer: vocabulary, special tokens, chat format, Qwen2 save/reload."""

from __future__ import annotations

import time
import unicodedata
from collections import Counter

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from opd.errors import UserError
from opd.models.tokenizer import (
    CHAT_TEMPLATE,
    EOS,
    IM_START,
    PAD,
    QWEN2_PRETOKENIZE_REGEX,
    THINK,
    THINK_END,
    format_chat,
    format_prompt,
    special_token_ids,
    train_bytelevel_tokenizer,
    train_tokenizer,
)
from opd.tasks import ArithmeticTask


@pytest.fixture(scope="module")
def examples():
    return ArithmeticTask(ops=("+", "-", "*"), n_train=3000, n_test=50).examples("train")


@pytest.fixture(scope="module")
def trained(examples):
    texts = [e.prompt for e in examples] + [e.solution for e in examples]
    start = time.perf_counter()
    tok = train_tokenizer(texts, vocab_size=2048)
    return tok, time.perf_counter() - start


@pytest.fixture(scope="module")
def tok(trained):
    return trained[0]


@pytest.fixture(scope="module")
def sample_texts(examples):
    return (
        [e.prompt for e in examples[:5]]
        + [e.solution for e in examples[:3]]
        + [
            "  odd   spacing\n\n and tabs\tthere",
            "Unicode: café, naïve, 你好, emoji 😀, cafe\u0301 (decomposed)",
            "don't I'll WE'RE it's",
            f"{IM_START}user\nhi{EOS}\n{IM_START}assistant\n{THINK}1 + 1 = 2.{THINK_END} ok{EOS}",
        ]
    )


def test_training_is_fast(trained):
    assert trained[1] < 20.0


def test_vocabulary_is_really_learned(tok, examples):
    assert len(tok) == 2048
    used = Counter()
    for e in examples:
        used.update(tok.encode(format_chat(tok, e.prompt, e.solution), add_special_tokens=False))
    # Tokens the task's own text actually uses, not merges that stay intermediate.
    assert len(used) >= 1000
    # Whole words became single tokens: the point of training on varied wording.
    for word in (" marbles", " passengers", " warehouse", " answer"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word


def test_special_tokens_are_single_ids(tok):
    ids = special_token_ids(tok)
    assert set(ids) == {"pad", "eos", "im_start", "think", "think_end"}
    assert len(set(ids.values())) == 5
    assert tok.eos_token == EOS and tok.eos_token_id == ids["eos"]
    assert tok.pad_token == PAD and tok.pad_token_id == ids["pad"]
    assert {ids["pad"], ids["eos"], ids["im_start"]} <= set(tok.all_special_ids)
    # <think> markers are atomic but not special: skipping specials keeps the reasoning format.
    text = f"{THINK}2 + 2 = 4.{THINK_END} The answer is \\boxed{{4}}"
    ids_text = tok.encode(text + EOS, add_special_tokens=False)
    assert ids_text[0] == ids["think"] and ids["think_end"] in ids_text
    assert tok.decode(ids_text, skip_special_tokens=True) == text
    assert max(ids_text) < len(tok)


def test_special_token_ids_rejects_foreign_tokenizer(tok):
    class Fake:
        def encode(self, text, add_special_tokens=False):
            return [1, 2]

    with pytest.raises(UserError, match="no single token"):
        special_token_ids(Fake())


def test_chat_format_and_round_trip(tok, examples):
    ex = examples[0]
    prompt = format_prompt(tok, ex.prompt)
    assert prompt == f"{IM_START}user\n{ex.prompt}{EOS}\n{IM_START}assistant\n"
    full = format_chat(tok, ex.prompt, ex.solution)
    assert full == prompt + ex.solution + EOS
    ids = tok.encode(full, add_special_tokens=False)
    assert tok.decode(ids) == full
    assert ids[-1] == tok.eos_token_id
    # The prompt's ids are a prefix of the full text's ids: the split point is clean.
    assert ids[: len(tok.encode(prompt, add_special_tokens=False))] == tok.encode(prompt, add_special_tokens=False)
    two_turns = tok.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], tokenize=False
    )
    assert two_turns == f"{IM_START}user\na{EOS}\n{IM_START}assistant\nb{EOS}\n"


def test_pretokenizer_is_qwen2s():
    from transformers.models.qwen2 import tokenization_qwen2

    assert QWEN2_PRETOKENIZE_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX


def test_reload_next_to_qwen2_model_is_identical(tok, sample_texts, tmp_path):
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)

    # transformers 5 swaps in its own class for qwen2 directories: what we guard against.
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    assert len(loaded) == len(tok) == config.vocab_size
    for text in sample_texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids, text
        # Both normalise to NFC (as Qwen2 does): decomposed characters come back composed.
        assert loaded.decode(ids) == tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert loaded.chat_template == tok.chat_template == CHAT_TEMPLATE
    assert (loaded.eos_token, loaded.pad_token) == (EOS, PAD)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert loaded.padding_side == "left"
    assert special_token_ids(loaded) == special_token_ids(tok)
    assert format_prompt(loaded, "Compute 1 + 2.") == format_prompt(tok, "Compute 1 + 2.")

    # And the model accepts every id a left-padded batch produces.
    batch = loaded(sample_texts[:3], padding=True, return_tensors="pt")
    assert (batch["input_ids"][:, 0] == loaded.pad_token_id).any()
    model = Qwen2ForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert model(**batch).logits.shape[-1] == len(loaded)


def test_bad_inputs():
    with pytest.raises(UserError, match="vocab_size"):
        train_tokenizer(["hello"], vocab_size=100)
    with pytest.raises(UserError, match="no text"):
        train_tokenizer([], vocab_size=512)


def test_bytelevel_teacher_tokenizer_is_another_vocabulary_with_the_students_markup(
    tok, examples, sample_texts, tmp_path
):
    from opd.models.loading import load_tokenizer

    texts = [e.prompt for e in examples] + [e.solution for e in examples]
    teacher = train_bytelevel_tokenizer(texts, vocab_size=1536)
    teacher.save_pretrained(tmp_path)  # a directory of its own, as --teacher-tokenizer
    loaded = load_tokenizer(tmp_path, "teacher")
    assert len(loaded) == len(teacher) == 1536 != len(tok)
    for text in sample_texts:
        ids = teacher.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids, text
        assert loaded.decode(ids) == unicodedata.normalize("NFC", text)
    # byte-level (what GOLD's byte-offset alignment requires): every piece is bytes shown as ByteLevel characters
    assert "ByteLevel" in loaded.backend_tokenizer.pre_tokenizer.__getstate__().decode()
    # numbers in runs of up to three digits where the student splits every digit: other pieces, other ids
    pieces = [w for w, _ in loaded.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 123456 7")]
    assert pieces == ["x", "Ġ", "123", "456", "Ġ", "7"]
    assert loaded.tokenize("41") == ["41"] and tok.tokenize("41") == ["4", "1"]
    # the same chat text, with the markup and <think> as single tokens
    assert format_chat(loaded, "Compute 1 + 2.", "3") == format_chat(tok, "Compute 1 + 2.", "3")
    assert special_token_ids(loaded).keys() == special_token_ids(tok).keys()
    assert (loaded.eos_token, loaded.pad_token, loaded.padding_side) == (EOS, PAD, "left")
    with pytest.raises(UserError, match="vocab_size"):
        train_bytelevel_tokenizer(texts, vocab_size=200)
