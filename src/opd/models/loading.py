"""Loading and building causal LMs, with the checks OPD needs before any work starts.

Any Hugging Face causal-LM directory works (``from_pretrained``): a local folder, or a Hub name
(``Qwen/Qwen3-1.7B``, with a revision) resolved to its snapshot in huggingface_hub's cache by
:func:`opd.hub.resolve_model` (downloaded where the network allows, read from the cache under
``HF_HUB_OFFLINE=1``); transformers then reads that folder only (``local_files_only``). The
trainer needs a model's final hidden states and its output embedding separately (the LSM fast
path gathers K rows of that weight instead of computing all V logits); :func:`final_hidden` and
:func:`~opd.models.head.model_head` (the head as the model computes it: bias, logit scale,
soft-cap) provide them, and :func:`check_head` refuses at load a model whose own logits that head
does not reproduce, rather than train on numbers that are not the model's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from opd.config import check_device
from opd.errors import UserError
from opd.hub import resolve_model
from opd.losses import Head
from opd.models.head import DIVIDE, MULTIPLY, SOFTCAP, describe, model_head
from opd.runs.quiet import quiet_transformers

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_model_dir(
    path: str | Path, role: str, required: str = "config.json", option: str | None = None, revision: str = ""
) -> Path:
    """The local folder of a model given as a folder or a Hub name (at ``revision``), checked.

    ``option`` is where the user gave the path (default ``--ROLE``), for the hints: ``opd serve-teacher``
    takes its model as an argument, so "pass --teacher ..." would send its user to an option it lacks."""
    option = option or f"--{role}"
    if not path:
        raise UserError(f"no {role} model given; {_pass(option, 'DIR')} (a Hugging Face model directory or Hub name)")
    p = resolve_model(path, revision, f"{role} model ({option})")
    if not p.is_dir():
        raise UserError(
            f"{role} model directory {p} does not exist; pass a local directory written by save_pretrained, or a "
            "Hub name (ORG/NAME)"
        )
    mistake = _not_a_model(p, option, wants_weights=required == "config.json")
    if mistake:
        raise UserError(mistake)
    if not (p / required).is_file():
        raise UserError(f"{p} has no {required}, so it is not a Hugging Face {role} directory; check the {option} path")
    return p


def _pass(option: str, value: object) -> str:
    return f"pass {option} {value}" if option.startswith("--") else f"pass {value} as {option}"


_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def _not_a_model(p: Path, option: str, wants_weights: bool) -> str | None:
    """What a directory is when it is one of the things users pass by mistake instead of a model.

    An opd run directory has a config.json too (opd's own), so transformers would answer with an
    "Unrecognized model" traceback; the directories opd writes are recognised by their layout.
    """
    if (p / "metrics.jsonl").is_file() or (p / "checkpoints").is_dir():
        if (p / "final").is_dir():
            return f"{p} is an opd run directory; its trained model is {p / 'final'}: {_pass(option, p / 'final')}"
        return (
            f"{p} is an opd run directory without a final model (the run did not finish); continue it with "
            f"--resume --out {p}, or pass a checkpoint's model, e.g. {p / 'checkpoints' / 'step_N' / 'model'}"
        )
    if (p / "state.pt").is_file() and (p / "model").is_dir():
        return f"{p} is an opd checkpoint; its model is {p / 'model'}: {_pass(option, p / 'model')}"
    if (p / "latest").is_file() and any(p.glob("step_*")):
        latest = p / (p / "latest").read_text().strip() / "model"
        return f"{p} holds opd checkpoints; the latest one's model is {latest}: {_pass(option, latest)}"
    if not wants_weights:  # a tokenizer directory needs no model beside it (an adapter directory holds one too)
        return None
    if not (p / "config.json").is_file() and (p / "adapter_config.json").is_file():
        return (
            f"{p} holds a LoRA adapter, not a whole model; write one with opd merge-lora {p} --out DIR "
            f"and {_pass(option, 'that DIR')}"
        )
    has_tokenizer = (p / "tokenizer_config.json").is_file() or (p / "tokenizer.json").is_file()
    if has_tokenizer and not (p / "config.json").is_file():
        return (
            f"{p} holds a tokenizer but no model (no config.json); pass the directory that holds the "
            f"model's config.json and weights as {option}"
        )
    if (p / "config.json").is_file() and not any(any(p.glob(w)) for w in _WEIGHTS):
        return (
            f"{p} has a config.json but no weights (*.safetensors or *.bin); save the model with "
            f"save_pretrained, or pass the directory that holds its weights as {option}"
        )
    return None


def load_tokenizer(
    path: str | Path, role: str = "student", option: str | None = None, revision: str = ""
) -> PreTrainedTokenizerBase:
    p = _check_model_dir(path, role, "tokenizer_config.json", option, revision)
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if tok.eos_token_id is None:
        raise UserError(f"the tokenizer in {p} has no EOS token; set eos_token in its tokenizer_config.json")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(
    path: str | Path,
    role: str = "student",
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    option: str | None = None,
    revision: str = "",
) -> PreTrainedModel:
    p = _check_model_dir(path, role, option=option, revision=revision)
    try:
        with quiet_transformers():
            # never remote code: its forward is unknown to opd's head, and unasked transformers would prompt
            model = AutoModelForCausalLM.from_pretrained(
                p, dtype=_DTYPES[dtype], local_files_only=True, trust_remote_code=False
            )
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise UserError(_remote_code_message(p, role)) from None
    # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method
    model = model.to(device)  # type: ignore[arg-type]
    check_finite_weights(model, p, role, dtype)  # on the device: one fast pass over the weights on a GPU
    check_head(model, p)  # after the finite check: NaN weights would fail the probe less clearly
    return model


def _remote_code_message(p: Path, role: str) -> str:
    try:
        arch = (json.loads((p / "config.json").read_text()).get("architectures") or ["its model class"])[0]
    except (OSError, ValueError):
        arch = "its model class"
    return (
        f"{role} model {p}: {arch} is remote code (config.json's auto_map), which opd does not run: opd computes "
        "log-probs from the model's head and can check only the families transformers ships; use one "
        "(docs/training.md, Model families)"
    )


def check_finite_weights(model: PreTrainedModel, where: str | Path, role: str, dtype: str) -> None:
    """Refuse a model with NaN or infinite weights: its log-probs are NaN, which the losses mask out
    as they do -inf, so a NaN teacher trained nothing while the run looked fine, and a NaN student
    stopped at its first step with advice about the learning rate."""
    bad = []
    for name, w in model.named_parameters():
        # min and max carry a NaN or inf through; isfinite(w) would allocate a bool tensor per weight
        if w.is_floating_point() and w.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(w))).all()):
            bad.append(name)
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        fix = "load it in bfloat16 or float32 (its values overflow float16), or " if dtype == "float16" else ""
        raise UserError(
            f"{role} model {where} has NaN or infinite weights ({bad[0]}{more}); {fix}pass a model saved before "
            "it diverged (an earlier checkpoint), or retrain it"
        )


def resolve_device(spec: str) -> torch.device:
    """``--device``: ``auto`` is this process's GPU when torch sees one (``LOCAL_RANK`` picks it
    under torchrun/accelerate), else the CPU; ``cuda`` is this process's GPU; ``cuda:N`` and
    ``cpu`` are taken as given."""
    check_device(spec)
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(
            f"--device {spec}: torch sees no CUDA GPU here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}); install a CUDA build of torch or use --device cpu"
        )
    if spec in ("auto", "cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():  # two ranks on one GPU would make nccl fail later, less clearly
            raise UserError(
                f"local rank {local} has no GPU of its own: this machine shows {torch.cuda.device_count()} "
                "GPU(s); launch at most that many processes per machine (--nproc_per_node)"
            )
        return torch.device("cuda", local)
    index = int(spec.split(":")[1])
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s) (cuda:0 ...)")
    return torch.device(spec)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's parameters live (the device its inputs must be on)."""
    return next(model.parameters()).device


PROBE_TOKENS = 8


@torch.no_grad()
def check_head(model: PreTrainedModel, where: str | Path = "model") -> Head:
    """Compare :func:`~opd.models.head.model_head` on a short probe with the model's own
    ``model(...).logits``; return the head, or raise a one-line UserError naming the class when opd's
    head does not reproduce them (a family whose forward does something else to its logits).

    The tolerance is relative to the largest logit: 1e-3 in float32 (matmul order, fused kernels),
    four units of the dtype's rounding in bfloat16/float16, where the model rounds its logits and
    opd computes them in float32. A missed bias, scale or cap is far larger.
    """
    head = model_head(model)
    dev = model_device(model)
    ids = (torch.arange(PROBE_TOKENS, device=dev) * 7919 + 3).remainder(head.vocab).unsqueeze(0)
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()  # dropout off: both passes must see one network
    try:
        theirs = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        ours = head.logits(final_hidden(model, ids, mask)).float()
    finally:
        model.train(was_training)
    # Where the model's own forward overflows (NaN or inf logits) there is nothing to compare: that is
    # no head mismatch, and the teacher's scoring names it better (its NaN log-probs) when it matters.
    finite = torch.isfinite(theirs)
    if not bool(finite.any()):
        return head
    dtype = head.weight_VD.dtype
    rtol = 1e-3 if dtype in (torch.float32, torch.float64) else 4 * torch.finfo(dtype).eps
    err = float((ours - theirs)[finite].abs().max())
    bound = rtol * (1.0 + float(theirs[finite].abs().max()))
    if not err <= bound:  # NaN fails too
        raise UserError(
            f"{where}: {type(model).__name__}'s logits differ from opd's head ({describe(head)}) by up to "
            f"{err:.3g} on a probe (tolerance {bound:.3g}): its forward changes the logits in a way opd does not "
            "reproduce; opd needs logits = softcap(scale * (hidden @ W.T + bias)) from lm_head and the config's "
            f"{MULTIPLY}, {DIVIDE} or {SOFTCAP}: use a family docs/training.md lists (Model families)"
        )
    return head


def check_same_vocab(
    student_tok: PreTrainedTokenizerBase,
    teacher_tok: PreTrainedTokenizerBase,
    student: PreTrainedModel,
    teacher: PreTrainedModel,
) -> None:
    """Student and teacher must share one vocabulary: the teacher scores the student's token ids."""
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s_vocab != t_vocab:
        only_s = len(set(s_vocab) - set(t_vocab))
        only_t = len(set(t_vocab) - set(s_vocab))
        moved = sum(1 for tok, i in s_vocab.items() if tok in t_vocab and t_vocab[tok] != i)
        raise UserError(
            f"student and teacher tokenizers differ ({len(s_vocab)} vs {len(t_vocab)} tokens; {only_s} only in the "
            f"student, {only_t} only in the teacher, {moved} with different ids) and --cross-tokenizer is off: pick a "
            "teacher from the student's model family, or train with --cross-tokenizer auto (cross-tokenizer OPD)"
        )
    s_rows = head_weight(student).shape[0]
    t_rows = head_weight(teacher).shape[0]
    if s_rows != t_rows:
        raise UserError(
            f"student and teacher output layers have {s_rows} and {t_rows} rows for the same tokenizer; "
            "resize one model's embeddings (model.resize_token_embeddings) so both match"
        )


def head_weight(model: PreTrainedModel) -> torch.Tensor:
    """The output embedding (V, D): tied models share it with the input embedding."""
    return model.get_output_embeddings().weight


def final_hidden(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Hidden states after the final norm, i.e. what the LM head multiplies (B, L, D)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    decoder = model.get_decoder()
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def checkpoint_layers(model: PreTrainedModel) -> None:
    """Activation checkpointing per decoder layer (``--gradient-checkpointing``): transformers' own, whose
    layers recompute their forward in the backward whenever the model trains, however it is called (the
    LSM path calls the decoder, not the model). Non-reentrant: it needs no input that requires grad (LoRA's
    frozen embeddings), and keeps the autocast of mixed precision in the recomputation."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(
            f"--gradient-checkpointing: {type(model).__name__} does not support gradient checkpointing in "
            "transformers; drop the flag (or lower --max-new-tokens / use --micro-batch-tokens to fit)"
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def tiny_qwen2(
    vocab_size: int, layers: int, width: int, *, eos_id: int, pad_id: int, max_len: int = 512
) -> PreTrainedModel:
    """A small Qwen2 causal LM built from a config (the embedded default's teacher and student)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(2, width // 64)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=width * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(cfg)


def parse_arch(arch: str) -> tuple[int, int]:
    """``qwen2:LAYERS:WIDTH`` -> (layers, width)."""
    parts = arch.split(":")
    if len(parts) != 3 or parts[0] != "qwen2" or not parts[1].isdigit() or not parts[2].isdigit():
        raise UserError(f"--arch {arch!r} is not of the form qwen2:LAYERS:WIDTH (e.g. qwen2:4:256)")
    layers, width = int(parts[1]), int(parts[2])
    if width % 32 or layers < 1:
        raise UserError(f"--arch {arch!r}: width must be a multiple of 32 and layers >= 1")
    return layers, width


# Attributes through which transformers' attention implementations read a dropout probability at
# call time (``dropout=0.0 if not self.training else self.attention_dropout``): no nn.Dropout
# module exists for them, so they are set on the modules that hold them.
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout_p")


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn off every dropout of ``model`` while it stays in train mode; returns how many were on.

    On-policy training compares the student's log-probs across the rollout, the loss and the
    diagnostics; with dropout on, each of those sees a different random network. RL and
    distillation trainers (TRL's ``disable_dropout``, verl) turn it off for the same reason.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p, changed = 0.0, changed + 1
        for name in _DROPOUT_ATTRIBUTES:
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                changed += 1
    return changed
