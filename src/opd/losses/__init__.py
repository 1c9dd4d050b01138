"""Per-position distillation losses for on-policy distillation (OPD), pure torch.

Tensors in, tensors out: no model, tokenizer or trainer object is touched here, so an engineer
with their own trainer can import only this package. Names carry their shapes (``logits_BTV``:
batch B, positions T, vocabulary V; ``ids_BTK``: K support slots; ``hidden_BTD``: width D).

The package, by concern (everything is importable from ``opd.losses`` itself):

* :mod:`~opd.losses.head` -- :class:`Head`, the output head as the model computes it: logits =
  softcap(scale * (hidden @ W.T + bias)) (phi's bias, Granite's and Cohere's scaling, Gemma 2's
  soft-cap). Every ``*_from_hidden`` function takes a Head, or a plain (V, D) weight for the plain
  head; gradients reach the weight and the bias.
* :mod:`~opd.losses.support` -- top-K from logits or hidden states (:func:`topk_from_hidden`, for
  teacher and student alike; ``teacher_topk_from_hidden`` is its old name) and the LSM supports.
* :mod:`~opd.losses.lsm` -- :func:`local_support_kl`, teacher top-K local support matching (LSM,
  arXiv:2603.25562): renormalize the student and the teacher over a support S and take
  KL(student_hat || teacher_hat); ``renormalize=False`` is the paper's collapsing ablation.
  :func:`local_support_kl_from_hidden` computes it from hidden states with only the K logits
  ``h_t . W[v]`` (v in S), since renormalization cancels the full-vocabulary normalizer.
  Its row-dot kernel (a private ATen op, probed once, with a public fallback) is in
  ``_row_kernels``.
* :mod:`~opd.losses.tail` -- :func:`local_support_kl_tail` and
  :func:`local_support_kl_tail_from_hidden`: LSM's support without renormalizing, plus one tail
  bucket per model for its mass outside S (TRL's ``loss_add_tail``), so that mass is not free.
  The student's tail needs its full log-normalizer: from hidden states it takes a chunked pass
  over the head (no (B, T, V) tensor), about the cost of sampled-token log-probs.
* :mod:`~opd.losses.sampled` -- the sampled-token OPD reward r_t = log q(y_t) - log p(y_t), its
  discounted reward-to-go (gamma=0 token level, gamma=1 sequence level) and a policy-gradient
  surrogate; :func:`token_logprobs_from_hidden`.
* :mod:`~opd.losses.full_vocab` -- :func:`full_vocab_kl` and :func:`generalized_jsd` from logits,
  and :func:`full_vocab_kl_from_hidden`, which never forms a (B, T, V) tensor of either model.
* :mod:`~opd.losses.reductions` -- :func:`token_mean`, :func:`sequence_mean`,
  :func:`constant_sum`, :func:`special_token_mask`.

Every loss returns a per-position ``_BT`` tensor that is exactly 0 where ``mask_BT`` is false;
reduce it with :func:`token_mean`, :func:`sequence_mean` or :func:`constant_sum`.

Dtypes: float64 inputs are computed and returned in float64; float32, float16 and bfloat16
inputs are computed and returned in float32 (low-precision accumulation of a KL is not worth its
error). Gradients come back in each input's own dtype.
"""

from opd.losses.full_vocab import full_vocab_kl, full_vocab_kl_from_hidden, generalized_jsd
from opd.losses.head import Head, HeadLike, as_head
from opd.losses.lsm import local_support_kl, local_support_kl_from_hidden
from opd.losses.reductions import constant_sum, sequence_mean, special_token_mask, token_mean
from opd.losses.sampled import (
    gather_logprobs,
    sampled_token_advantages,
    sampled_token_pg_loss,
    token_logprobs_from_hidden,
    truncated_importance_weight,
)
from opd.losses.support import (
    SUPPORT_KINDS,
    build_support,
    teacher_topk,
    teacher_topk_from_hidden,
    topk_and_gather_from_hidden,
    topk_from_hidden,
)
from opd.losses.tail import local_support_kl_tail, local_support_kl_tail_from_hidden

__all__ = [
    "SUPPORT_KINDS",
    "Head",
    "HeadLike",
    "as_head",
    "build_support",
    "constant_sum",
    "full_vocab_kl",
    "full_vocab_kl_from_hidden",
    "gather_logprobs",
    "generalized_jsd",
    "local_support_kl",
    "local_support_kl_from_hidden",
    "local_support_kl_tail",
    "local_support_kl_tail_from_hidden",
    "sampled_token_advantages",
    "sampled_token_pg_loss",
    "truncated_importance_weight",
    "sequence_mean",
    "special_token_mask",
    "teacher_topk",
    "teacher_topk_from_hidden",
    "token_logprobs_from_hidden",
    "token_mean",
    "topk_and_gather_from_hidden",
    "topk_from_hidden",
]
