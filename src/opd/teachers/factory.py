"""The trainer's teacher from its config: in-process (``--teacher DIR``), served (``--teacher-url``),
or either one wrapped for a teacher with another tokenizer (``--cross-tokenizer``).

The one module that imports every teacher backend; the backends import only the protocol
(:mod:`opd.teachers.scoring`), so none of them imports this back.
"""

from __future__ import annotations

import os
import sys
from typing import Any, cast

from opd.chat import set_chat_options
from opd.config import TrainConfig, check_cross_tokenizer, parse_special_map
from opd.errors import UserError
from opd.models.loading import check_same_vocab, head_weight, load_model, load_tokenizer, model_device
from opd.objectives import SERVED_GIVES, refusal
from opd.service import TEACHER_KEY_ENV, api_key
from opd.teachers.client import SERVED_OBJECTIVES, HTTPTeacher
from opd.teachers.crosstok import CrossTokenizerTeacher
from opd.teachers.scoring import HFTeacher, TeacherScorer
from opd.teachers.sharded import ShardedTeacher


def make_teacher(cfg: TrainConfig, student, tokenizer):
    """The trainer's teacher: in-process from ``cfg.teacher.teacher`` (sharded across the ranks under ``--fsdp``:
    :mod:`opd.teachers.sharded`), or served at ``cfg.teacher.teacher_url``; wrapped for cross-tokenizer OPD when
    its tokenizer differs (``cfg.cross_tokenizer.cross_tokenizer``)."""
    if not cfg.teacher.teacher_url:
        dtype, rev = cfg.teacher.teacher_dtype or cfg.model.dtype, cfg.teacher.teacher_revision
        teacher_model = load_model(cfg.teacher.teacher, "teacher", dtype, model_device(student), revision=rev)
        teacher_tok = teacher_tokenizer(
            cfg, cfg.teacher.teacher_tokenizer or cfg.teacher.teacher, "" if cfg.teacher.teacher_tokenizer else rev
        )
        cross = uses_cross_tokenizer(cfg, tokenizer, teacher_tok)
        if not cross:
            check_same_vocab(tokenizer, teacher_tok, student, teacher_model)
        # under --fsdp sharded across the ranks as the student is (the process group is up by now)
        teacher = ShardedTeacher(teacher_model) if cfg.run.fsdp else HFTeacher(teacher_model)
        return cross_tokenizer_teacher(cfg, teacher, tokenizer, teacher_tok) if cross else teacher
    if cfg.teacher.teacher:
        raise UserError("both --teacher and --teacher-url are set; give one (a model directory or a served teacher)")
    why = refusal(cfg.objective, SERVED_GIVES, "a vLLM-format server does not return")
    if why:
        raise UserError(f"{why}; with --teacher-url use {SERVED_OBJECTIVES}, or use --teacher DIR")
    key = api_key(TEACHER_KEY_ENV, cfg.teacher.teacher_api_key)
    client: dict[str, Any] = dict(
        timeout=cfg.teacher.teacher_timeout,
        wait=cfg.teacher.teacher_wait,
        retries=cfg.teacher.teacher_retries,
        api_key=key,
        k=cfg.objective.k,
    )
    if cfg.teacher.teacher_tokenizer:
        teacher_tok = teacher_tokenizer(cfg, cfg.teacher.teacher_tokenizer)
        if uses_cross_tokenizer(cfg, tokenizer, teacher_tok):
            # The server scores teacher-token sequences; its head size comes from its /opd/vocab answer.
            inner = HTTPTeacher(cfg.teacher.teacher_url, teacher_tok, None, **client)
            return cross_tokenizer_teacher(cfg, inner, tokenizer, teacher_tok)
    return HTTPTeacher(cfg.teacher.teacher_url, tokenizer, head_weight(student).shape[0], **client)


def teacher_tokenizer(cfg: TrainConfig, path: str, revision: str = ""):
    """The teacher's tokenizer, with its chat template options (``--teacher-chat-template-kwargs``, by
    default the student's): used where the teacher renders prompts itself (cross-tokenizer)."""
    own = (
        cfg.teacher.teacher_chat_template_kwargs is not None
    )  # the student's options are checked on the student's template
    check = own and cfg.data.check_chat_template_kwargs
    tok = load_tokenizer(path, "teacher", revision=revision)
    return set_chat_options(tok, cfg.teacher_chat_options(), "teacher_chat_template_kwargs", check=check)


def is_served(teacher: TeacherScorer) -> bool:
    """Whether the teacher scores in a process of its own (a server), not on the trainer's cores; a
    cross-tokenizer teacher is not, as it aligns the two tokenizations here."""
    return isinstance(teacher, HTTPTeacher)


def uses_cross_tokenizer(cfg: TrainConfig, student_tok, teacher_tok) -> bool:
    """``--cross-tokenizer``: on, off, or auto (on exactly when the two vocabularies differ)."""
    if cfg.cross_tokenizer.cross_tokenizer == "auto":
        return student_tok.get_vocab() != teacher_tok.get_vocab()
    return cfg.cross_tokenizer.cross_tokenizer == "on"


def cross_tokenizer_teacher(cfg: TrainConfig, inner: TeacherScorer, student_tok, teacher_tok) -> TeacherScorer:
    """``inner`` wrapped to score in the student's frame, after the options it cannot do are refused."""
    if (
        cfg.cross_tokenizer.cross_tokenizer == "auto"
    ):  # found here, from the vocabularies; "on" was refused with the config
        check_cross_tokenizer(cfg)
    if isinstance(inner, HFTeacher):
        rows, context = head_weight(inner.model).shape[0], getattr(inner.model.config, "max_position_embeddings", None)
    else:  # a served teacher's server bounds what it reads (vLLM: max_model_len; opd: --max-prompt-tokens)
        rows, context = cast(int, cast(HTTPTeacher, inner).vocab_rows), None  # set when it connected
    if cfg.objective.k > rows:
        raise UserError(
            f"k={cfg.objective.k} is larger than the teacher's vocabulary ({rows} tokens); choose --k <= {rows}"
        )
    teacher = CrossTokenizerTeacher(
        inner,
        student_tok,
        teacher_tok,
        objective=cfg.objective.objective,
        pairing=cfg.cross_tokenizer.cross_pairing,
        unmapped=cfg.cross_tokenizer.cross_unmapped,
        joinable=cfg.cross_tokenizer.cross_joinable,
        special_map=parse_special_map(cfg.cross_tokenizer.teacher_special_map),
        teacher_rows=rows,
        teacher_context=context,
    )
    if os.environ.get("RANK", "0") == "0":  # one line per run, not one per rank (torchrun/accelerate set RANK)
        print(f"opd train: {teacher.notice}", file=sys.stderr, flush=True)
    return teacher
