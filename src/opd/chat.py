"""Rendering a chat with a tokenizer's chat template: the one place opd calls ``apply_chat_template``.

Every chat opd renders goes through :func:`render_chat`: prompt sets and SFT pairs
(:func:`opd.models.tokenizer.format_prompt`), the turns of multi-turn episodes
(:class:`opd.rollout.episodes.ChatFormat`), the cross-tokenizer teacher's prompts and the inversion
of the student's template (:mod:`opd.crosstok.template`) and the served teacher's tokenizer probes
(:func:`opd.teachers.client.probe_texts`). It passes the template the options a run gives
(``--chat-template-kwargs '{"enable_thinking": false}'``, TRL's ``chat_template_kwargs``), which
travel with the tokenizer they are for (:func:`set_chat_options`, once where a run loads it), as
its chat template itself does: the student's tokenizer carries the student's options, the
teacher's its own (``--teacher-chat-template-kwargs``, by default the student's).

Usage::

    set_chat_options(tok, template_kwargs('{"enable_thinking": false}', "chat_template_kwargs"))
    text = render_chat(tok, [{"role": "user", "content": "2 + 3?"}], add_generation_prompt=True)

Not a stage of its own: a helper below every stage that renders (like :mod:`opd.errors`), so that
:mod:`opd.crosstok` (below the models) and :mod:`opd.models` share it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from opd.errors import UserError

__all__ = [
    "RESERVED",
    "chat_options",
    "check_template_reads",
    "template_variables",
    "render_chat",
    "set_chat_options",
    "template_kwargs",
    "tool_call_marker_ids",
]

# apply_chat_template's own arguments (and the template's `messages`): opd sets them, so an option
# of that name would clash with opd's value (transformers' "got multiple values") or silently win.
RESERVED = (
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)
_ATTRIBUTE = "opd_chat_template_kwargs"  # not saved by save_pretrained: config.json records the options
_EXAMPLE = "'{\"enable_thinking\": false}'"
_JSON_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def template_kwargs(value: Any, option: str) -> dict[str, Any]:
    """``value`` (a mapping, or its JSON text as the command line gives it) as chat template options;
    a UserError naming ``option`` and the fix when it is not a JSON object of usable names."""
    given = value
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{option}={given!r} is not JSON ({exc.msg}, column {exc.colno}); write a JSON object, e.g. {_EXAMPLE}"
            ) from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise UserError(
            f"{option}={given!r} is a {kind}, not a JSON object; write an object of template options, e.g. {_EXAMPLE}"
        )
    bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise UserError(f"{option}: {bad[0]!r} is not a template variable name; name options as the template does")
    clash = [k for k in value if k in RESERVED]
    if clash:
        fix = "give tools in the data's tools column" if clash[0] == "tools" else "drop it"
        raise UserError(f"{option} sets {clash[0]!r}, which opd passes to the chat template itself; {fix}")
    return dict(value)


def set_chat_options(
    tokenizer: Any, options: dict[str, Any] | None, option: str = "chat_template_kwargs", check: bool = True
) -> Any:
    """Have every :func:`render_chat` with ``tokenizer`` pass ``options`` to its template; returns it.
    ``check``: an option the template never reads is an error naming ``option`` (:func:`check_template_reads`)."""
    if check:
        check_template_reads(tokenizer, options or {}, option)
    setattr(tokenizer, _ATTRIBUTE, dict(options or {}))
    return tokenizer


def template_variables(tokenizer: Any) -> set[str] | None:
    """The variables the tokenizer's chat template(s) read, found by jinja2's parser in the template's syntax
    tree (not by running it); None without a template, or with one the parser cannot read."""
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    templates = getattr(tokenizer, "chat_template", None)
    templates = list(templates.values()) if isinstance(templates, dict) else [templates]
    found: set[str] = set()
    for template in templates:
        if not isinstance(template, str) or not template:
            return None
        try:  # transformers' own environment knows its tags ({% generation %}); it is private API, hence the fallback
            from transformers.utils.chat_template_utils import _compile_jinja_template

            env = _compile_jinja_template(template).environment
        except Exception:  # noqa: BLE001 - any failure there: parse with jinja2's loop controls, as transformers does
            env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        try:
            found |= meta.find_undeclared_variables(env.parse(template))
        except jinja2.TemplateError:
            return None
    return found


def check_template_reads(tokenizer: Any, options: dict[str, Any], option: str) -> None:
    """UserError for an option the chat template never reads (a typo such as enable_thinkin leaves the
    template's own default in force, silently), naming the options it does read."""
    reads = template_variables(tokenizer) if options else None
    unread = [k for k in options if reads is not None and k not in reads]
    if not unread:
        return
    own = sorted(reads - set(RESERVED) - {"bos_token", "eos_token", "raise_exception", "strftime_now"})  # type: ignore[operator]
    raise UserError(
        f"{option}: the chat template never reads {unread[0]!r} (the variables it reads: {', '.join(own) or 'none'}); "
        "fix the name, or pass --no-check-chat-template-kwargs for a template that reads its options indirectly"
    )


def chat_options(tokenizer: Any) -> dict[str, Any]:
    """The template options set on ``tokenizer`` (none unless :func:`set_chat_options` was called)."""
    return dict(getattr(tokenizer, _ATTRIBUTE, None) or {})


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """``messages`` (and ``tools``: JSON schemas, for a template that lists them) as the tokenizer's
    chat template writes them, with the tokenizer's options. Errors are the template's own."""
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **chat_options(tokenizer),
    )


_PROBE_CALL = {"type": "function", "function": {"name": "opd_probe", "arguments": {"x": 1}}}


def tool_call_marker_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokens of their own (added tokens, such as Qwen's ``<tool_call>``) that the chat
    template writes around an assistant's tool call and not around its plain text: the format
    tokens of a tool call, which ``--mask-special`` leaves out of the loss as it does ``<think>``.
    None for a template that renders no tool calls."""
    user = {"role": "user", "content": "\ue000"}
    try:
        plain = render_chat(tokenizer, [user, {"role": "assistant", "content": "\ue001"}], add_generation_prompt=False)
        call = render_chat(
            tokenizer,
            [user, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}],
            add_generation_prompt=False,
        )
    except Exception:  # noqa: BLE001 - a template without tool calls (or a role): nothing to mask
        return []
    added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
    return sorted(i for text, i in added.items() if text in call and text not in plain)
