"""Helpers shared by every loss module: the dtype policy, boolean masks and position chunks."""

from __future__ import annotations

from collections.abc import Iterator

import torch

NEG_INF = float("-inf")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (the package's dtype policy)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def check_k(k: int, vocab: int) -> None:
    if not 1 <= k <= vocab:
        raise ValueError(
            f"k={k} is outside [1, vocabulary size {vocab}]; choose a support size no larger "
            "than the vocabulary (e.g. --k 32)."
        )


def head_for_grad_h(w: torch.Tensor) -> torch.Tensor:
    """The head to back-propagate into the hidden states with: ``w``, its -inf entries zeroed if it has any.

    A -inf head entry gives a token a -inf logit (no mass, dz = 0): its true share of grad_h is 0,
    where the matmul would give 0 * inf = NaN. aminmax checks the head in one pass with no
    temporary; isfinite(w) would allocate head-sized tensors (about 1.2 GB at a Qwen-sized head).
    """
    if bool(torch.isfinite(torch.stack(torch.aminmax(w))).all()):
        return w
    return torch.where(torch.isfinite(w), w, torch.zeros_like(w))


def position_chunks(n: int, chunk_size: int | None) -> Iterator[slice]:
    """Slices covering range(n), ``chunk_size`` at a time (all of it when None or <= 0)."""
    step = n if not chunk_size or chunk_size <= 0 else chunk_size
    for start in range(0, n, max(step, 1)):
        yield slice(start, min(start + step, n))


def chunk_buffers(
    count: int, rows: int, chunk_size: int | None, V: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``count`` (chunk, V) scratch buffers for a loop over ``rows`` positions in chunks of
    ``chunk_size`` (:func:`position_chunks`): reused across chunks, since fresh (chunk, V) memory per
    chunk would cost page faults each time."""
    step = rows if not chunk_size or chunk_size <= 0 else chunk_size  # as position_chunks reads it
    return torch.empty(count, max(min(rows, step), 1), V, dtype=dtype, device=device)
