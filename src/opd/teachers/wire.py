"""opd's binary answer format between its own teacher client and server (``opd.teachers.client``, ``opd.teachers.completions``).

vLLM's ``prompt_logprobs`` JSON spends a dict with a decoded string per returned token (K or
K + 1 per scored position), which both ends build and parse token by token in Python. Between two
opd ends the same numbers travel as arrays, written and read whole. The client asks for them only when the
server lists :data:`MEDIA_TYPE` in ``GET /opd/vocab`` (``answer_media_types``), by sending
``Accept: application/x-opd-scores-v1`` with a request that is otherwise the usual JSON; every
other client and server keeps the JSON format, and error answers are JSON either way.

The body (little-endian throughout; R = total rows, one row per scored position)::

    magic  b"OPDS"    4 bytes
    version           uint32 (1)
    n_seqs, k, R      uint32 each
    rows              uint32[n_seqs]  scored positions of each sequence (its length - its start)
    top ids           int32[R, K]     sequence by sequence, position by position; each row sorted
    top log-probs     float32[R, K]   by descending log-prob (the teacher's top-K)
    given log-probs   float32[R]      the log-prob of the sequence's own token at that position

Row r of a sequence describes its token ``start + r`` (``start`` from ``opd_logprobs_from``,
default 1), as entry ``start + r`` of its JSON ``prompt_logprobs`` does. A log-prob may be -inf
(a token the float32 softmax underflows), never NaN or > 0.
"""

from __future__ import annotations

import numpy as np
import torch

MEDIA_TYPE = "application/x-opd-scores-v1"
MAGIC, VERSION = b"OPDS", 1
_HEADER = np.dtype([("magic", "S4"), ("version", "<u4"), ("n_seqs", "<u4"), ("k", "<u4"), ("rows", "<u4")])


class WireError(ValueError):
    """A binary answer that does not hold what was asked (truncated, mis-shaped or out of range)."""


def accepts(accept_header: str | None) -> bool:
    """Whether an ``Accept`` header names opd's binary answer (``*/*`` does not: JSON stays the default)."""
    return any(part.split(";")[0].strip().lower() == MEDIA_TYPE for part in (accept_header or "").split(","))


def encode_scores(rows_S: list[int], ids_RK: torch.Tensor, logprobs_RK: torch.Tensor, given_R: torch.Tensor) -> bytes:
    """The binary answer for S sequences whose R scored rows are stacked in ``ids_RK`` etc."""
    R, K = ids_RK.shape
    if sum(rows_S) != R or logprobs_RK.shape != (R, K) or given_R.shape != (R,):
        raise ValueError(
            f"rows {sum(rows_S)} != {R}, or shapes {tuple(logprobs_RK.shape)} / {tuple(given_R.shape)} "
            f"do not match ids {(R, K)}"
        )
    header = np.array([(MAGIC, VERSION, len(rows_S), K, R)], dtype=_HEADER)
    parts = [
        header,
        np.asarray(rows_S, dtype="<u4"),
        _array(ids_RK, "<i4"),
        _array(logprobs_RK, "<f4"),
        _array(given_R, "<f4"),
    ]
    return b"".join(p.tobytes() for p in parts)


def _array(t: torch.Tensor, dtype: str) -> np.ndarray:
    # torch's int32/float32 are the host's byte order; astype makes them little-endian anywhere
    return t.detach().to("cpu", torch.int32 if dtype == "<i4" else torch.float32).numpy().astype(dtype, copy=False)


def decode_scores(
    body: bytes, rows_S: list[int], k: int, vocab_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check a binary answer against what was asked and return (ids_RK int64, logprobs_RK, given_R float32).

    ``rows_S``: the scored positions expected per sequence; ``vocab_rows``: ids must lie in
    [0, vocab_rows). Raises :class:`WireError` saying what is wrong."""
    if len(body) < _HEADER.itemsize:
        raise WireError(f"{len(body)} bytes, shorter than the {_HEADER.itemsize}-byte header (truncated)")
    head = np.frombuffer(body, dtype=_HEADER, count=1)[0]
    if head["magic"] != MAGIC or head["version"] != VERSION:
        raise WireError(
            f"magic {bytes(head['magic'])!r} version {int(head['version'])}, expected {MAGIC!r} version {VERSION}"
        )
    S, K, R = int(head["n_seqs"]), int(head["k"]), int(head["rows"])
    if S != len(rows_S) or K != k:
        raise WireError(f"{S} sequences with K={K}, where {len(rows_S)} with K={k} were asked")
    want = _HEADER.itemsize + 4 * S + R * K * 8 + R * 4
    if len(body) != want:
        raise WireError(f"{len(body)} bytes where its header announces {want} (truncated or padded)")
    off = _HEADER.itemsize
    rows = np.frombuffer(body, "<u4", S, off)
    if rows.tolist() != list(rows_S) or R != sum(rows_S):
        raise WireError(f"rows per sequence {rows.tolist()[:8]}... differ from the {list(rows_S)[:8]}... asked")
    off += 4 * S
    ids = torch.from_numpy(np.frombuffer(body, "<i4", R * K, off).astype(np.int64)).view(R, K)
    lps = torch.from_numpy(np.frombuffer(body, "<f4", R * K, off + 4 * R * K).astype(np.float32)).view(R, K)
    given = torch.from_numpy(np.frombuffer(body, "<f4", R, off + 8 * R * K).astype(np.float32))
    if R and not bool(((ids >= 0) & (ids < vocab_rows)).all()):
        raise WireError(f"a token id outside the student's vocabulary [0, {vocab_rows})")
    # NaN fails every comparison, so "not <= 0" catches it with the positive values; a little slack
    # above 0 is float rounding of a near-certain token, as the JSON path allows.
    if R and not (bool((lps <= 1e-4).all()) and bool((given <= 1e-4).all())):
        raise WireError("a log-prob that is NaN or > 0")
    if R and K > 1 and not bool((lps[:, :-1] >= lps[:, 1:]).all()):
        raise WireError("top-K log-probs not sorted in descending order")
    return ids, lps, given
