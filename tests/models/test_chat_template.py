"""Chat-template options (``--chat-template-kwargs``) reach every place opd renders a chat, tools reach the
template, and the tool-call markers a template writes are found; with a template made here that branches on
``enable_thinking`` (tests/chat_templates.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_templates import ADD, CONVERSATION, TOOL_MARKERS, with_tools_template
from crosstok_tokenizers import make_teacher_tok

from opd.chat import chat_options, render_chat, set_chat_options, template_kwargs, tool_call_marker_ids
from opd.config import ConfigError, TrainConfig
from opd.crosstok.template import messages_from_prompt, render_for_teacher
from opd.errors import UserError
from opd.models.loading import load_tokenizer
from opd.models.tokenizer import format_chat, format_prompt
from opd.rollout.episodes import ChatFormat
from opd.rollout.prompt_set import PromptSet
from opd.tasks import Example
from opd.teachers.client import probe_texts

THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
OFF = {"enable_thinking": False}


@pytest.fixture
def tok(tiny_tokenizer):
    return with_tools_template(load_tokenizer(tiny_tokenizer, "tokenizer"), markers=False)


def test_the_options_reach_every_rendering_path(tok):
    """Each renderer, without options and with thinking off: the off branch appears only with them."""
    teacher = make_teacher_tok()
    teacher.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" + (
        "{% if add_generation_prompt %}[ASSISTANT]{% if enable_thinking is defined and not enable_thinking %}"
        " [NO-THINK]{% endif %} {% endif %}"
    )
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    for options in ({}, OFF):
        set_chat_options(tok, options)
        set_chat_options(teacher, options)
        off = bool(options)
        prompt = format_prompt(tok, "What is 2 + 3?", "Be brief.")
        assert prompt.endswith(THINK_OFF) == off
        ids = PromptSet.build([Example("What is 2 + 3?", "5")], tok, 256).prompt_ids[0]
        assert tok.decode(ids).endswith(THINK_OFF) == off
        assert format_chat(tok, "Q", "A").endswith(
            ("<think>\n\n</think>\n\nA" if off else "assistant\nA") + tok.eos_token
        )
        episode = ChatFormat(tok, tok.eos_token_id)
        assert episode.prompt("S", "O").endswith(THINK_OFF) == off
        assert episode.reply("next").endswith(THINK_OFF) == off
        # the cross-tokenizer teacher: the student's template inverted with the student's options, the
        # messages rendered in the teacher's template with the teacher's
        assert messages_from_prompt(tok, prompt) == [{"role": "system", "content": "Be brief."}, *user]
        assert render_for_teacher(teacher, user).endswith("[ASSISTANT] [NO-THINK] " if off else "[ASSISTANT] ")
        # the served teacher's tokenizer probe renders an exchange in the student's template
        assert any(("<think>\n\n</think>\n\n5" in t) == off and "What is 2 + 3?" in t for t in probe_texts(tok))


def test_render_chat_is_the_one_caller_of_apply_chat_template():
    src = Path(__file__).resolve().parents[2] / "src" / "opd"
    callers = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if "apply_chat_template("
        in "".join(line for line in p.read_text().splitlines() if line.lstrip()[:1] not in "*#")
    )
    assert callers == ["chat.py"]


def test_options_travel_with_the_tokenizer_and_are_not_saved(tok, tmp_path):
    assert chat_options(tok) == {}
    set_chat_options(tok, OFF)
    assert chat_options(tok) == OFF
    tok.save_pretrained(tmp_path)
    assert chat_options(load_tokenizer(tmp_path, "tokenizer")) == {}  # config.json records them, not the tokenizer
    assert not format_prompt(load_tokenizer(tmp_path, "tokenizer"), "Q").endswith(THINK_OFF)


def test_tools_reach_the_template_and_a_conversation_renders_whole(tok):
    text = format_prompt(tok, CONVERSATION, tools=[ADD])
    assert text.startswith('<|im_start|>system\nYou add numbers.\n<tools>{"type": "function"')
    for piece in (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        "<tool_response>5",
        "4 + 4?",
    ):
        assert piece in text
    assert text.endswith("And 4 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert format_prompt(tok, CONVERSATION) == render_chat(tok, CONVERSATION, add_generation_prompt=True)
    assert "<tools>" not in format_prompt(tok, CONVERSATION)


def test_tool_call_markers_are_the_added_tokens_a_tool_call_adds(tok, tiny_tokenizer):
    assert tool_call_marker_ids(tok) == []  # the markers are plain text here: several ordinary tokens
    with_tools_template(tok)
    assert tok.convert_ids_to_tokens(tool_call_marker_ids(tok)) == list(TOOL_MARKERS)
    # a template without tool calls (opd's own) has none; <think> is in both renderings, so never a marker
    assert tool_call_marker_ids(load_tokenizer(tiny_tokenizer, "tokenizer")) == []


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "{enable_thinking: false}",
            r"chat_template_kwargs='\{enable_thinking: false\}' is not JSON \(Expecting property",
        ),
        ('["enable_thinking"]', r"is a list, not a JSON object; write an object of template options"),
        ("false", r"is a boolean, not a JSON object"),
        ('{"tools": []}', r"sets 'tools', which opd passes to the chat template itself; give tools in the data"),
        ('{"add_generation_prompt": true}', r"sets 'add_generation_prompt', which opd passes .* itself; drop it"),
        ('{"not a name": 1}', r"'not a name' is not a template variable name"),
    ],
)
def test_bad_options_are_one_line_errors(value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_flat(chat_template_kwargs=value)
    with pytest.raises(ConfigError, match=message.replace("chat_template_kwargs=", "teacher_chat_template_kwargs=")):
        TrainConfig.from_flat(teacher_chat_template_kwargs=value)
    with pytest.raises(UserError):
        template_kwargs(value, "x")


def test_the_teachers_options_default_to_the_students():
    cfg = TrainConfig.from_flat(chat_template_kwargs='{"enable_thinking": false}')
    assert cfg.data.chat_template_kwargs == OFF and cfg.teacher_chat_options() == OFF
    assert (
        TrainConfig.from_flat(chat_template_kwargs=OFF, teacher_chat_template_kwargs="{}").teacher_chat_options() == {}
    )
