"""Re-render a student's chat transcript for a teacher with another tokenizer and chat template.

A teacher with its own tokenizer must read the prompt the way it was trained to: the same
messages in *its* chat template, not the student's template text re-tokenized. The response is
tokenized on its own (no special tokens added), so that its ids start exactly where the
student's response starts and the two can be aligned by bytes (:mod:`opd.crosstok.align`).

The trainer's prompt sets give the teacher each prompt's messages and tools (a conversation
whole); for prompt *ids* alone, :func:`messages_from_prompt` recovers the messages by inverting the
student's own template (rendered once with placeholder contents, whose literal text around them
must then match the prompt), for a user turn after an optional system turn. Every rendering goes
through :func:`opd.chat.render_chat`, with the template options set on each tokenizer.

A template that cannot render a role raises in Jinja (``raise_exception('System role not
supported')``), and some templates drop a role without a word; both become a
:class:`opd.errors.UserError` naming the role and the fix.

Usage::

    prompt_text = render_for_teacher(teacher_tok, [{"role": "user", "content": "2 + 3 = ?"}])
    prompt_ids, response_ids = teacher_prompt_and_response_ids(
        teacher_tok, messages, student_tok.decode(resp_ids, skip_special_tokens=True), end_token="</s>"
    )
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from opd.chat import render_chat
from opd.errors import UserError

__all__ = ["messages_from_prompt", "render_for_teacher", "teacher_prompt_and_response_ids"]

# The prompts ids alone can be inverted for: one user turn, after a system turn or not (opd.models.tokenizer.format_prompt).
_PROMPT_SHAPES = (("system", "user"), ("user",))


def _tokenizer_name(tok) -> str:
    return getattr(tok, "name_or_path", "") or type(tok).__name__


def messages_from_prompt(student_tokenizer, prompt_text: str) -> list[dict]:
    """The messages a generation prompt was rendered from with the student's chat template.

    The template is rendered with placeholder contents (private-use characters, which no prompt
    holds) for each prompt shape opd writes; the text between the placeholders is the template's
    own (markers, role names), and the prompt must consist of exactly that text around the
    contents, which must not hold that markup themselves (a longer conversation would match the
    system-and-user shape with its earlier turns read as the system text). Raises UserError when no
    shape matches (a prompt not made by the template, or a conversation of more turns).
    """
    name = _tokenizer_name(student_tokenizer)
    for roles in _PROMPT_SHAPES:
        holders = [f"\ue000{i}\ue001" for i in range(len(roles))]
        try:
            probe = render_chat(
                student_tokenizer,
                [{"role": r, "content": h} for r, h in zip(roles, holders)],
                add_generation_prompt=True,
            )
        except Exception:  # this template refuses the shape (no system role): try the next
            continue
        if any(probe.count(h) != 1 for h in holders):
            continue
        pieces = re.split("|".join(holders), probe)
        found = re.fullmatch("(.*)".join(re.escape(piece) for piece in pieces), prompt_text, re.DOTALL)
        # A content holding the template's own markup is more turns read as one (a conversation's
        # earlier turns in its "system" text): not this shape.
        markup = [piece.strip() for piece in pieces if piece.strip()]
        if found and not any(m in content for m in markup for content in found.groups()):
            return [{"role": r, "content": c} for r, c in zip(roles, found.groups())]
    raise UserError(
        f"a student prompt is not a user turn (after an optional system turn) of the student's chat template "
        f"({name!r}), so it cannot be re-rendered for the teacher: {prompt_text[:80]!r}. Build prompts with the "
        "student tokenizer's chat template, and give a conversation or tools to the teacher with its messages "
        "(CrossTokenizerTeacher.read_prompts, as opd's prompt sets do)"
    )


def render_for_teacher(
    teacher_tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True, tools: Sequence[dict] | None = None
) -> str:
    """``messages`` (and ``tools``, the schemas the template lists) in the teacher's own chat template, as text.

    Raises UserError when the tokenizer has no chat template, the template refuses a role, or
    a message's content is missing from the rendered text (a role the template silently drops).
    """
    name = _tokenizer_name(teacher_tokenizer)
    roles = sorted({m["role"] for m in messages})
    if not getattr(teacher_tokenizer, "chat_template", None):
        raise UserError(
            f"the teacher tokenizer {name!r} has no chat template, so the prompt cannot be re-rendered for it; "
            "set tokenizer.chat_template (or save one in its tokenizer_config.json) to a template with the roles "
            f"{', '.join(roles)}"
        )
    try:
        text = render_chat(teacher_tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except Exception as err:  # Jinja's TemplateError, or a KeyError/TypeError from the template's own code
        raise UserError(
            f"the teacher's chat template ({name!r}) cannot render the roles {', '.join(roles)}: {err}. Give the "
            "teacher a template that knows these roles, or merge the unsupported messages (e.g. the system prompt "
            "into the first user message) before rendering"
        ) from err
    pos = 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or not content:
            continue
        found = text.find(content, pos)
        if found < 0:
            raise UserError(
                f"the teacher's chat template ({name!r}) dropped the {m['role']!r} message (its content is not in the "
                "rendered text): give the teacher a template that renders this role, or merge the message into "
                "one it renders"
            )
        pos = found + len(content)
    return text


def teacher_prompt_and_response_ids(
    teacher_tokenizer,
    messages: Sequence[dict],
    response_text: str,
    end_token: str | None = None,
    tools: Sequence[dict] | None = None,
) -> tuple[list[int], list[int]]:
    """The teacher's prompt ids (its template) and response ids (the response text on its own).

    ``end_token`` (e.g. the teacher's EOS name), when given, is appended to the response ids: a
    student response that ended with its EOS should end with the teacher's, so the two EOS
    positions pair up (see ``special_pairs`` in :func:`opd.crosstok.build_vocab_map`).
    """
    prompt = render_for_teacher(teacher_tokenizer, messages, add_generation_prompt=True, tools=tools)
    # The template writes its own BOS and markers as text; adding special tokens would double them.
    prompt_ids = teacher_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = teacher_tokenizer(response_text, add_special_tokens=False)["input_ids"]
    if end_token is not None:
        end_id = teacher_tokenizer.convert_tokens_to_ids(end_token)
        unknown = end_id == teacher_tokenizer.unk_token_id and end_token != teacher_tokenizer.unk_token
        if end_id is None or unknown:
            name = _tokenizer_name(teacher_tokenizer)
            raise UserError(
                f"end_token {end_token!r} is not a token of the teacher tokenizer ({name!r}): pass its EOS or "
                f"end-of-turn token, e.g. {teacher_tokenizer.eos_token!r}"
            )
        response_ids = [*response_ids, end_id]
    return prompt_ids, response_ids
