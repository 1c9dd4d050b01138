"""The teacher's options of ``opd train`` (sections "teacher" and "cross_tokenizer"): which teacher,
in-process or served by one or several servers, how long to wait for it, and how a teacher with another
tokenizer is paired with the student; with their checks. What a teacher with another tokenizer can train
(objective, support, environment) is the run's check, :func:`opd.config.options.check_cross_tokenizer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opd.config.fields import DTYPES, ConfigError, Section, opt, require
from opd.config.sources import chat_options, teacher_revision_option
from opd.crosstok.align import PAIRINGS
from opd.crosstok.vocab_map import JOINABLE, UNMAPPED
from opd.service import check_url, url_problem

CROSS_TOKENIZER = ("auto", "on", "off")


@dataclass(frozen=True)
class TeacherOptions(Section):
    """Section "teacher" of opd train: which teacher, in-process or served, and how long to wait for it
    (``--teacher-revision`` is ``opd sft``'s too: :func:`opd.config.sources.teacher_revision_option`)."""

    teacher: str = opt(
        "",
        "Teacher model: a directory or a Hub name (its own tokenizer too: --cross-tokenizer, --teacher-tokenizer).",
        per_task=True,
    )
    teacher_revision: str = teacher_revision_option()
    teacher_tokenizer: str = opt(
        "",
        "Teacher tokenizer directory (default: the --teacher directory). With --teacher-url, the served "
        "model's tokenizer: given and different from the student's, the server scores the teacher's own "
        "tokenization (cross-tokenizer OPD).",
        per_task=True,
    )
    teacher_chat_template_kwargs: dict[str, Any] | None = opt(
        None,
        "Options for the teacher's chat template, a JSON object, where the teacher renders the prompts itself "
        "(a teacher with another tokenizer: --cross-tokenizer); a teacher with the student's tokenizer reads the "
        "student's rendering. Unset: --chat-template-kwargs; '{}': none.",
    )
    teacher_dtype: str = opt(
        "",
        "In-process teacher's dtype (default: --dtype). The teacher is never trained, so it can "
        "run in bfloat16 while the student trains in float32, as a served teacher usually does; "
        "its log-probs are still taken in float32.",
        per_task=True,
    )
    # a list too: the flag repeated, or a YAML/JSON list; validation joins it with commas (config.json keeps a string)
    teacher_url: list[Any] | str = opt(
        "",
        "Served teacher (opd serve-teacher, or a vLLM server: vLLM's prompt_logprobs format), e.g. "
        "http://127.0.0.1:8000; replaces --teacher. Several servers of the same teacher, comma-separated or the "
        "flag repeated, share the requests (each to the least busy; one that fails is skipped until it answers "
        "again). Works with --objective sampled and lsm with support teacher_topk or teacher_topk_plus_sampled.",
        per_task=True,
    )
    teacher_timeout: float = opt(120.0, "Seconds to wait for one served-teacher request before retrying.")
    teacher_wait: float = opt(
        600.0,
        "Seconds to wait for a served teacher that stops answering (at startup too), then checkpoint and stop.",
    )
    teacher_retries: int | None = opt(None, "At most N retries of a failed served-teacher request (unset: no cap).")
    teacher_api_key: str = opt(
        "",
        "API key sent to served teachers as 'Authorization: Bearer KEY' (the key of vLLM's or opd "
        "serve-teacher's --api-key). Better set the environment variable OPD_TEACHER_API_KEY, which keeps it "
        "out of process lists and shell history. Never written to config.json, checkpoints, logs or trackers.",
        secret=True,
    )

    def check(self) -> None:
        check_teacher_options(self)


@dataclass(frozen=True)
class CrossTokenizerOptions(Section):
    """Section "cross_tokenizer" (opd train): how a teacher with another tokenizer is paired with the student."""

    cross_tokenizer: str = opt(
        "auto",
        "Cross-tokenizer OPD, for a teacher with another tokenizer: auto (on when the two vocabularies differ), "
        "on, or off (a different vocabulary is an error). The teacher reads the same text in its own chat "
        "template and tokenization; its scores are aligned to the student's tokens by bytes. Trains lsm "
        "(--support teacher_topk) or sampled (span reward); not full_kl, student-side supports or --env.",
        per_task=True,
    )
    cross_pairing: str = opt(
        "group_start",
        "Cross-tokenizer LSM: which student positions get the teacher's top-K. group_start: the first "
        "token of every aligned group (both sides then read the same text prefix); one_to_one: only "
        "tokens whose bytes are exactly one teacher token; within_group: group_start, and the later "
        "tokens of a group with one teacher token (the student's '5' of the teacher's '15') get the "
        "teacher's distribution at the group's start, kept where it goes on past the group's bytes so far.",
        per_task=True,
    )
    cross_unmapped: str = opt(
        "drop",
        "Cross-tokenizer LSM: a teacher token with no student token of the same bytes (the teacher's '19' "
        "where the student writes each digit). drop: left out of the support; prefix: counted for the "
        "longest student token its bytes begin with ('1'), the teacher's mass for how the text goes on. "
        "For a teacher whose tokens are longer than the student's (docs/cross-tokenizer.md).",
        per_task=True,
    )
    cross_joinable: str = opt(
        "keep",
        "Cross-tokenizer LSM: support tokens the teacher's tokenizer would have joined to its token before the "
        "position (the student's '5' after the teacher's '1', where the teacher writes '15'). keep, or drop them "
        "from the support: the teacher's probability for them is that of a token boundary it never makes.",
        per_task=True,
    )
    teacher_special_map: list[Any] = opt(
        [],
        "Cross-tokenizer: student special tokens and the teacher's that stand for them, STUDENT=TEACHER, "
        "comma-separated (e.g. '<|im_end|>=</s>'). Same-named specials pair by themselves; the student's "
        "EOS pairs with the teacher's EOS unless given here.",
        per_task=True,
    )

    def check(self) -> None:
        check_cross_tokenizer_options(self)


def resolve_teacher(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a training run's options) with the served teachers as one comma-separated string and
    the teacher's chat template options (when given) read from their JSON."""
    values["teacher_url"] = teacher_urls(values["teacher_url"])
    if values["teacher_chat_template_kwargs"] is not None:
        values["teacher_chat_template_kwargs"] = chat_options(
            values["teacher_chat_template_kwargs"], "teacher_chat_template_kwargs"
        )
    return values


def check_teacher_options(cfg: TeacherOptions) -> None:
    """The teacher section's options, each naming the option and the fix."""
    require(cfg.teacher_dtype in ("", *DTYPES), f"teacher_dtype={cfg.teacher_dtype!r}: use {', '.join(DTYPES)}")
    require(
        not (cfg.teacher_dtype and cfg.teacher_url),
        "teacher_dtype applies to an in-process teacher "
        "(--teacher DIR); a served teacher keeps the dtype it was started with (opd serve-teacher --dtype): "
        "drop --teacher-dtype",
    )
    require(
        cfg.teacher_timeout > 0 and cfg.teacher_wait >= 0 and (cfg.teacher_retries or 0) >= 0,
        "teacher_timeout must be > 0, teacher_wait >= 0 and teacher_retries >= 0 (or unset)",
    )


def check_cross_tokenizer_options(cfg: CrossTokenizerOptions) -> None:
    """The cross_tokenizer section's options, each one of its choices (what they can train is
    :func:`opd.config.options.check_cross_tokenizer`'s)."""
    for name, value, choices in (
        ("cross_tokenizer", cfg.cross_tokenizer, CROSS_TOKENIZER),
        ("cross_pairing", cfg.cross_pairing, PAIRINGS),
        ("cross_joinable", cfg.cross_joinable, JOINABLE),
        ("cross_unmapped", cfg.cross_unmapped, UNMAPPED),
    ):
        require(value in choices, f"{name}={value!r}: choose one of {', '.join(choices)}")
    parse_special_map(cfg.teacher_special_map)


def teacher_urls(value: Any) -> str:
    """``--teacher-url``'s servers (a string, comma-separated, or a list of them), each checked, as one
    comma-separated string: the form config.json has always held."""
    given = [value] if isinstance(value, str) else value
    require(
        isinstance(given, list) and all(isinstance(v, str) for v in given),
        f"teacher_url: {value!r} must be a URL, several comma-separated, or a list of them",
    )
    urls = [u.strip() for v in given for u in v.split(",") if u.strip()]
    for url in urls:
        problem = url_problem(url, "--teacher-url")
        require(not problem, problem)
    same = [check_url(u, "--teacher-url") for u in urls]  # http://h:1/ and http://h:1/v1 are http://h:1
    twice = sorted({u for u in same if same.count(u) > 1})
    require(not twice, f"--teacher-url lists {', '.join(twice)} more than once; list each server once")
    return ",".join(urls)


def parse_special_map(items: list[str]) -> dict[str, str]:
    """``--teacher-special-map`` items ``STUDENT=TEACHER`` (special token names; several comma-separated
    or repeated), as a dict."""
    out = {}
    for item in (piece for value in items for piece in str(value).split(",") if piece.strip()):
        student, sep, teacher = str(item).partition("=")
        if not sep or not student.strip() or not teacher.strip():
            raise ConfigError(
                f"teacher_special_map item {item!r} is not STUDENT=TEACHER; write e.g. '<|im_end|>=</s>' "
                "(a student special token, then the teacher's that stands for it)"
            )
        out[student.strip()] = teacher.strip()
    return out
