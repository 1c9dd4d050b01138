"""Narrow models at a real vocabulary: the shapes that break memory (vocabulary x length), on a CPU.

A real reasoning model's head is what makes a step's memory grow: Qwen3's 151,936-token vocabulary times
thousands of response positions. A narrow body (2 layers, 64 wide) carries both shapes at a few
megabytes of weights, so a CPU shows which stage holds a (rows x length x vocabulary) tensor.

The tokenizer is the demo's byte-level BPE (2,048 ids) padded with plain vocabulary entries up to the
size asked for: ``xpad<i>`` strings that no merge builds, so encoding never produces them, while
decoding one gives its text (a randomly initialised model samples them). Training a BPE of 151,936 real
tokens would need a large corpus; the padded entries make the head and every tensor over the
vocabulary the real size, which is what is measured.

Usage (benchmarks/real_shape.py and the guard test)::

    student, teacher = narrow_pair(root, vocab_size=151_936)
    batch = sample(student, tokenizer, rows=4, max_new_tokens=1024)
    for options in OBJECTIVES.values():
        loss_and_backward(student, teacher, batch, teacher.score(batch, k), options, k)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

QWEN3_VOCAB = 151_936
PAD_ENTRY = "xpad{}"  # ASCII: its own byte-level form, so it decodes to itself
# Each objective's loss and backward as the trainer runs it (every lsm variant goes from the student's
# hidden states: the trainer has no path that forms the logits first): TrainConfig fields over the defaults.
OBJECTIVES: dict[str, dict] = {
    "loss lsm": dict(objective="lsm"),
    "loss lsm --tail": dict(objective="lsm", tail=True),
    "loss lsm --forward-kl-share 0.5": dict(objective="lsm", forward_kl_share=0.5),
    "loss lsm --no-renormalize": dict(objective="lsm", renormalize=False),
    "loss full_kl": dict(objective="full_kl"),
    "loss sampled": dict(objective="sampled"),
}


def padded_tokenizer(out: Path, vocab_size: int) -> Path:
    """The demo tokenizer with its vocabulary padded to ``vocab_size`` ids, saved in ``out``."""
    demo = Path(str(resources.files("opd") / "assets" / "demo" / "tokenizer"))
    out.mkdir(parents=True, exist_ok=True)
    for f in demo.iterdir():
        shutil.copy(f, out / f.name)
    spec = json.loads((demo / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    # Added tokens (<think>, </think>) take ids past the BPE's own; tokenizers renumbers an added token
    # that is not in the model's vocabulary to len(vocabulary) + i on reload, so they join it at their ids.
    vocab.update({a["content"]: a["id"] for a in spec["added_tokens"]})
    start = max(vocab.values()) + 1
    if vocab_size < start:
        raise ValueError(f"vocab_size={vocab_size} is below the demo tokenizer's {start} ids")
    vocab.update({PAD_ENTRY.format(i): i for i in range(start, vocab_size)})
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return out


def narrow_qwen3(tok_dir: Path, out: Path, *, layers: int, width: int, seed: int, max_len: int) -> Path:
    """A random Qwen3 causal LM (``layers`` x ``width``, tied head) over ``tok_dir``'s vocabulary, saved
    with the tokenizer in ``out``."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    heads = max(2, width // 32)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=width,
        intermediate_size=width * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=width // heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def narrow_pair(
    root: Path, vocab_size: int = QWEN3_VOCAB, *, layers: int = 2, width: int = 64, max_len: int = 16_384
) -> tuple[Path, Path]:
    """(student, teacher) directories under ``root``: narrow Qwen3 models over the padded tokenizer, the
    teacher twice as wide (built once per ``root``)."""
    student, teacher = root / "student", root / "teacher"
    if not (teacher / "config.json").exists():
        tok = padded_tokenizer(root / "tokenizer", vocab_size)
        narrow_qwen3(tok, student, layers=layers, width=width, seed=1, max_len=max_len)
        narrow_qwen3(tok, teacher, layers=layers, width=2 * width, seed=2, max_len=max_len)
    return student, teacher


def rollout_engine(student, tok, static_cache: str = "on"):
    """opd's own rollout loop on ``student`` (``static_cache``: on, off)."""
    from opd.rollout.sampling import HFRollout

    return HFRollout(student, tok.eos_token_id, tok.pad_token_id, static_cache=static_cache)


def prompts(tok, rows: int) -> list[list[int]]:
    """``rows`` arithmetic questions in the chat template, as token ids."""
    from opd.models.tokenizer import format_prompt

    return [
        tok(format_prompt(tok, [{"role": "user", "content": f"What is {i} + 7?"}]))["input_ids"] for i in range(rows)
    ]


def cross_tokenizer_teacher(teacher_model, tok):
    """The in-process teacher behind opd's cross-tokenizer wrapper with the student's own tokenizer
    (``--cross-tokenizer on``): a second tokenizer of 151,936 real entries needs a large corpus, and the
    padded entries, which no merge builds, would re-tokenize to one token per character. With one vocabulary
    the wrapper keeps the sampled ids (no re-tokenization) and runs the rest at the real sizes: the prompt in
    the teacher's template, the vocabulary map over V, the byte alignment, the top-K moved into the
    student's frame and the span reward."""
    from opd.models.loading import head_weight
    from opd.teachers.crosstok import CrossTokenizerTeacher
    from opd.teachers.scoring import HFTeacher

    rows, context = head_weight(teacher_model).shape[0], teacher_model.config.max_position_embeddings
    return CrossTokenizerTeacher(HFTeacher(teacher_model), tok, tok, teacher_rows=rows, teacher_context=context)


def loss_and_backward(student, teacher, batch, scores, options: dict, k: int) -> None:
    """One objective's loss on ``batch`` and its backward into ``student``, as the trainer computes it
    (token-mean reduction); ``options``: TrainConfig fields, an entry of :data:`OBJECTIVES`."""

    from opd.config import TrainConfig
    from opd.training.loss import LossTotals, objective_loss, reduce_loss

    N, T = batch.response_ids_NT.shape
    cfg = TrainConfig.from_flat(k=k, batch_size=N, max_new_tokens=T, **options)
    mask = batch.action_mask_NT
    loss_NT, _ = objective_loss(cfg, student, teacher, batch, scores, mask)
    reduce_loss("token_mean", loss_NT, mask, LossTotals(int(mask.sum()), N, N, T)).backward()


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op allocates while active, per ``stage`` (set it as stages change):
    its element count, the op and the shape. Views of an input (a transpose, a slice) allocate nothing and
    are not counted. Runs every op through Python: for tests and measurements, not for training."""

    def __init__(self) -> None:
        super().__init__()
        self.stage = "setup"
        self.largest: dict[str, tuple[int, str, tuple[int, ...]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if _tensor(a)}
        for x in tree_flatten(out)[0]:
            if _tensor(x) and x.numel() > self.largest.get(self.stage, (0,))[0]:
                if x.untyped_storage().data_ptr() not in inputs:
                    self.largest[self.stage] = (x.numel(), str(func), tuple(x.shape))
        return out


def _tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


@contextmanager
def stages(modules, names: list[str], enter: Callable[[str], None], leave: Callable[[str], None]) -> Iterator[None]:
    """The functions ``names`` of ``modules`` (a module, or several: each name is the first's that has it)
    wrapped so that ``enter(name)`` and ``leave(name)`` run around each call (a stage of opd's step: the
    ``*_stage`` functions of :mod:`opd.training.producer` and :mod:`opd.training.loop`); put back on exit."""
    found = modules if isinstance(modules, (list, tuple)) else (modules,)
    where = {n: next((m for m in found if hasattr(m, n)), None) for n in names}
    missing = [n for n, m in where.items() if m is None]
    if missing:
        raise KeyError(f"no stage {', '.join(missing)} in {', '.join(m.__name__ for m in found)}")
    real = {n: getattr(where[n], n) for n in names}

    def wrapped(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                leave(name)

        return call

    try:
        for n, fn in real.items():
            setattr(where[n], n, wrapped(n, fn))
        yield
    finally:
        for n, fn in real.items():
            setattr(where[n], n, fn)
