"""Model cards: the ``README.md`` of a trained model's folder (``final/``, ``opd merge-lora``'s output), as
the Hugging Face Hub reads it: front matter (``base_model``, ``library_name``, ``tags``, ``datasets``,
written by huggingface_hub's ``ModelCardData``) and a body with the method and its options, the last
evaluation's figures, and the opd version and commit that made it. Pushing stays the user's
(``hf upload ORG/NAME RUN/final``): opd never uploads.

A name goes into the front matter only when it is a Hub id (a local path would make the Hub link a
model that does not exist); a benchmark preset is named by its dataset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import opd
from opd.config import SFTConfig, TrainConfig
from opd.hub import looks_like_repo_id
from opd.runs.provenance import source_commit

TAGS = ["opd", "distillation", "on-policy-distillation"]
# The options that say what was trained how, in the card's table (those the run set and has).
METHOD = (
    "student",
    "student_revision",
    "teacher",
    "teacher_revision",
    "teacher_url",
    "objective",
    "k",
    "support",
    "tail",
    "renormalize",
    "forward_kl_share",
    "task",
    "task_revision",
    "env",
    "steps",
    "batch_size",
    "lr",
    "schedule",
    "max_new_tokens",
    "temperature",
    "top_p",
    "lora_r",
    "dtype",
    "seed",
)


def _hub_id(name: Any) -> str | None:
    text = str(name or "")
    return text if text and not Path(text).exists() and "/" in text and looks_like_repo_id(text) else None


def _dataset_id(task: str) -> str | None:
    from opd.tasks.presets import PRESETS

    if task in PRESETS and not Path(task).exists():
        return PRESETS[task].repo
    return _hub_id(task.partition(":")[0])


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def front_matter(base: str, datasets: list[str], lora: bool, extra_tags: tuple[str, ...] = ()) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        base_model=_hub_id(base),
        library_name="peft" if lora else "transformers",
        tags=[*TAGS, *extra_tags, *(["lora"] if lora else [])],
        datasets=[d for d in datasets if d] or None,
    )
    return f"---\n{data.to_yaml()}\n---\n"


SFT_METHOD = (
    "init",
    "arch",
    "data",
    "task",
    "task_revision",
    "teacher",
    "steps",
    "batch_size",
    "lr",
    "schedule",
    "dtype",
    "seed",
)


def _datasets(cfg: TrainConfig | SFTConfig) -> list[str]:
    tasks = [cfg.data.task, cfg.eval.eval_task] + [
        t.get("task", "") for t in (cfg.multitask.tasks or []) if isinstance(t, dict)
    ]
    return list(dict.fromkeys(d for d in map(_dataset_id, [t for t in tasks if t]) if d))


def _options(cfg: TrainConfig | SFTConfig, names: tuple[str, ...]) -> list[str]:
    values = cfg.flat()
    rows = [(k, values[k]) for k in names if k in values and (values[k] not in (None, "", [], 0) or k == "k")]
    return ["## Method and options", "", "| option | value |", "|---|---|", *[f"| {k} | {_cell(v)} |" for k, v in rows]]


def _card(
    cfg: TrainConfig | SFTConfig, base: str, run_name: str, intro: str, names: tuple[str, ...], figures: list[str]
) -> str:
    lora = isinstance(cfg, TrainConfig) and cfg.lora.lora_r > 0
    lines = [front_matter(base, _datasets(cfg), lora).rstrip("\n"), "", f"# {run_name}", "", intro, ""]
    lines += [*_options(cfg, names), "", "## Evaluation", "", *figures, "", *_usage(lora=lora)]
    return "\n".join(lines) + "\n"


def run_card(cfg: TrainConfig, run_name: str, evaluation: dict) -> str:
    """The card of an OPD run's ``final/``: ``cfg`` its TrainConfig, ``evaluation`` its last eval record."""
    teacher = cfg.teacher.teacher or cfg.teacher.teacher_url or "a served teacher"
    intro = (
        f"**{cfg.model.student}** distilled on-policy from the teacher **{teacher}** with "
        f"opd {opd.__version__} (commit {source_commit()}): the student samples, the "
        f"teacher scores every token of the samples, and the student moves toward it (objective `{cfg.objective.objective}`)."
    )
    figures = sorted((k, v) for k, v in evaluation.items() if k.startswith("eval/") and isinstance(v, (int, float)))
    if figures:
        table = [f"The evaluation at step {evaluation.get('step')} (of the weights in this folder):", ""]
        table += ["| figure | value |", "|---|---|", *[f"| {k} | {v:.4g} |" for k, v in figures]]
    else:
        table = ["The run did not evaluate (--no-eval, or no held-out reference answers)."]
    return _card(cfg, cfg.model.student, run_name, intro, METHOD, table)


def sft_card(cfg: SFTConfig, run_name: str, summary: dict) -> str:
    """The card of an SFT run's ``final/``: ``cfg`` its SFTConfig, ``summary`` its summary.json."""
    start = f"**{cfg.model.init}**" if cfg.model.init else f"a new model ({cfg.model.arch})"
    data = cfg.data.data or f"the task's own solutions ({cfg.data.task or 'tasks'})"
    intro = f"{start} fine-tuned (SFT) on {data} with opd {opd.__version__} (commit {source_commit()})."
    keys = ("best_accuracy", "test_accuracy", "chosen_on", "steps")
    rows = [(k, summary[k]) for k in keys if k in summary]
    if "best_accuracy" in summary:
        table = ["Greedy accuracy of the weights in this folder (chosen on the best evaluation):", ""]
        table += ["| figure | value |", "|---|---|", *[f"| {k} | {_cell(v)} |" for k, v in rows]]
    else:
        table = ["The run did not evaluate: the last step's weights are kept."]
    return _card(cfg, cfg.model.init, run_name, intro, SFT_METHOD, table)


def merged_card(adapter: Path, base: str) -> str:
    """The card of ``opd merge-lora``'s output: the adapter's own card's body (its method and figures),
    under front matter for a whole model on ``base``."""
    own = adapter / "README.md"
    body = own.read_text().split("\n---\n", 1)[-1] if own.is_file() and own.read_text().startswith("---\n") else ""
    intro = f"The LoRA adapter {adapter} merged into its base model {base} (opd merge-lora, opd {opd.__version__}, "
    intro += f"commit {source_commit()})."
    return "\n".join([front_matter(base, [], lora=False, extra_tags=("merged-lora",)), intro, "", body.strip(), ""])


def _usage(lora: bool) -> list[str]:
    load = (
        "from peft import AutoPeftModelForCausalLM\nmodel = AutoPeftModelForCausalLM.from_pretrained(PATH)"
        if lora
        else "from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(PATH)"
    )
    return [
        "## Use",
        "",
        "```python",
        load,
        "```",
        "",
        "Publish it with `hf upload ORG/NAME PATH` (opd never uploads).",
    ]


def write_card(folder: Path, text: str) -> None:
    """``folder/README.md``, written whole or not at all."""
    from opd.runs.rundir import _atomic_write_text

    _atomic_write_text(Path(folder) / "README.md", text)
