"""A teacher with another tokenizer reads a whole conversation, with its tools and its own template options,
in its own chat template; a prompt it cannot recover the messages of is refused with a clear error."""

from __future__ import annotations

import pytest
import torch
from chat_templates import ADD, CONVERSATION, with_tools_template
from crosstok_tokenizers import make_teacher_tok

from opd.chat import set_chat_options
from opd.crosstok.template import render_for_teacher, teacher_prompt_and_response_ids
from opd.errors import UserError
from opd.models.loading import load_tokenizer
from opd.rollout.prompt_set import PromptSet
from opd.rollout.sampling import RolloutBatch
from opd.tasks import Example
from opd.teachers.crosstok import CrossTokenizerTeacher
from opd.teachers.scoring import TeacherScores

# The teacher's own markup: every role, its tools and tool calls, and its own thinking switch.
TEACHER_TEMPLATE = (
    "{% if tools %}[TOOLS] {{ tools | map(attribute='function') | map(attribute='name') | join(' ') }}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}[CALL {{ c['function']['name'] }}]{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% if enable_thinking is defined and not enable_thinking %}"
    " [NO-THINK]{% endif %} {% endif %}"
)
WHOLE = (
    "[TOOLS] add\n[SYSTEM] You add numbers.\n[USER] What is 2 + 3?\n[ASSISTANT] [CALL add]\n[TOOL] 5\n"
    "[ASSISTANT] It is \\boxed{5}\n[USER] And 4 + 4?\n[ASSISTANT] [NO-THINK] "
)


class _Recorder:
    """A teacher-frame scorer that keeps the batch it was asked to score (uniform top-1 answers)."""

    seen: RolloutBatch | None = None

    def score(self, batch, k, query_ids_NTQ=None, diag_index_M=None):
        self.seen = batch
        N, U = batch.response_ids_NT.shape
        return TeacherScores(torch.zeros(N, U, k, dtype=torch.long), torch.zeros(N, U, k), torch.zeros(N, U))


@pytest.fixture
def toks(tiny_tokenizer):
    student = set_chat_options(
        with_tools_template(load_tokenizer(tiny_tokenizer, "student")), {"enable_thinking": True}
    )
    teacher = make_teacher_tok(texts=["[USER] [ASSISTANT] [SYSTEM] [TOOL] what is and add numbers"] * 40)
    teacher.chat_template = TEACHER_TEMPLATE
    return student, set_chat_options(teacher, {"enable_thinking": False})


def _batch(tok, prompt_ids: list[int], response: str) -> RolloutBatch:
    resp = tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]
    P, T = len(prompt_ids), len(resp)
    ids = torch.tensor([prompt_ids + resp])
    mask = torch.ones(1, T, dtype=torch.bool)
    return RolloutBatch(
        ids, torch.ones_like(ids), P, ids[:, P:], mask, torch.full((1, T), -0.5), torch.ones(1, dtype=torch.bool)
    )


def test_the_teacher_renders_a_conversation_whole_with_its_tools(toks):
    student, teacher = toks
    assert render_for_teacher(teacher, CONVERSATION, tools=[ADD]) == WHOLE
    prompt_ids, response_ids = teacher_prompt_and_response_ids(teacher, CONVERSATION, "8", "</s>", tools=[ADD])
    assert teacher.decode(prompt_ids) == WHOLE and teacher.convert_ids_to_tokens(response_ids)[-1] == "</s>"


def test_the_scorer_reads_the_prompt_sets_messages_or_refuses(toks):
    student, teacher = toks
    example = Example("And 4 + 4?", None, messages=tuple(CONVERSATION), tools=(ADD,))
    prompts = PromptSet.build([example], student, 512)
    inner = _Recorder()
    scorer = CrossTokenizerTeacher(inner, student, teacher, objective="lsm")
    batch = _batch(student, prompts.prompt_ids[0], "It is \\boxed{8}")
    # from the ids alone a conversation cannot be recovered: a clear refusal, not a wrong prompt
    with pytest.raises(UserError, match=r"a student prompt is not a user turn .* give a conversation or tools"):
        scorer.score(batch, 2)
    scorer.read_prompts(prompts)
    scorer.score(batch, 2)
    assert inner.seen is not None
    seen = inner.seen.input_ids_NL[0, : inner.seen.prompt_len][
        inner.seen.attention_mask_NL[0, : inner.seen.prompt_len].bool()
    ]
    assert teacher.decode(seen.tolist()) == WHOLE
