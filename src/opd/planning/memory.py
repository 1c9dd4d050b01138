"""The memory of an ``opd train`` run on each GPU, from its options and the models' shapes alone.

Each part is arithmetic on the shapes (:mod:`opd.planning.shapes`) and says how it was computed. A part
lives in phases of a step: ``run`` (held the whole run: weights, AdamW state, the teacher, an engine's
share, the staleness worker), ``rollout``, ``score``, ``update``, ``optimizer``, ``log`` and ``eval``;
the plan's peak is the run's parts plus the largest phase. ``update`` and ``optimizer`` are the two ends
of the update stage: its forward and backward, whose peak is where the backward starts (every activation
alive), and the backward's end, the clipping and AdamW's step (every gradient alive, no activation).
Where opd does something, the part follows it:

* a trained student keeps float32 masters, gradients and AdamW's two moments (``models/precision.py``,
  ``training/optim.py``); with ``--lora-r`` the frozen base stays in ``--dtype`` and only the float32
  adapter has gradients and moments; ``--fsdp`` shards all of them over the ranks (``training/distributed.py``)
  and gathers one block at a time in ``--dtype`` (the root, embeddings and head, stays gathered through a
  forward and backward); DDP's gradients are its buckets (``gradient_as_bucket_view``), so no copy;
* gradients are set to None as each update starts (``training/loop.py``), so they are held from one backward's
  end through the logs, the evaluation and the next step's rollout and scoring; the backward that starts
  the next update has only the head's gradient yet (a V x d buffer that becomes it), unless gradients
  outlive ``set_to_none``: DDP's buckets, or an earlier micro-batch's backward of the same update;
* AdamW's step (``training/optim.py``: torch's default implementation) makes temporaries: on a GPU its
  foreach path takes the square root of every second moment at once (the trained parameters' size in
  float32); on a CPU it goes a tensor at a time, two of the largest tensor's size (the square root and
  the quotient);
* the in-process teacher is whole on every rank, or sharded like the student under ``--fsdp``; a served
  teacher (``--teacher-url``) costs the trainer's GPU nothing; the in-process teacher's top-K casts a
  low-precision head to float32 ``VOCAB_BLOCK`` rows at a time (``losses/head.py``: never a whole copy), and
  its float32 logits at the ``--diag-positions`` are kept from the scoring to the step's logs;
* activations per decoder layer and token, as transformers' Qwen2/Llama and Qwen3 layers keep them for the
  backward (counted with ``torch.autograd.graph.saved_tensors_hooks``, tests/planning): float32
  ``4 (7d + 4q + 4f + S)`` bytes; bfloat16 autocast ``4 (5d) + 2 (5d + 4q + 4f + S)`` and bfloat16 copies of
  the layer's weights; Qwen3's query/key norms add ``4 (2q + 2kv)`` (float32) or ``6 (q + kv)``; and a few
  float32 scalars per token (the norms' 1/rms, attention's logsumexp per head). d: hidden
  size, q: heads x head size (keys and values are repeated to it for a padded batch), f: the MLP's width,
  S: the sequence length (sdpa keeps the padded batch's float mask, S per token, in every layer).
  With ``--gradient-checkpointing`` a layer keeps only its input (d float32 per token) and one layer is
  recomputed at a time. The backward frees each layer's tensors as it passes it; what it adds at its peak
  is the gradients in flight through one layer's MLP (three f-wide, two d-wide per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opd.config import TrainConfig
from opd.losses.head import VOCAB_BLOCK
from opd.models.precision import trained_weights_dtype
from opd.planning.shapes import ModelShape
from opd.rollout.vllm_server import SHARED_GPU_MEMORY, option_value, place_engine

GiB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PHASES = ("rollout", "score", "update", "optimizer", "log", "eval")
STEP_DATA = ("score", "update", "optimizer", "log")  # a step's scores and records, freed after its logs
# the phases of each stage of a step (the *_stage functions of opd.training.producer and opd.training.loop): a stage's peak is its largest
STAGES = {
    "rollout": ("rollout",),
    "score": ("score",),
    "update": ("update", "optimizer"),
    "log": ("log",),
    "eval": ("eval",),
}
ROWS_PER_CHUNK = 8  # rows per forward without gradients (opd.rollout.forward's chunks)
LOSS_CHUNK = 128  # positions per chunk of the from-hidden losses (opd.losses' default chunk_size)
SCORE_CHUNK = 128  # positions per chunk of the teacher's top-K from hidden states
# Bytes per (row, vocabulary entry) of one decode step's sampling: float32 logits and probabilities, a full
# sort's values and int64 ids, two cumulative sums, the log-softmax (opd.rollout.sampling, top-p's fallback).
SAMPLER_BYTES = 32
# Per (position, K slot) of LSM from hidden states: the K logits, p, q, log p, log q and the loss terms in
# float32 (24), and what the backward keeps: dKL/dz (4), the ids (int64, 8), the teacher's log-probs (4), the
# support mask (1).
LSM_SLOT_BYTES = 41
# Share of the GPU's memory kept free, and a fixed reserve: the CUDA context and NCCL's buffers (about 1 GiB
# with the kernels loaded), the caching allocator's fragmentation (a few percent at a long run's peak) and
# the temporaries of single operations that no part counts (a matmul's output before it is kept).
HEADROOM_SHARE, HEADROOM_FIXED = 0.10, 1 * GiB


@dataclass(frozen=True)
class Layout:
    """Where the run goes: ``world`` ranks, one per GPU, ``gpus_per_node`` GPUs a machine (0: up to 8),
    each GPU of ``gpu_bytes`` (None: not given). ``device`` ``cpu``: the CPU-equivalent plan (what a
    process holds, without the headroom)."""

    world: int = 1
    gpus_per_node: int = 0
    gpu_bytes: int | None = None
    device: str = "cuda"

    @property
    def node_gpus(self) -> int:
        return self.gpus_per_node or min(self.world, 8)

    @property
    def node_ranks(self) -> int:
        return min(self.world, self.node_gpus)


@dataclass(frozen=True)
class Part:
    name: str
    phases: tuple[str, ...]  # ("run",) or the step's phases it lives in
    bytes: int
    how: str


@dataclass
class Plan:
    parts: list[Part]
    layout: Layout
    notes: list[str] = field(default_factory=list)

    def held(self, phase: str) -> int:
        """Bytes held during ``phase``: the run's parts and the phase's own."""
        return sum(p.bytes for p in self.parts if "run" in p.phases or phase in p.phases)

    def stage_peak(self, stage: str) -> int:
        """Bytes held at the peak of a step's stage (:data:`STAGES`): its largest phase."""
        return max(self.held(phase) for phase in STAGES[stage])

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.held)

    @property
    def peak(self) -> int:
        return self.held(self.peak_phase)

    @property
    def usable(self) -> int | None:
        """What a part may take of the GPU: its memory less the headroom (None: no memory given)."""
        g = self.layout.gpu_bytes
        if g is None:
            return None
        return g if self.layout.device == "cpu" else int(g * (1 - HEADROOM_SHARE) - HEADROOM_FIXED)

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.peak <= self.usable


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def layer_activation_bytes(m: ModelShape, seq: int, dtype: str) -> int:
    """Bytes one decoder layer keeps for the backward per token of a sequence of ``seq`` (module docstring)."""
    d, q, kv, f, h = m.hidden, m.q_width, m.kv_width, m.intermediate, m.heads
    scalars = 4 * (2 + h) + (4 * (h + m.kv_heads) if m.qk_norm else 0)  # the norms' 1/rms, attention's logsumexp
    if dtype == "float32":
        return 4 * (7 * d + 4 * q + 4 * f + seq) + (4 * (2 * q + 2 * kv) if m.qk_norm else 0) + scalars
    return 4 * 5 * d + 2 * (5 * d + 4 * q + 4 * f + seq) + (6 * (q + kv) if m.qk_norm else 0) + scalars


def micro_batch(cfg: TrainConfig) -> tuple[int, int]:
    """(rows, padded sequence length) of the largest micro-batch, at the longest prompt and response."""
    rows, seq = (
        cfg.optimizer.batch_size * cfg.rollout.samples_per_prompt,
        cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
    )
    if cfg.optimizer.micro_batch_tokens:
        return max(1, min(rows, cfg.optimizer.micro_batch_tokens // seq)), seq
    return rows // cfg.optimizer.grad_accum, seq


def micro_batches(cfg: TrainConfig) -> int:
    """How many micro-batches an update takes, every row at the longest prompt and response."""
    return -(-cfg.optimizer.batch_size * cfg.rollout.samples_per_prompt // micro_batch(cfg)[0])


def plan_memory(cfg: TrainConfig, student: ModelShape, teacher: ModelShape | None, layout: Layout) -> Plan:
    """Every part of ``cfg``'s run on one GPU of ``layout`` (``teacher`` None: served)."""
    plan = Plan([], layout)
    plan.parts += _student(cfg, student, layout)
    plan.parts += _teacher(cfg, teacher, layout)
    plan.parts += _engine(cfg, student, layout, plan.notes)
    plan.parts += _update(cfg, student, layout)
    plan.parts += _logging(cfg, student, teacher)
    if cfg.multitask.tasks:
        plan.notes.append("a multi-task run is planned at its top-level options; each task's own are not read")
    return plan


def _student(cfg: TrainConfig, m: ModelShape, layout: Layout) -> list[Part]:
    shard = layout.world if cfg.run.fsdp else 1
    by = f" / {shard} ranks (FSDP)" if shard > 1 else ""
    if cfg.lora.lora_r:
        trained = m.lora_params(cfg.lora.lora_r, cfg.lora.lora_targets)
        base = BYTES[trained_weights_dtype(cfg.model.dtype, True)]
        weights = Part(
            "student weights",
            ("run",),
            (m.params * base + trained * 4) // shard,
            f"{m.params:,} frozen x {base} B + LoRA {trained:,} x 4 B{by}",
        )
        what = f"LoRA {trained:,}"
    else:
        trained = m.params
        weights = Part("student weights", ("run",), m.params * 4 // shard, f"{m.params:,} x 4 B (float32 masters){by}")
        what = f"{m.params:,}"
    parts = [
        weights,
        _gradients(cfg, trained * 4 // shard, f"{what} x 4 B{by}", layout),
        Part("AdamW state", ("run",), 2 * trained * 4 // shard, f"2 moments x {what} x 4 B{by}"),
        _adamw_temporaries(cfg, m, layout),
    ]
    if layout.world > 1 and not cfg.run.fsdp:
        parts.append(
            Part("DDP bucket copy", ("run",), 0, "none: gradient_as_bucket_view (the gradients are the buckets)")
        )
    if cfg.rollout.max_staleness:
        wb = BYTES[trained_weights_dtype(cfg.model.dtype, bool(cfg.lora.lora_r))]
        parts.append(
            Part(
                "staleness worker's student",
                ("run",),
                m.params * wb,
                f"--max-staleness {cfg.rollout.max_staleness}: the worker process's whole copy, {m.params:,} x {wb} B "
                "(the weights sent with each request wait in host memory)",
            )
        )
    return parts


def _gradients(cfg: TrainConfig, size: int, how: str, layout: Layout) -> Part:
    """The gradients, absent where the update's first backward starts unless something keeps them."""
    ddp = layout.world > 1 and not cfg.run.fsdp
    kept = "DDP's buckets" if ddp else "the update's earlier micro-batches" if micro_batches(cfg) > 1 else ""
    if kept:
        return Part("gradients", ("run",), size, f"{how}; kept by {kept} where the backward starts")
    later = tuple(p for p in PHASES if p != "update")
    return Part("gradients", later, size, f"{how}; from the backward's end to the next update's start")


def _adamw_temporaries(cfg: TrainConfig, m: ModelShape, layout: Layout) -> Part:
    """What AdamW's step allocates beside its state (the module docstring)."""
    shard = layout.world if cfg.run.fsdp else 1
    if layout.device != "cpu":
        trained = m.lora_params(cfg.lora.lora_r, cfg.lora.lora_targets) if cfg.lora.lora_r else m.params
        return Part("AdamW's temporaries", ("optimizer",), trained * 4 // shard, "foreach: every second moment's sqrt")
    if cfg.lora.lora_r:
        largest = cfg.lora.lora_r * max((max(io) for io in m.lora_layers(cfg.lora.lora_targets)), default=0)
    else:
        largest = m.hidden * max(m.vocab, m.intermediate, m.q_width)
    return Part(
        "AdamW's temporaries", ("optimizer",), 2 * largest * 4 // shard, "a tensor at a time: 2 x the largest x 4 B"
    )


def _teacher(cfg: TrainConfig, t: ModelShape | None, layout: Layout) -> list[Part]:
    if t is None:
        return [Part("teacher", ("run",), 0, "served (--teacher-url): on GPUs of its own")]
    tb = BYTES[cfg.teacher.teacher_dtype or cfg.model.dtype]
    rows, T = cfg.optimizer.batch_size * cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens
    parts = []
    if cfg.run.fsdp and layout.world > 1:
        parts.append(
            Part("teacher", ("run",), t.params * tb // layout.world, f"{t.params:,} x {tb} B / {layout.world} (FSDP)")
        )
        parts.append(Part("teacher's gathered block", ("score",), 2 * t.layer_params * tb, "2 blocks (one prefetched)"))
    else:
        parts.append(Part("teacher", ("run",), t.params * tb, f"{t.params:,} x {tb} B, whole on every rank"))
    chunk, seq = min(rows, ROWS_PER_CHUNK), cfg.data.max_prompt_tokens + T
    parts += [
        Part(
            "teacher's forward",
            ("score",),
            chunk * seq * (3 * t.intermediate + seq) * tb,
            f"{chunk} rows x {seq} tokens x (3 MLP tensors of {t.intermediate} + the mask's {seq}) x {tb} B",
        ),
        Part(
            "teacher's hidden states",
            ("score",),
            2 * rows * T * t.hidden * tb,
            f"{rows} rows x {T} positions x {t.hidden} x {tb} B, twice (chunks and their concatenation)",
        ),
        Part(
            "teacher's top-K chunks",
            ("score",),
            2 * SCORE_CHUNK * t.vocab * 4 + (VOCAB_BLOCK * t.hidden * 4 if tb != 4 else 0),
            f"2 x {SCORE_CHUNK} positions x {t.vocab:,} x 4 B"
            + (f" + the head cast {VOCAB_BLOCK:,} rows at a time, x {t.hidden} x 4 B" if tb != 4 else ""),
        ),
    ]
    if cfg.run.diag_positions:
        # made with the scores (opd.teachers.scoring) and read by the step's logs
        parts.append(
            Part(
                "teacher's logits at the diagnostic positions",
                STEP_DATA,
                cfg.run.diag_positions * t.vocab * 4,
                f"--diag-positions {cfg.run.diag_positions} x {t.vocab:,} x 4 B",
            )
        )
    return parts


def _engine(cfg: TrainConfig, m: ModelShape, layout: Layout, notes: list[str]) -> list[Part]:
    rows, seq = (
        cfg.optimizer.batch_size * cfg.rollout.samples_per_prompt,
        cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
    )
    cb = BYTES[cfg.model.dtype]
    if cfg.rollout.rollout_engine == "vllm":
        if cfg.rollout.vllm_url:
            return [Part("vLLM engine", ("run",), 0, "a server of your own (--vllm-url)")]
        args = cfg.rollout.vllm_argv
        # engine 0 beside trainer 0: on GPU 0 unless the machine has GPUs to spare (opd.rollout.vllm_server)
        place = place_engine(0, layout.node_ranks, layout.node_gpus, trainer_on_gpu=True, vllm_args=args)
        if "0" not in place.devices:
            return [Part("vLLM engine", ("run",), 0, f"on GPU(s) {','.join(place.devices)} of its own")]
        util = float(option_value(args, "--gpu-memory-utilization") or SHARED_GPU_MEMORY)
        if layout.gpu_bytes is None:
            notes.append(f"the vLLM engine takes {util:.2f} of the GPU's memory: give --gpu-memory to count it")
        share = int(util * (layout.gpu_bytes or 0))
        kv = 2 * m.layers * m.kv_width * rows * seq * cb
        if share and share - m.params * cb < kv:
            notes.append(
                f"the engine's share leaves {gib(share - m.params * cb)} beside the student's weights, and a "
                f"step's {rows} rollouts of {seq} tokens need {gib(kv)} of KV cache: vLLM then runs them in turns"
            )
        return [Part("vLLM engine's share", ("run",), share, f"--gpu-memory-utilization {util} of the GPU (KV inside)")]
    kv = 2 * m.layers * m.kv_width * rows * seq * cb
    sampler = rows * m.vocab * SAMPLER_BYTES
    phase = ("run",) if cfg.rollout.max_staleness else ("rollout",)
    who = "the worker's, beside the update" if cfg.rollout.max_staleness else "opd's loop"
    parts = [
        Part("KV cache", phase, kv, f"{who}: 2 x {m.layers} layers x {m.kv_width} x {rows} rows x {seq} x {cb} B"),
        Part("sampler's vocabulary rows", phase, sampler, f"{rows} rows x {m.vocab:,} x {SAMPLER_BYTES} B"),
    ]
    if cfg.run.fsdp and layout.world > 1:
        parts.append(Part("student gathered for generation", ("rollout",), m.params * cb, f"{m.params:,} x {cb} B"))
    if cfg.eval.eval:
        eval_kv = 2 * m.layers * m.kv_width * cfg.eval.eval_batch_tokens * cb
        parts.append(
            Part(
                "evaluation's KV cache",
                ("eval",),
                eval_kv,
                f"--eval-batch-tokens {cfg.eval.eval_batch_tokens:,} tokens",
            )
        )
    return parts


def _update(cfg: TrainConfig, m: ModelShape, layout: Layout) -> list[Part]:
    rows_mb, seq = micro_batch(cfg)
    tokens = rows_mb * seq
    per_layer = layer_activation_bytes(m, seq, cfg.model.dtype)
    mixed = cfg.model.dtype != "float32" and not cfg.lora.lora_r  # a LoRA base is already in --dtype: no cast copies
    body = m.layers * m.layer_params
    if cfg.optimizer.gradient_checkpointing:
        acts = tokens * (m.layers * m.hidden * 4 + per_layer) + tokens * seq * 4
        how = (
            f"{rows_mb} rows x {seq} tokens x ({m.layers} layers x {m.hidden} x 4 B kept + one layer recomputed, "
            f"{per_layer:,} B) + the mask"
        )
        casts = m.layer_params * 2 if mixed else 0
    else:
        acts = tokens * m.layers * per_layer
        how = f"{rows_mb} rows x {seq} tokens x {m.layers} layers x {per_layer:,} B"
        casts = body * 2 if mixed else 0
    T, cb = cfg.rollout.max_new_tokens, BYTES[cfg.model.dtype]
    rows = cfg.optimizer.batch_size * cfg.rollout.samples_per_prompt
    parts = [
        Part("activations", ("update",), acts, how),
        Part(
            "backward's working set",
            ("update",),
            tokens * (3 * m.intermediate * cb + 2 * m.hidden * 4),
            f"gradients in flight through one layer's MLP: {rows_mb} x {seq} x (3 x {m.intermediate} x {cb} B "
            f"+ 2 x {m.hidden} x 4 B)",
        ),
        Part("final hidden states", ("update",), 3 * tokens * m.hidden * 4, "the norm's output, its gradient, a copy"),
        _loss(cfg, m, rows_mb * T),
        Part(
            "hidden states kept for the step's logs",
            STEP_DATA[1:],
            rows * T * m.hidden * 4,
            f"{rows} x {T} x d x 4 B",
        ),
    ]
    if casts:
        parts.append(Part("bfloat16 weight copies", ("update",), casts, "autocast's casts, kept for the backward"))
    if not cfg.lora.lora_r:
        parts.append(
            Part(
                "head gradient buffer",
                ("update",),
                m.vocab * m.hidden * 4,
                f"{m.vocab:,} x {m.hidden} x 4 B, made as the backward starts (the head's gradient, or added to it)",
            )
        )
    if cfg.run.fsdp and layout.world > 1:
        cb = BYTES[cfg.model.dtype]
        root = (m.params - body) * 4
        parts.append(
            Part("FSDP gathered blocks and root", ("update",), 2 * m.layer_params * (cb + 4) + root, "2 blocks, root")
        )
    return parts


def _loss(cfg: TrainConfig, m: ModelShape, positions: int) -> Part:
    """The loss's own buffers for one micro-batch of ``positions`` response positions."""
    k_wide = positions * cfg.objective.k * LSM_SLOT_BYTES + LOSS_CHUNK * cfg.objective.k * m.hidden * 4
    if cfg.objective.objective == "lsm" and not cfg.objective.tail:
        how = f"{positions:,} positions x K {cfg.objective.k} x {LSM_SLOT_BYTES} B + a {LOSS_CHUNK} x K x d chunk (K-wide, not V)"
        return Part("loss buffers", ("update",), k_wide, how)
    v_wide = 2 * LOSS_CHUNK * m.vocab * 4
    return Part("loss buffers", ("update",), k_wide + v_wide, f"K-wide + 2 chunks of {LOSS_CHUNK} x {m.vocab:,} x 4 B")


def _logging(cfg: TrainConfig, m: ModelShape, t: ModelShape | None) -> list[Part]:
    rows, T = cfg.optimizer.batch_size * cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens
    scores = rows * T * (cfg.objective.k * 12 + 4)
    vocab = max(m.vocab, t.vocab if t else 0)
    return [
        Part("teacher's top-K for the step", STEP_DATA, scores, f"{rows} x {T} x (K x 12 + 4) B"),
        Part(
            "diagnostics",
            ("log",),
            cfg.run.diag_positions * vocab * 4 * 4,
            f"{cfg.run.diag_positions} positions x {vocab:,} x 4 B x 4",
        ),
    ]
