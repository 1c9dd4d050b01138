"""A causal LM's output head as its forward computes it, read off the model and checked at load.

transformers' causal LMs compute ``logits = lm_head(hidden)`` and then, family by family, change
them: Granite divides by ``config.logits_scaling``, Cohere multiplies by ``config.logit_scale``,
Gemma 2 (and any config with ``final_logit_softcapping``) soft-caps them, c * tanh(z / c); phi-1 and
phi-2 give ``lm_head`` a bias. :func:`model_head` builds the :class:`~opd.losses.Head` the losses
take from those; ``check_head`` runs a short probe through the model's own forward and
refuses a model whose logits opd's head does not reproduce (a family that does something else),
so no run trains on numbers that are not the model's (:func:`opd.models.loading.check_head`,
which needs the model's final hidden states).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opd.losses import Head

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Config attributes that change the logits after the head's matmul, and how (read from the
# families' forwards in transformers 5.24: cohere, cohere2, granite*, gemma2, gemma3, ...).
MULTIPLY, DIVIDE, SOFTCAP = "logit_scale", "logits_scaling", "final_logit_softcapping"


def _factor(config: object, name: str) -> float | None:
    value = getattr(config, name, None)
    return None if value is None else float(value)


def model_head(model: PreTrainedModel) -> Head:
    """The model's :class:`~opd.losses.Head`: ``lm_head``'s weight and bias (tied models share the
    weight with the input embedding), the config's logit scale and soft-cap."""
    out = model.get_output_embeddings()
    cfg = model.config
    scale = 1.0
    if (mul := _factor(cfg, MULTIPLY)) is not None:
        scale *= mul
    if (div := _factor(cfg, DIVIDE)) is not None:
        scale /= div
    cap = _factor(cfg, SOFTCAP)
    return Head(out.weight, getattr(out, "bias", None), scale, cap or None)


def describe(head: Head) -> str:
    """The head's transformation in words, for messages: 'bias, scale 0.125, soft-cap 30'."""
    parts = ["bias"] if head.bias_V is not None else []
    parts += [f"scale {head.scale:g}"] if head.scale != 1.0 else []
    parts += [f"soft-cap {head.softcap:g}"] if head.softcap is not None else []
    return ", ".join(parts) or "plain hidden @ W.T"
