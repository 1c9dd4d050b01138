"""A static KV cache for opd's HF engine (``--static-cache``): the decode step at fixed shapes, captured as a
CUDA graph on a GPU, the samples those of the dynamic cache.

opd's sampling loop (:mod:`opd.rollout.sampling`) feeds one token per row per step through the whole model.
With the dynamic cache every step grows every layer's keys and values by concatenation and launches each
of the model's kernels from Python: at a 0.5B shape on an H100 a step took 26-35 ms, bound by kernel
launches, not by the GPU (issue 65). Here the cache is preallocated for a batch and a budget, the decode
step's inputs live in fixed buffers, and on CUDA that step is captured once as a CUDA graph and replayed:
the model's forward is one launch a step (the sampler stays eager). The weights change in place between steps (the optimizer's update, a staleness
worker's ``load_state_dict``), which a replay reads; only new weight tensors (a moved or reloaded model)
make it capture again.

Layout: each row has its own slots. The k-th real token of a row (prompt or response) sits in slot k, and
slot k is also its position, so a row holds exactly its own tokens: a prompt's left padding, a finished
row's steps and an episode's turns spent waiting write nothing there. Everything a row does not write goes
to the last slot (the trash slot), which no real token ever attends to. Prompts of up to P tokens with a
budget of B new tokens need P + B + 1 slots, whatever the rows do; multi-turn sessions would not fit a cache
whose rows share one write column (transformers' ``StaticCache``: every row writes the same position each
step, so an episode's waiting turns would take columns, and its rows cannot be dropped), which is why
opd keeps this one.

What stays as it was: the sampler (top-p, the per-prompt seeded uniforms, the unmodified log-probs) runs
on the logits this gives, outside the graph. The attention reads a longer, masked key range than the
dynamic cache's, so float32 sums are taken in another order: on the CPU, log-probs agree to a few 1e-6 and
the tokens are the same (tests/rollout/test_static_cache.py); bfloat16 rounds differently whichever cache.

Only plain full-attention decoders with PyTorch's SDPA attention take it (the mask it builds is SDPA's);
any other model keeps the dynamic cache, said once (:func:`static_support`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from opd.config import STATIC_CACHE
from opd.errors import UserError
from opd.models.loading import model_device

# Slots are allocated in multiples of this: consecutive steps whose longest prompt differs by a few tokens
# reuse one cache and its captured graph instead of allocating and capturing again.
SLOT_ROUND = 64
# Static decoders an engine keeps between rollouts (each holds its cache and graph): the training batch's,
# and one other shape (an episode batch, a last smaller batch) without capturing again for each.
KEEP = 2
# Share of the free device memory the cache may take: the prefill's activations and the graph's own
# buffers need the rest.
ROOM_SHARE = 0.9
# Eager runs of the decode step before its capture (on a side stream, as CUDA graphs require): they
# settle lazily made state (cuBLAS workspaces, autocast) outside the graph.
WARMUP = 2
# A replayed graph's logits against the eager step's, relative to the largest logit: kernels may round
# otherwise from one run to the next; a stale buffer or weight is off by whole logits.
VERIFY_TOL = 1e-3


class CacheTooBig(Exception):
    """The static cache for this batch does not fit the device's free memory."""

    def __init__(self, rows: int, slots: int, need: int, free: int, device: torch.device):
        self.rows, self.slots, self.need, self.free, self.device = rows, slots, need, free, device
        super().__init__(
            f"the static KV cache for {rows} rows of {slots} positions needs {_size(need)} and {device} has "
            f"{_size(free)} free"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def static_support(model: Any) -> str | None:
    """Why ``model`` cannot decode with the static cache (None: it can). It needs a decoder whose every
    layer caches plain keys and values (no sliding windows, no recurrent state) and SDPA attention."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "it is not a decoder-only Hugging Face model"
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        return f"its attention implementation is {impl!r}, and the static cache builds masks for 'sdpa'"
    try:
        layers = DynamicCache(config=config).layers
    except Exception as exc:  # noqa: BLE001 -- any failure means the layout is unknown: keep the dynamic cache
        return f"its cache layout could not be read from its config ({type(exc).__name__}: {exc})"
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if other or not layers:
        kinds = ", ".join(other) or "no"
        return f"its cache has {kinds} layers (sliding-window or recurrent state), not plain keys and values"
    return None


def free_memory(device: torch.device) -> int | None:
    """Bytes the cache may still take on ``device`` (None: not checked, the CPU's memory)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def wanted(mode: str, device: torch.device) -> bool:
    """Whether ``--static-cache mode`` decodes with the static cache on ``device``: ``auto`` on CUDA (where the
    graph saves the launches; a CPU has none to save, and the masked slots add attention work), ``on`` everywhere."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values, (rows, kv heads, slots, head dim), written at each row's own slots."""

    def __init__(self, cache: SlotCache):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # The dtypes are what the attention produces: under opd's bfloat16 autocast the keys come out of the
        # rotary embedding in float32 and the values in bfloat16, as the dynamic cache stores them.
        self.cache.check_room(key_states, value_states)
        R, H, _, D = key_states.shape
        S, dev = self.cache.slots, key_states.device
        try:
            self.keys = torch.zeros(R, H, S, D, dtype=key_states.dtype, device=dev)
            self.values = torch.zeros(R, H, S, value_states.shape[-1], dtype=value_states.dtype, device=dev)
        except torch.OutOfMemoryError:
            need = self.cache.bytes_needed(key_states, value_states)
            raise CacheTooBig(R, S, need, free_memory(dev) or 0, dev) from None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        # scatter_ along the slot axis: a row's queries go to its own slots, with no host sync (capturable)
        at = self.cache.slots_RQ[:, None, :, None]
        R, H, Q, _ = key_states.shape
        self.keys.scatter_(2, at.expand(R, H, Q, key_states.shape[-1]), key_states.to(self.keys.dtype))
        self.values.scatter_(2, at.expand(R, H, Q, value_states.shape[-1]), value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.slots, 0

    def get_seq_length(self) -> int:
        # Rows differ in length and the masks come from the caller: there is no one length to report.
        return 0

    def get_max_length(self) -> int:
        return self.cache.slots


class SlotCache(Cache):
    """A transformers ``Cache`` whose layers write each query at ``slots_RQ`` (set before every forward)."""

    def __init__(self, layers: int, slots: int):
        self.slot_layers = [_SlotLayer(self) for _ in range(layers)]
        super().__init__(layers=list(self.slot_layers))
        self.slots = slots
        self.slots_RQ = torch.zeros(0, 0, dtype=torch.long)

    def bytes_needed(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        R, H, _, D = key_states.shape
        per_slot = H * (D * key_states.element_size() + value_states.shape[-1] * value_states.element_size())
        return len(self.layers) * R * self.slots * per_slot

    def check_room(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if any(layer.is_initialized for layer in self.slot_layers):
            return  # checked once, at the first layer, for all of them
        free = free_memory(key_states.device)
        need = self.bytes_needed(key_states, value_states)
        if free is not None and need > ROOM_SHARE * free:
            raise CacheTooBig(key_states.shape[0], self.slots, need, free, key_states.device)


def attention_mask(slots_RQ: torch.Tensor, slots: int) -> torch.Tensor:
    """SDPA's boolean mask for queries written at ``slots_RQ``: a real token sees its row's slots up to its own
    (all filled: a row's tokens fill its slots in order), one written to the trash slot sees that slot alone
    (so nothing it computes can be NaN, and no real token ever reads it).

    Shapes: slots_RQ: (R, Q) -> (R, 1, Q, slots)
    """
    trash = slots - 1
    j = torch.arange(slots, device=slots_RQ.device)
    at = slots_RQ.unsqueeze(-1)
    return torch.where(at == trash, j == trash, j <= at).unsqueeze(1)


@dataclass
class _Step:
    """The decode step's fixed buffers (one token per row), and its graph once captured."""

    ids_R1: torch.Tensor
    pos_R1: torch.Tensor
    slots_R1: torch.Tensor
    mask_R11S: torch.Tensor
    graph: Any = None  # torch.cuda.CUDAGraph
    logits_RV: torch.Tensor | None = None  # the graph's output buffer
    weights: tuple[int, ...] = ()  # the data pointers the graph reads


def _weights_key(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


class StaticDecoder:
    """A static cache for ``rows`` rows of ``slots - 1`` tokens each, and the decode step over it.

    :meth:`start` begins a batch (every row empty), :meth:`feed` appends tokens: left-padded (mask 0 where a row
    has none) and returns each row's next-token logits at its last column. One token per row is the decode
    step, run from fixed buffers and, with ``graphs``, replayed from its CUDA graph."""

    def __init__(self, model: torch.nn.Module, layers: int, rows: int, slots: int, graphs: bool):
        self.model, self.rows, self.slots, self.graphs = model, rows, slots, graphs
        self.cache = SlotCache(layers, slots)
        dev = model_device(model)
        self.used_R = torch.zeros(rows, dtype=torch.long, device=dev)  # each row's tokens: its next slot
        z = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.step = _Step(z, z.clone(), z.clone(), torch.zeros(rows, 1, 1, slots, dtype=torch.bool, device=dev))
        self.capture_s: float | None = None  # seconds the last capture took
        self.graph_error: str | None = None  # why the graph is not used (the step then runs eagerly)
        self.verified = False  # the graph's first replay checked against the eager step

    def start(self) -> None:
        self.used_R.zero_()
        if self.step.graph is not None and self.step.weights != _weights_key(self.model):
            self.step.graph = self.step.logits_RV = None  # new weight tensors: the graph reads the old ones

    def feed(self, ids_RC: torch.Tensor, mask_RC: torch.Tensor) -> torch.Tensor:
        """Append the real tokens of ``ids_RC`` (``mask_RC`` 1) to each row. Shapes: (R, C) -> logits (R, V)."""
        positions = self.used_R.unsqueeze(-1) + (mask_RC.cumsum(-1) - 1).clamp(min=0)
        slots_RC = torch.where(mask_RC.bool(), positions, self.slots - 1)
        # the decode step once the cache is allocated (by a prefill, never inside a capture)
        if ids_RC.shape[1] == 1 and self.cache.slot_layers[0].is_initialized:
            s = self.step
            s.ids_R1.copy_(ids_RC)
            s.pos_R1.copy_(positions)
            s.slots_R1.copy_(slots_RC)
            s.mask_R11S.copy_(attention_mask(slots_RC, self.slots))
            logits = self._decode_step()
        else:
            self.cache.slots_RQ = slots_RC
            logits = self._forward(ids_RC, positions, attention_mask(slots_RC, self.slots))
        self.used_R += mask_RC.sum(-1)
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _decode_step(self) -> torch.Tensor:
        s = self.step
        self.cache.slots_RQ = s.slots_R1
        if self.graphs and s.graph is None:
            self._capture()
        if s.graph is None:
            return self._forward(s.ids_R1, s.pos_R1, s.mask_R11S)
        s.graph.replay()
        assert s.logits_RV is not None
        logits = s.logits_RV.clone()  # the next replay overwrites the buffer
        return logits if self.verified else self._verify(logits)

    def _verify(self, replayed: torch.Tensor) -> torch.Tensor:
        """The first replay against the same step run eagerly (it writes the same keys and values again): a
        graph that read a stale buffer or weight would be off by far more than the rounding of kernels chosen
        otherwise, and is then dropped for the eager step. Once per capture."""
        eager = self._forward(self.step.ids_R1, self.step.pos_R1, self.step.mask_R11S)
        self.verified = True
        gap = float((replayed.float() - eager.float()).abs().max())
        if gap > VERIFY_TOL * max(1.0, float(eager.float().abs().max())):
            self.graphs, self.step.graph, self.step.logits_RV = False, None, None
            self.graph_error = f"its first replay's logits differ from the eager step's by {gap:.3g}"
            return eager
        return replayed

    def _capture(self) -> None:
        """Capture the decode step, its buffers pointed at the trash slot so the warm-up writes nothing real.
        A model whose forward cannot be captured (a host sync in it) decodes eagerly from then on."""
        s, dev, t0 = self.step, self.used_R.device, time.perf_counter()
        saved = (s.ids_R1.clone(), s.pos_R1.clone(), s.slots_R1.clone(), s.mask_R11S.clone())
        s.slots_R1.fill_(self.slots - 1)
        s.mask_R11S.copy_(attention_mask(s.slots_R1, self.slots))
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    self._forward(s.ids_R1, s.pos_R1, s.mask_R11S)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a scoring thread) neither breaks the capture nor is refused
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = self._forward(s.ids_R1, s.pos_R1, s.mask_R11S)
            torch.cuda.synchronize(dev)
        except Exception as exc:  # noqa: BLE001 -- any capture failure leaves the eager step, which is correct
            self.graphs, self.graph_error = False, f"capture failed: {type(exc).__name__}: {exc}"
        else:
            s.graph, s.logits_RV, s.weights = graph, logits, _weights_key(self.model)
            self.capture_s, self.verified = time.perf_counter() - t0, False
        for buf, value in zip((s.ids_R1, s.pos_R1, s.slots_R1, s.mask_R11S), saved, strict=True):
            buf.copy_(value)


class StaticPool:
    """One engine's static decoders (``--static-cache``): which batches get one, kept for reuse between
    rollouts (the captured graph with them), and the notes, each said once."""

    def __init__(self, model: torch.nn.Module, mode: str):
        if mode not in STATIC_CACHE:
            raise ValueError(f"static_cache={mode!r}: use one of {', '.join(STATIC_CACHE)}")
        self.model, self.mode = model, mode
        self.free: list[StaticDecoder] = []  # not in use, the most recently used last
        self.said: set[str] = set()
        self.captures: list[float] = []  # seconds each capture took, in order
        self.graphs: bool | None = None  # capture the decode step: None on CUDA; False: eagerly, to compare
        self._unsupported: str | None = None
        self._checked = False

    def take(self, rows: int, tokens: int) -> StaticDecoder | None:
        """A decoder for ``rows`` rows of up to ``tokens`` tokens (prompt and response), or None: the
        dynamic cache (the mode, the device or the model says so)."""
        dev = model_device(self.model)
        if not wanted(self.mode, dev) or not self._supported():
            return None
        for i, dec in enumerate(self.free):
            if dec.rows == rows and dec.slots > tokens:
                return self.free.pop(i)
        del self.free[: max(0, len(self.free) - (KEEP - 1))]  # make room before allocating another
        slots = -(-(tokens + 1) // SLOT_ROUND) * SLOT_ROUND  # + 1: the trash slot
        layers = len(DynamicCache(config=self.model.config).layers)  # type: ignore[arg-type]
        graphs = dev.type == "cuda" if self.graphs is None else self.graphs
        return StaticDecoder(self.model, layers, rows, slots, graphs)

    def give(self, dec: StaticDecoder) -> None:
        """A decoder back, to keep for the next batch of its shape."""
        if dec.capture_s is not None:
            self.captures.append(dec.capture_s)
            self.note(
                f"capture {len(self.captures)}",
                f"the rollout's decode step was captured as a CUDA graph in {dec.capture_s:.1f} s ({dec.rows} rows, "
                f"{dec.slots} positions); it is replayed while batches keep that shape",
            )
            dec.capture_s = None
        if dec.graph_error:
            self.note("graph", f"the decode step runs without a CUDA graph: {dec.graph_error}")
        self.free.append(dec)
        del self.free[: max(0, len(self.free) - KEEP)]

    def prefill(
        self, dec: StaticDecoder, ids_NP: torch.Tensor, attn_NP: torch.Tensor, budget: int
    ) -> torch.Tensor | None:
        """Start ``dec`` on left-padded prompts (``budget`` new tokens each): their next-token logits, or None where
        the cache does not fit the device's memory (``auto``: the dynamic cache takes this batch, said once;
        ``on``: a UserError)."""
        dec.start()
        try:
            return dec.feed(ids_NP, attn_NP)
        except CacheTooBig as too_big:
            if self.mode == "on":
                raise UserError(
                    f"--static-cache on: {too_big} (a batch of {too_big.rows} rollouts, prompts of up to "
                    f"{ids_NP.shape[1]} tokens and a budget of {budget} new tokens); lower the batch size or "
                    "--max-new-tokens, or use --static-cache auto (the dynamic cache when it does not fit) or off"
                ) from None
            self.note("too big", f"{too_big}: this batch uses the dynamic cache (--static-cache off: always)")
            return None

    def note(self, key: str, text: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(f"opd: static KV cache: {text}", file=sys.stderr, flush=True)

    def _supported(self) -> bool:
        if not self._checked:
            self._checked, self._unsupported = True, static_support(self.model)
        if self._unsupported:
            self.note("unsupported", f"not used for this model: {self._unsupported}; rollouts use the dynamic cache")
        return self._unsupported is None
