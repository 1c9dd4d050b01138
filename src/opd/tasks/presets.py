"""Benchmark presets: ``--task gsm8k`` or ``--eval-task math500`` names a public data set on the Hub with
its columns, answer format and prompt template, so that figures compare with the papers that used them.

A preset is read like any Hub dataset name (:func:`opd.hub.load_hub_dataset`: the Hugging Face cache,
downloading where the network allows), through :class:`opd.tasks.dataset.DatasetTask`; the preset only
fills in the options a user would otherwise pass (``--prompt-field``, ``--answer-format`` ...).

Revisions: each preset reads one commit of its dataset repository (``revision`` below), so that its rows do
not change under a figure when the repository does; ``--task-revision`` / ``--eval-revision`` reads another
(``main``, or a commit hash). The hashes could not be read from the Hub where this table was written (no
network): each is the commit that several unrelated public repositories pin for that dataset, found by a code
search on 2026-11-29 (the sources are named beside each preset). AIME has several copies on the Hub; the
ones below are those open-r1 and lighteval evaluate.

Adding one: :func:`register_preset` (``register_preset("mybench", Preset("org/name", ...))``) before the run
builds its config, e.g. in a script that then calls ``opd.cli.main``.
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.errors import UserError

# The template of the reasoning papers' math evaluations (Qwen2.5-Math, DeepSeek-R1, open-r1).
STEP_BY_STEP_BOXED = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."
# GSM8K's own solutions end in '#### N'; its reference is read the same way as the model's answer.
STEP_BY_STEP_GSM8K = "{prompt}\nPlease reason step by step, and write the final answer as '#### N' on the last line."


@dataclass(frozen=True)
class Preset:
    """A public benchmark: where it lives on the Hub and how its rows become prompts and answers."""

    repo: str  # the Hub dataset id
    config: str = ""  # its configuration (datasets' "name"), if it has several
    revision: str = ""  # the commit read (a branch or tag works too); "" reads main
    split: str = ""  # the evaluated split ("" : test, or the only one)
    prompt_field: str = "problem"
    answer_field: str = "answer"
    answer_format: str = "boxed"
    template: str = STEP_BY_STEP_BOXED  # '{prompt}' is the row's question
    about: str = ""

    @property
    def source(self) -> str:
        """The name :func:`opd.tasks.dataset.read_splits` reads (``REPO`` or ``REPO:CONFIG``)."""
        return f"{self.repo}:{self.config}" if self.config else self.repo


PRESETS: dict[str, Preset] = {
    # openai/gsm8k@740312a: Hub-cache snapshot paths (datasets--openai--gsm8k/snapshots/740312a.../main/
    # test-00000-of-00001.parquet) and load_dataset("openai/gsm8k", "main", revision=...) calls in several repositories.
    "gsm8k": Preset(
        "openai/gsm8k",
        config="main",
        revision="740312add88f781978c0658806c59bc2815b9866",
        prompt_field="question",
        answer_format="gsm8k",
        template=STEP_BY_STEP_GSM8K,
        about="GSM8K (train 7,473 / test 1,319), answers after '####'",
    ),
    # HuggingFaceH4/MATH-500@6e4ed1a: datasets' prepared-cache paths (HuggingFaceH4___math-500/default/0.0.0/
    # 6e4ed1a.../math-500-test.arrow) and revision pins of 500-row test.jsonl in several repositories.
    "math500": Preset(
        "HuggingFaceH4/MATH-500",
        revision="6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be",
        split="test",
        about="MATH-500 (500 test problems), boxed answers",
    ),
    # HuggingFaceH4/aime_2024@2fe88a2: Hub-cache snapshot paths (datasets--HuggingFaceH4--aime_2024/snapshots/
    # 2fe88a2.../data/train-00000-of-00001.parquet) and revision pins of its 30 rows in several repositories.
    "aime24": Preset(
        "HuggingFaceH4/aime_2024",
        revision="2fe88a2f1091d5048c0f36abc874fb997b3dd99a",
        split="train",
        about="AIME 2024 (30 problems), integer answers",
    ),
    # MathArena/aime_2025@c94da77: Hub links (huggingface.co/datasets/MathArena/aime_2025/tree/c94da77...) and
    # resolve/c94da77.../data/train-00000-of-00001.parquet pins with one file hash in several repositories.
    "aime25": Preset(
        "MathArena/aime_2025",
        revision="c94da77eb22bbd6439e62a323bec18493a421302",
        split="train",
        about="AIME 2025 (30 problems), integer answers",
    ),
}


def register_preset(name: str, preset: Preset) -> None:
    """Make ``--task NAME`` / ``--eval-task NAME`` read ``preset``."""
    if "/" in name or not name:
        raise UserError(f"preset name {name!r}: a preset name has no '/' (that reads as a Hub dataset id)")
    PRESETS[name] = preset


def preset_options(preset: Preset, options: dict) -> dict:
    """The DatasetTask options of a preset: its columns, answer format and template (what makes figures
    comparable) replace the generic ones; the split, revision and the rest of ``options`` stay the user's."""
    fixed = dict(prompt_field=preset.prompt_field, answer_field=preset.answer_field)
    evaluating = options.get("evaluation", False)
    return {
        **options,
        **fixed,
        "answer_format": preset.answer_format,
        "prompt_template": preset.template,
        "revision": options.get("revision") or preset.revision,
        "split": options.get("split") or (preset.split if evaluating else ""),
    }
