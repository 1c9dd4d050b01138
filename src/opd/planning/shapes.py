"""A model's shape from its config alone: built on the meta device (no weights read, no memory), so a
Hub name needs only its cached ``config.json`` and an 8B model costs nothing to plan."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.errors import UserError
from opd.hub import resolve_model


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan reads of a decoder-only model.

    ``params``: every parameter once (a tied head counted once); ``layer_params``: one decoder layer's
    (the largest); ``lora_dims``: (in, out) features of each linear layer of the blocks, by its name
    (``q_proj``...), every layer's, for a LoRA adapter's size; ``qk_norm``: the attention normalises
    queries and keys per head (Qwen3), which keeps two more tensors of each for the backward."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    params: int
    layer_params: int
    qk_norm: bool = False
    lora_dims: tuple[tuple[str, int, int], ...] = ()

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def lora_layers(self, targets: list[str]) -> list[tuple[int, int]]:
        """(in, out) features of each linear layer a LoRA on ``targets`` adapts (``all-linear``: every one)."""
        names = {n for t in targets for n in str(t).split(",") if n}
        every = not names or "all-linear" in names
        return [(i, o) for n, i, o in self.lora_dims if every or n in names]

    def lora_params(self, r: int, targets: list[str]) -> int:
        """A rank-``r`` adapter's parameters on ``targets``."""
        return sum(r * (i + o) for i, o in self.lora_layers(targets))


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} has no config.json: give a model folder or a Hub name in the cache") from None
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None


def model_shape(name: str, revision: str = "", what: str = "model") -> ModelShape:
    """The shape of the model ``name`` (a folder, or a Hub name resolved through the cache), from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = resolve_model(name, revision, what)
    read_config(folder)  # a clear error for a folder without one
    config = AutoConfig.from_pretrained(folder)
    text = getattr(config, "get_text_config", lambda: config)()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = model.get_decoder().layers
    count = lambda m: sum(p.numel() for p in m.parameters())
    dims = tuple(
        (sub.rsplit(".", 1)[-1], mod.in_features, mod.out_features)
        for i, layer in enumerate(layers)
        for sub, mod in layer.named_modules(prefix=f"layers.{i}")
        if isinstance(mod, torch.nn.Linear)
    )
    heads = int(text.num_attention_heads)
    attention = layers[0].self_attn
    return ModelShape(
        name=str(name),
        layers=len(layers),
        hidden=int(text.hidden_size),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate=int(text.intermediate_size),
        vocab=int(text.vocab_size),
        tied=bool(getattr(text, "tie_word_embeddings", False)),
        params=count(model),
        layer_params=max(count(layer) for layer in layers),
        qk_norm=hasattr(attention, "q_norm"),
        lora_dims=dims,
    )
