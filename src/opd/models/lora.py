"""LoRA: train a peft adapter on the student instead of all its weights (``--lora-r``), and merge it.

The adapter goes on the student's linear layers (``--lora-targets``, default every linear layer
of the transformer blocks). The output head and the input embedding cannot be targets: the losses
take the head's weight and bias (:func:`opd.models.head.model_head`) and never call the head module,
where LoRA would act, and the demo models tie that weight to the input embedding, so an adapter
there would be silently ignored by the loss. Checkpoints and ``final/`` then hold the adapter
(``adapter_model.safetensors``, ``adapter_config.json``, with the base model's absolute path, or its
Hub name and revision); ``opd merge-lora`` folds it into the base weights and writes a plain model
directory into a new or empty ``--out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from opd.errors import UserError
from opd.runs.quiet import quiet_transformers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ALL_LINEAR = "all-linear"


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _check_targets(student: PreTrainedModel, targets: list[str]) -> None:
    names = {n.rsplit(".", 1)[-1] for n, m in student.named_modules() if isinstance(m, torch.nn.Linear)}
    head = student.get_output_embeddings()
    embed = student.get_input_embeddings()
    forbidden = {n.rsplit(".", 1)[-1] for n, m in student.named_modules() if m is head or m is embed}
    for t in targets:
        if t in forbidden:
            raise UserError(
                f"--lora-targets {t!r} is the output head or input embedding, which LoRA cannot adapt here "
                "(the LSM path reads the head weight directly, and it may be tied to the embedding); "
                f"choose among the block layers: {', '.join(sorted(names - forbidden))}"
            )
        if t not in names:
            raise UserError(
                f"--lora-targets {t!r} is not a linear layer of the student; "
                f"choose among: {', '.join(sorted(names - forbidden))}"
            )


def apply_lora(
    student: PreTrainedModel,
    r: int,
    alpha: float,
    targets: list[str],
    dropout: float,
    base_path: str | Path,
    revision: str = "",
) -> PreTrainedModel:
    """Freeze the student and add a LoRA adapter (a ``peft.PeftModel``) to ``targets``."""
    from peft import LoraConfig, get_peft_model

    targets = [name for t in targets for name in t.split(",") if name and name != ALL_LINEAR]
    _check_targets(student, targets)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates it int; a float scales as well (alpha / r)
        lora_dropout=dropout,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=targets or ALL_LINEAR,
    )
    model = get_peft_model(student, config)
    # merge-lora finds the base model from this: a local folder independent of the working directory, or the
    # Hub name as given (resolved against the working directory it would name a folder that is not there)
    # with its revision.
    local = Path(base_path).is_dir()
    model.peft_config["default"].base_model_name_or_path = str(Path(base_path).resolve()) if local else str(base_path)
    model.peft_config["default"].revision = None if local or not revision else revision
    return cast("PreTrainedModel", model)  # the PeftModel stands in for the student: it forwards its attributes


def load_weights(student: PreTrainedModel, model_dir: Path) -> None:
    """Load a checkpoint's weights (a full model or a LoRA adapter) into ``student``."""
    from safetensors.torch import load_file

    if is_lora(student):
        from peft import set_peft_model_state_dict

        path = model_dir / "adapter_model.safetensors"
        if not path.is_file():
            raise UserError(
                f"checkpoint {model_dir.parent} holds no LoRA adapter; resume with the run's own "
                "settings (it was trained without --lora-r)"
            )
        result = set_peft_model_state_dict(student, load_file(str(path)))
        # peft annotates the result "namedtuple"; it is load_state_dict's (missing_keys, unexpected_keys)
        unexpected = result.unexpected_keys  # type: ignore[attr-defined]
        if unexpected:
            raise UserError(
                f"the adapter in {model_dir} does not fit this student ({len(unexpected)} "
                "unexpected tensors); resume with the same --student and --lora-* settings"
            )
        return
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise UserError(
            f"checkpoint {model_dir.parent} holds no full model (a LoRA run?); resume with the run's own --lora-r"
        )
    missing, unexpected = student.load_state_dict(load_file(str(path)), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise UserError(
            f"checkpoint {model_dir.parent} does not match the student model ({len(missing)} missing, "
            f"{len(unexpected)} unexpected tensors); resume with the same --student"
        )
    student.tie_weights()


def merge_lora(adapter: str | Path, out: str | Path, base: str | Path | None = None) -> Path:
    """Fold the adapter in ``adapter`` into its base model and write a plain model directory to ``out``."""
    import json

    from peft import PeftModel

    from opd.models.loading import load_model, load_tokenizer
    from opd.runs.card import merged_card, write_card
    from opd.runs.rundir import save_final_model

    adapter, out = Path(adapter), Path(out)
    # the merged model replaces --out whole: never a folder holding anything (the base, the adapter, a run)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a file" if not out.is_dir() else "a folder that is not empty"
        raise UserError(f"--out {out} is {what}; opd merge-lora writes the merged model into a new or empty folder")
    cfg_path = adapter / "adapter_config.json"
    if not cfg_path.is_file():
        raise UserError(
            f"{adapter} has no adapter_config.json, so it is not a LoRA adapter; pass a run's final/ "
            "or checkpoints/step_*/model directory of a --lora-r run"
        )
    saved = json.loads(cfg_path.read_text())
    base = base or saved.get("base_model_name_or_path")
    if not base:
        raise UserError(f"{cfg_path} names no base model (base_model_name_or_path); pass --base DIR")
    revision = "" if Path(base).is_dir() else (saved.get("revision") or "")  # a Hub name's, as trained
    model = load_model(base, "base", revision=revision)
    with quiet_transformers():
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    own_tok = (adapter / "tokenizer_config.json").is_file()
    tok = load_tokenizer(adapter, "base") if own_tok else load_tokenizer(base, "base", revision=revision)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_final_model(out, merged, tok)
    write_card(out, merged_card(adapter, str(base)))
    return out
