"""The output head as a model computes it: logits = cap(scale * (h @ W.T + b)), pure torch.

Not every causal LM's logits are ``hidden @ W.T``: phi-1/phi-2 add a bias, Granite divides by
``logits_scaling`` and Cohere multiplies by ``logit_scale``, Gemma 2 soft-caps with
``c * tanh(z / c)``. :class:`Head` holds what a family does (``opd.models.head`` reads it off a
model); every loss and scorer that computes logits from hidden states takes one, so the numbers
opd trains on are the model's own. A plain (V, D) tensor still works wherever a head is taken: it
is the plain head (no bias, scale 1, no cap).

The kernels compute a chunk of logits at a time: :func:`chunk_logits` writes one chunk's
transformed logits (in place, into a reused buffer), :func:`transform_` applies the scale and cap
to raw logits such as LSM's K support dots, and the analytic backwards turn a gradient with
respect to the final logits into one with respect to the raw ``h @ W.T + b`` with
:func:`raw_grad_`: d/du c tanh(s u / c) = s (1 - (z / c)^2), z the final logit. tanh is monotone,
so a top-K can be taken on either; values and normalizers need the transformed logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

VOCAB_BLOCK = 8192  # head rows cast to the compute dtype at a time by chunk_logits (8 MiB at D 256)


@dataclass(frozen=True)
class Head:
    """A model's output head: logits = softcap(scale * (hidden @ weight.T + bias)).

    ``softcap`` c (None: none) maps z to c * tanh(z / c) (Gemma 2's ``final_logit_softcapping``);
    ``scale`` multiplies (Cohere's ``logit_scale``; Granite's ``logits_scaling`` is 1 / scale).
    Gradients reach ``weight_VD`` and ``bias_V`` through every loss when they require grad.

    Shapes: weight_VD (V, D); bias_V (V,) or None
    """

    weight_VD: torch.Tensor
    bias_V: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap={self.softcap} must be positive, or None for no soft-capping")
        if self.bias_V is not None and tuple(self.bias_V.shape) != (self.weight_VD.shape[0],):
            raise ValueError(f"bias {tuple(self.bias_V.shape)} does not fit the head {tuple(self.weight_VD.shape)}")

    @property
    def vocab(self) -> int:
        return int(self.weight_VD.shape[0])

    @property
    def transformed(self) -> bool:
        """Whether the logits are scaled or capped (the raw dots are not the logits)."""
        return self.scale != 1.0 or self.softcap is not None

    def detach(self) -> Head:
        bias = None if self.bias_V is None else self.bias_V.detach()
        return replace(self, weight_VD=self.weight_VD.detach(), bias_V=bias)

    def logits(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden`` (any leading shape), differentiable by autograd, in the compute dtype
        of the head and hidden states (float64 if any is, else float32).

        Shapes: hidden (..., D) -> logits (..., V)
        """
        dtype = head_dtype(self, hidden_ND)
        z = hidden_ND.to(dtype) @ self.weight_VD.to(dtype).T
        if self.bias_V is not None:
            z = z + self.bias_V.to(dtype)
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z


HeadLike = torch.Tensor | Head


def as_head(head: HeadLike) -> Head:
    """``head`` itself, or the plain head of a (V, D) weight."""
    return head if isinstance(head, Head) else Head(head)


def head_dtype(head: Head, *tensors: torch.Tensor) -> torch.dtype:
    """The package's compute dtype over the head's tensors and ``tensors``: float64 if any is, else float32."""
    parts = [head.weight_VD, *tensors, *([] if head.bias_V is None else [head.bias_V])]
    return torch.float64 if any(t.dtype == torch.float64 for t in parts) else torch.float32


def transform_(z: torch.Tensor, head: Head) -> torch.Tensor:
    """Scale and soft-cap raw logits ``h @ W.T + b`` in place; returns ``z``."""
    if head.scale != 1.0:
        z.mul_(head.scale)
    if head.softcap is not None:
        z.div_(head.softcap).tanh_().mul_(head.softcap)
    return z


def chunk_logits(
    hidden_cD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None, head: Head, out: torch.Tensor
) -> torch.Tensor:
    """One chunk's final logits into ``out`` (a (c, V) buffer of the compute dtype), with the head's
    bias already in that dtype (converted once per call, not per chunk). A weight in another dtype (a
    bfloat16 teacher's head) is cast :data:`VOCAB_BLOCK` rows at a time: a whole float32 copy would
    take V x D x 4 bytes (2.5 GB for an 8B teacher's head). Every block is as wide (the last one
    overlaps the one before): a narrow one takes BLAS's narrow kernels, whose sums differ in the last
    bit, where equal wide ones gave the whole product's bits here (CPU, MKL; tests/losses)."""
    V = weight_VD.shape[0]
    if weight_VD.dtype == out.dtype or V <= VOCAB_BLOCK:
        z = torch.mm(hidden_cD, weight_VD.T.to(out.dtype), out=out)
    else:
        for v in range(0, V, VOCAB_BLOCK):
            block = slice(min(v, V - VOCAB_BLOCK), min(v, V - VOCAB_BLOCK) + VOCAB_BLOCK)
            torch.mm(hidden_cD, weight_VD[block].to(out.dtype).T, out=out[:, block])
        z = out
    if bias_V is not None:
        z.add_(bias_V)
    return transform_(z, head)


def raw_grad_(grad_z: torch.Tensor, z: torch.Tensor | None, head: Head) -> torch.Tensor:
    """Turn d/d(final logits) into d/d(raw logits h @ W.T + b) in place; ``z`` the final logits (read
    only when the head soft-caps: the cap's derivative is 1 - (z / c)^2)."""
    if head.softcap is not None:
        if z is None:
            raise ValueError("a soft-capped head's gradient needs the capped logits z")
        grad_z.mul_(1.0 - (z / head.softcap).square())
    if head.scale != 1.0:
        grad_z.mul_(head.scale)
    return grad_z


def cast_head(head: Head, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias in ``dtype`` (no copy when they already are)."""
    return head.weight_VD.to(dtype), None if head.bias_V is None else head.bias_V.to(dtype)


def cast_bias(head: Head, dtype: torch.dtype) -> torch.Tensor | None:
    """The head's bias in ``dtype`` (None: none); :func:`chunk_logits` casts the weight a block at a time."""
    return None if head.bias_V is None else head.bias_V.to(dtype)


@torch.no_grad()
def logits_no_grad(head: Head, hidden_MD: torch.Tensor) -> torch.Tensor:
    """:meth:`Head.logits` without autograd and without a whole copy of a low-precision head.

    Shapes: hidden_MD (M, D) -> logits (M, V)
    """
    dtype = head_dtype(head, hidden_MD)
    out = torch.empty(hidden_MD.shape[0], head.vocab, dtype=dtype, device=hidden_MD.device)
    return chunk_logits(hidden_MD.to(dtype), head.weight_VD, cast_bias(head, dtype), head, out)
