"""A chat template made here for the chat-rendering tests (models/test_chat_template.py,
crosstok/test_conversations.py, training/test_prompt_only.py): Qwen-style markup that branches on
``enable_thinking`` (off: an empty ``<think>`` block opens every assistant turn, as Qwen3's does after
the generation prompt), renders system, user, assistant and tool turns, lists ``tools`` in the system
turn and writes an assistant's tool calls between ``<tool_call>`` markers.
"""

from __future__ import annotations

from tokenizers import AddedToken

TOOLS_TEMPLATE = (
    "{%- set header = '<|im_start|>assistant\\n' + ('<think>\\n\\n</think>\\n\\n' "
    "if enable_thinking is defined and not enable_thinking else '') -%}"
    "{%- set listed = '' -%}"
    "{%- if tools -%}{%- set listed = '\\n<tools>' + (tools | map('tojson') | join('\\n')) + '</tools>' -%}{%- endif -%}"
    "{%- if tools and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system' + listed + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + m['content'] + (listed if loop.first else '') + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>' + m['content'] + '</tool_response><|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- header + m['content'] -}}"
    "{%- for c in m.tool_calls or [] -%}{{- '<tool_call>' + (c['function'] | tojson) + '</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- header -}}{%- endif -%}"
)
TOOL_MARKERS = ("<tool_call>", "</tool_call>")
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    },
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is \\boxed{5}"},
    {"role": "user", "content": "And 4 + 4?"},
]


def with_tools_template(tok, markers: bool = True):
    """``tok`` with :data:`TOOLS_TEMPLATE`, and the tool-call markers as tokens of their own (as in Qwen's
    tokenizers, where they are added tokens that are not special); returns it."""
    tok.chat_template = TOOLS_TEMPLATE
    if markers:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_MARKERS])
    return tok
