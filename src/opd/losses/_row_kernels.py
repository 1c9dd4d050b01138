"""Row-dot kernels behind LSM from hidden states, and the public-API fallback of the private one.

``support_logits`` needs z[a, k] = hidden[rows[a]] . W[ids[a, k]] for K weight rows per active
position. ATen's private ``_embedding_bag_per_sample_weights_backward`` is exactly that (one dot
product per (bag, sample)) and reads each weight row once with no copy; the public-API
equivalent gathers the K rows into a (chunk, K, D) buffer and runs a batched matmul. The private
op is checked once per process on a small probe with a known answer (:func:`row_dots_kernel`);
if it is missing, its signature changed or its answer is wrong, opd warns once and takes the
public path (same values, slower). ``tests/losses/test_losses.py`` asserts the probe passes on the
installed torch, so an upgrade that breaks it fails CI instead of silently slowing training.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from opd.losses._common import position_chunks

ROW_DOTS_OP = "_embedding_bag_per_sample_weights_backward"

# An ATen op as torch.ops exposes it (an OpOverloadPacket): called with tensors and ints.
RowDotsOp = Callable[..., Any]


def _call_row_dots(
    op: RowDotsOp, hidden_ND: torch.Tensor, weight_VD: torch.Tensor, rows_A: torch.Tensor, ids_AK: torch.Tensor
) -> torch.Tensor:
    """z[a, k] = hidden[rows[a]] . W[ids[a, k]] through ``op`` (the private aten kernel)."""
    A, K = ids_AK.shape
    flat = ids_AK.reshape(-1)
    # Each sample's "bag" (offset2bag) may be any row of hidden, so the active rows are never
    # copied; offsets are only read when offset2bag is empty, but the schema requires them.
    offsets = torch.arange(0, A * K, K, device=flat.device)
    out: torch.Tensor = op(
        hidden_ND.contiguous(), weight_VD.contiguous(), flat, offsets, rows_A.repeat_interleave(K), 0, -1
    )
    return out.view(A, K)


def probe_row_dots(op: RowDotsOp | None) -> str | None:
    """None if ``op`` gives the row dots of a small probe exactly (float32 and float64), else why not."""
    if op is None:
        return f"torch.ops.aten.{ROW_DOTS_OP} does not exist"
    hidden = torch.tensor([[1.0, 2.0, -1.0], [3.0, -1.0, 0.5], [0.5, 4.0, 2.0]])
    weight = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0], [2.0, -3.0, 0.25], [-1.0, 1.0, 4.0]])
    rows = torch.tensor([2, 0])  # out of order, and row 1 unused, as masked positions are
    ids = torch.tensor([[3, 0, 2], [1, 1, 3]])
    expected = torch.stack([weight[ids[a]] @ hidden[rows[a]] for a in range(2)])
    for dtype in (torch.float32, torch.float64):
        try:
            got = _call_row_dots(op, hidden.to(dtype), weight.to(dtype), rows, ids)
        except Exception as err:  # a changed schema raises TypeError or RuntimeError
            return f"calling torch.ops.aten.{ROW_DOTS_OP} failed: {type(err).__name__}: {err}"
        if got.dtype != dtype or not torch.equal(got, expected.to(dtype)):
            return f"torch.ops.aten.{ROW_DOTS_OP} returned {got.tolist()} for {expected.tolist()} ({dtype})"
    return None


@functools.cache
def row_dots_kernel() -> RowDotsOp | None:
    """The private aten row-dot kernel if it passes :func:`probe_row_dots`, else None (warns once)."""
    op: RowDotsOp | None = getattr(torch.ops.aten, ROW_DOTS_OP, None)
    why = probe_row_dots(op)
    if why is None:
        return op
    warnings.warn(
        f"opd.losses: {why} (torch {torch.__version__}). LSM from hidden states uses the "
        "public-API gather path instead: same values, slower. Please report this to opd.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def support_logits(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    rows_A: torch.Tensor,
    ids_AK: torch.Tensor,
    dtype: torch.dtype,
    chunk_size: int | None,
) -> torch.Tensor:
    """z[a, k] = hidden[rows[a]] . W[ids[a, k]] in ``dtype``.

    Shapes:
        hidden_ND: (N, D); weight_VD: (V, D); rows_A: (A,); ids_AK: (A, K) -> z_AK: (A, K)
    """
    if hidden_ND.dtype == weight_VD.dtype == dtype and hidden_ND.device.type == "cpu":
        op = row_dots_kernel()
        if op is not None:
            return _call_row_dots(op, hidden_ND, weight_VD, rows_A, ids_AK)
    return gathered_support_logits(hidden_ND, weight_VD, rows_A, ids_AK, dtype, chunk_size)


def gathered_support_logits(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    rows_A: torch.Tensor,
    ids_AK: torch.Tensor,
    dtype: torch.dtype,
    chunk_size: int | None,
) -> torch.Tensor:
    """:func:`support_logits` with public ops only: gather K weight rows, then a batched matmul."""
    A, K = ids_AK.shape
    z_AK = torch.empty(A, K, dtype=dtype, device=hidden_ND.device)
    # One reused buffer: fresh memory costs page faults that dominate this bandwidth-bound loop.
    buf = torch.empty(min(A, chunk_size or A) * K, weight_VD.shape[1], dtype=weight_VD.dtype, device=weight_VD.device)
    for sl in position_chunks(A, chunk_size):
        n = sl.stop - sl.start
        w_cKD = torch.index_select(weight_VD, 0, ids_AK[sl].reshape(-1), out=buf[: n * K]).view(n, K, -1)
        z_AK[sl] = torch.bmm(w_cKD.to(dtype), hidden_ND[rows_A[sl]].to(dtype).unsqueeze(-1)).squeeze(-1)
    return z_AK


def weighted_rows(
    weight_VD: torch.Tensor,
    rows_A: torch.Tensor,
    ids_AK: torch.Tensor,
    g_AK: torch.Tensor,
    n_rows: int,
    chunk_size: int | None,
) -> torch.Tensor:
    """out[rows[a]] = sum_k g[a, k] * W[ids[a, k]], zero on the other rows, in g's dtype.

    Shapes:
        weight_VD: (V, D); rows_A: (A,); ids_AK, g_AK: (A, K) -> out: (n_rows, D)
    """
    A, K = ids_AK.shape
    if weight_VD.dtype == g_AK.dtype:
        # A weighted bag of embedding rows per output row (public embedding_bag); rows that are
        # not active get an empty bag (a zero row), so the full-size gradient is written once.
        counts = torch.zeros(n_rows, dtype=torch.long, device=ids_AK.device).index_fill_(0, rows_A, K)
        offsets = counts.cumsum(0) - counts
        return F.embedding_bag(ids_AK.reshape(-1), weight_VD, offsets, per_sample_weights=g_AK.reshape(-1), mode="sum")
    out = torch.zeros(n_rows, weight_VD.shape[1], dtype=g_AK.dtype, device=g_AK.device)
    for sl in position_chunks(A, chunk_size):
        out[rows_A[sl]] = torch.bmm(g_AK[sl].unsqueeze(1), weight_VD[ids_AK[sl]].to(g_AK.dtype)).squeeze(1)
    return out
