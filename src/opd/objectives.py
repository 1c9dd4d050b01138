"""The training objectives: one registry entry each, from a step's tensors to a per-position loss.

An entry says everything the rest of opd asks of an objective, so adding one is one entry here
(docs/architecture.md, "Adding an objective") and no other file tests its name:

* ``loss``: pure tensors in (:class:`ObjectiveInputs`), the (N, T) per-position loss out; the
  trainer masks, reduces and backpropagates it.
* ``needs``: which teacher outputs the loss reads for a given configuration (:data:`TOPK`,
  :data:`SAMPLED`, ...). The config refuses what a teacher with another tokenizer cannot give, the
  teacher factory what a served teacher cannot, and the trainer computes the student's top-K and
  the teacher's hidden states only when they are needed.
* ``mask_special``: the default of ``--mask-special`` for the objective.
* ``variants``: the boolean options that are variants of this objective only (``--tail``); the
  config refuses them with any other.
* ``check``: what the objective refuses of its options' combination (lsm: ``--tail`` with
  ``--no-renormalize``). The options themselves (``--objective``, ``--k``, ``--support``, ...) are declared
  here, with their ranges (:class:`ObjectiveOptions`); the config's ``TrainConfig`` holds them.

The three objectives of the papers:

* ``lsm``: support (teacher top-K by default, or any kind of :func:`opd.losses.build_support`),
  then :func:`~opd.losses.local_support_kl_from_hidden` -- the student's (N, T, V) logits are never
  built. ``renormalize=False`` (the ablation) needs the student's full-vocabulary normalizer, taken
  a chunk of positions at a time. ``tail`` adds a bucket for the mass outside the support
  (:func:`~opd.losses.local_support_kl_tail_from_hidden`, the student's head a chunk at a time).
* ``sampled``: sampled-token OPD, r_t = log q(y_t) - log p(y_t) with the discounted reward-to-go
  and a policy-gradient surrogate (importance-ratio clipping when a batch is reused).
* ``full_kl``: dense reverse or forward KL over the whole vocabulary, from both models' hidden
  states a chunk of positions at a time (:func:`~opd.losses.full_vocab_kl_from_hidden`).

This module imports only torch and :mod:`opd.losses` (an import contract), so the config can
import its options and validate against the registry, and an engineer's own trainer can call an entry's ``loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from opd import losses as L

# What a loss reads of the teacher. An in-process teacher gives all of them; see SERVED_GIVES and
# CROSS_TOKENIZER_GIVES for the others.
TOPK = "the teacher's top-K log-probs"
SAMPLED = "the teacher's log-prob of the sampled token"
QUERY = "teacher log-probs of student-chosen tokens"  # the student's top-K, scored by the teacher
SAMPLED_SLOT = "the teacher's log-prob of the sampled token as a support slot"
FULL = "the teacher's distribution over the student's vocabulary"  # its hidden states and head

SERVED_GIVES = frozenset({TOPK, SAMPLED, SAMPLED_SLOT})  # a served teacher's answer (vLLM format or opd's)
# A teacher with another tokenizer gives the sampled token's reward per aligned span, never a
# log-prob of one student token inside a many-to-many group (so no SAMPLED_SLOT).
CROSS_TOKENIZER_GIVES = frozenset({TOPK, SAMPLED})


@dataclass
class ObjectiveInputs:
    """One micro-batch's tensors, everything an objective's loss may read.

    Shapes:
        hidden_NTD: (N, T, D) the student's final hidden states at the response positions
            (gradients flow through them); head_VD: its output head, a :class:`~opd.losses.Head`
            (bias, scale, soft-cap; gradients reach weight and bias) or a plain (V, D) weight
        response_ids_NT: (N, T) the sampled tokens; behaviour_logprobs_NT: (N, T) their
            log-probs under the policy that sampled them; action_mask_NT: (N, T) bool, the tokens
            the model wrote (environment turns of an episode are False)
        mask_NT: (N, T) bool, the positions the loss counts
        teacher_topk_ids_NTK, teacher_topk_logprobs_NTK: (N, T, K) sorted descending
        teacher_sampled_logprobs_NT: (N, T) the teacher's log-prob of each sampled token
        teacher_query_logprobs_NTQ: (N, T, Q) or None, the teacher's log-probs of
            ``student_topk_ids_NTQ`` (needs QUERY)
        student_topk_ids_NTQ: (N, T, Q) or None, the student's own top-K ids (needs QUERY)
        old_logprobs_NT: (N, T) or None, the log-probs of the policy of the batch's first
            update, when a batch is reused (``--updates-per-batch`` > 1)
        policy_logprobs_NT: (N, T) or None, for rollouts an older policy sampled
            (``--max-staleness`` > 0, a policy-gradient objective): the trainer's log-probs of the
            sampled tokens under the policy of the batch's first update
        teacher_hidden_NTE, teacher_head_VE: (N, T, E) and the teacher's head, or None (needs FULL)
    """

    hidden_NTD: torch.Tensor
    head_VD: L.HeadLike
    response_ids_NT: torch.Tensor
    behaviour_logprobs_NT: torch.Tensor
    action_mask_NT: torch.Tensor
    mask_NT: torch.Tensor
    teacher_topk_ids_NTK: torch.Tensor
    teacher_topk_logprobs_NTK: torch.Tensor
    teacher_sampled_logprobs_NT: torch.Tensor
    teacher_query_logprobs_NTQ: torch.Tensor | None = None
    student_topk_ids_NTQ: torch.Tensor | None = None
    old_logprobs_NT: torch.Tensor | None = None
    policy_logprobs_NT: torch.Tensor | None = None
    teacher_hidden_NTE: torch.Tensor | None = None
    teacher_head_VE: L.HeadLike | None = None


class UpdateOptions(Protocol):
    """What a policy-gradient loss reads of the optimizer's options besides its own (the optimizer section of
    :class:`opd.config.TrainConfig`): the PPO clip of a reused batch and the staleness weight's cap."""

    @property
    def clip_eps(self) -> float: ...
    @property
    def stale_weight_cap(self) -> float: ...


@dataclass(frozen=True)
class Objective:
    """A registry entry (see the module docstring)."""

    name: str
    help: str
    loss: Callable[[ObjectiveInputs, ObjectiveOptions, UpdateOptions], torch.Tensor]
    needs: Callable[[ObjectiveOptions], frozenset[str]]
    mask_special: bool = False
    variants: tuple[str, ...] = ()
    # A policy gradient (its expectation is over the sampling policy): with --max-staleness its loss
    # reads policy_logprobs_NT and corrects for the older policy that sampled. The divergences on a
    # support or the vocabulary need no correction: only the states they are evaluated on are stale.
    policy_gradient: bool = False
    # What this objective refuses of its own options' combinations (a message naming the option and the
    # fix), beyond each option's own range (ObjectiveOptions.problem); None: nothing.
    check: Callable[[ObjectiveOptions], str | None] = lambda cfg: None


REGISTRY: dict[str, Objective] = {}


def register(entry: Objective) -> Objective:
    """Add ``entry`` to :data:`REGISTRY` (its name must be new)."""
    if entry.name in REGISTRY:
        raise ValueError(f"objective {entry.name!r} is registered twice")
    REGISTRY[entry.name] = entry
    return entry


def lookup(name: str) -> Objective:
    """The entry named ``name``; a KeyError names the registered ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"objective {name!r}: choose one of {', '.join(REGISTRY)}") from None


# --- lsm: teacher top-K local support matching, and its support and tail ablations -------------

# The supports whose slots hold the student's top-K: the trainer computes it and the teacher
# scores those tokens (QUERY). teacher_topk_plus_sampled adds the sampled token as a slot.
_SUPPORT_NEEDS = {
    "student_topk": QUERY,
    "union": QUERY,
    "intersection": QUERY,
    "symmetric_difference": QUERY,
    "teacher_topk_plus_sampled": SAMPLED_SLOT,
}


def lsm_support(x: ObjectiveInputs, support: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Support ids, validity mask and the teacher's log-probs on every slot, for ``support``.

    Shapes:
        -> ids_NTS, valid_NTS (bool), teacher_logprobs_NTS: (N, T, S), S the support's slots
    """
    ids, smask = L.build_support(support, x.teacher_topk_ids_NTK, x.student_topk_ids_NTQ, x.response_ids_NT)
    t = x.teacher_topk_logprobs_NTK
    # These supports need QUERY (_SUPPORT_NEEDS), so the trainer scored the student's top-K.
    query_lp = cast(torch.Tensor, x.teacher_query_logprobs_NTQ)
    if support == "student_topk":
        t_lp = query_lp
    elif support in ("union", "symmetric_difference"):
        t_lp = torch.cat([t, query_lp], dim=-1)
    elif support == "teacher_topk_plus_sampled":
        t_lp = torch.cat([t, x.teacher_sampled_logprobs_NT.unsqueeze(-1)], dim=-1)
    else:  # teacher_topk, intersection: the support slots are the teacher's own top-K
        t_lp = t
    return ids, smask, t_lp


def _lsm_loss(x: ObjectiveInputs, cfg: ObjectiveOptions, update: UpdateOptions) -> torch.Tensor:
    ids, smask, t_lp = lsm_support(x, cfg.support)
    h, W, mask = x.hidden_NTD, x.head_VD, x.mask_NT
    if cfg.tail:
        return L.local_support_kl_tail_from_hidden(h, W, ids, t_lp, mask, support_mask=smask)
    share, renorm = cfg.forward_kl_share, cfg.renormalize
    return L.local_support_kl_from_hidden(h, W, ids, t_lp, mask, smask, forward_share=share, renormalize=renorm)


def _lsm_needs(cfg: ObjectiveOptions) -> frozenset[str]:
    extra = _SUPPORT_NEEDS.get(cfg.support)
    return frozenset({TOPK, extra} if extra else {TOPK})


def _lsm_check(cfg: ObjectiveOptions) -> str | None:
    if cfg.tail and not cfg.renormalize:
        return (
            "tail compares full-vocabulary masses plus the mass outside the support, in place of renormalizing; "
            "--no-renormalize (the truncated ablation) cannot go with it: drop --no-renormalize or --tail"
        )
    if cfg.forward_kl_share and not (cfg.renormalize and not cfg.tail):
        return _FORWARD_SHARE
    return None


_FORWARD_SHARE = (
    "forward_kl_share mixes the two KL directions on lsm's renormalized support: use it with --objective lsm, "
    "without --tail or --no-renormalize"
)


register(
    Objective(
        "lsm",
        "teacher top-K local support matching",
        _lsm_loss,
        _lsm_needs,
        mask_special=True,
        variants=("tail",),
        check=_lsm_check,
    )
)


# --- sampled: sampled-token OPD (a policy gradient on r_t = log q(y_t) - log p(y_t)) ------------


def _sampled_loss(x: ObjectiveInputs, cfg: ObjectiveOptions, update: UpdateOptions) -> torch.Tensor:
    """On policy, the reward reads the sampling policy's log-probs. Stale rollouts (``policy_logprobs_NT``
    given) are one documented composition: the reward r_t = log q - log pi reads the policy being
    updated, the PPO ratio (reused batches) is taken against that same policy, and the whole
    surrogate is scaled by the truncated importance weight min(pi / mu, stale_weight_cap) against
    the policy mu that sampled: loss_t = w_t * PPO(pi_theta / pi, A_t)."""
    logp = L.token_logprobs_from_hidden(x.hidden_NTD, x.head_VD, x.response_ids_NT)
    reward_logp = x.behaviour_logprobs_NT if x.policy_logprobs_NT is None else x.policy_logprobs_NT
    adv = L.sampled_token_advantages(
        reward_logp, x.teacher_sampled_logprobs_NT, x.mask_NT, cfg.gamma, action_mask_BT=x.action_mask_NT
    )
    clip = update.clip_eps if x.old_logprobs_NT is not None else None
    loss = L.sampled_token_pg_loss(logp, adv, x.mask_NT, x.old_logprobs_NT, clip)
    if x.policy_logprobs_NT is None:
        return loss
    w = L.truncated_importance_weight(reward_logp, x.behaviour_logprobs_NT, x.mask_NT, update.stale_weight_cap)
    return loss * w


register(
    Objective("sampled", "sampled-token OPD", _sampled_loss, lambda cfg: frozenset({SAMPLED}), policy_gradient=True)
)


# --- full_kl: the dense KL over the whole vocabulary -------------------------------------------


def _full_kl_loss(x: ObjectiveInputs, cfg: ObjectiveOptions, update: UpdateOptions) -> torch.Tensor:
    h, W = x.hidden_NTD, x.head_VD
    # The entry needs FULL, so the trainer gave the teacher's hidden states and head.
    h_t, W_t = cast(torch.Tensor, x.teacher_hidden_NTE), cast(L.HeadLike, x.teacher_head_VE)
    return L.full_vocab_kl_from_hidden(h, W, h_t, W_t, x.mask_NT, cfg.kl_direction, chunk_size=256)


register(
    Objective("full_kl", "KL over the whole vocabulary, --kl-direction", _full_kl_loss, lambda cfg: frozenset({FULL}))
)


def refusal(cfg: ObjectiveOptions, gives: frozenset[str], teacher: str) -> str | None:
    """Why a teacher that gives only ``gives`` cannot train ``cfg``'s objective, beginning
    "objective=... needs ..., which {teacher}" (``teacher``: e.g. "a vLLM-format server does not
    return"); None when it can."""
    missing = sorted(lookup(cfg.objective).needs(cfg) - gives)
    if not missing:
        return None
    what = f"support={cfg.support}" if missing[0] in _SUPPORT_NEEDS.values() else f"objective={cfg.objective}"
    return f"{what} needs {missing[0]}, which {teacher}"


def usable_with(gives: frozenset[str]) -> str:
    """The objectives (and supports) a teacher that gives only ``gives`` can train, as options to
    name in an error message: those usable with any support first."""
    anywhere, some = [], []
    for o in REGISTRY.values():
        fits = [s for s in L.SUPPORT_KINDS if o.needs(ObjectiveOptions(support=s)) <= gives]
        if len(fits) == len(L.SUPPORT_KINDS):
            anywhere.append(f"--objective {o.name}")
        elif fits:
            some.append(f"--objective {o.name} with --support {' or '.join(fits)}")
    return ", or ".join(anywhere + some)


def objectives_help() -> str:
    """The ``--objective`` help text, from the registry."""
    return "Training signal: " + ", ".join(f"{o.name} ({o.help})" for o in REGISTRY.values()) + "."


# --- the objective's options: declared here, with their checks; the config's TrainConfig holds them -----

DEFAULT_SPECIAL_TOKENS = ("<|im_end|>", "<think>", "</think>")
REDUCTIONS = ("token_mean", "sequence_mean", "constant_sum")


def _option(default: Any, help: str, per_task: bool = False) -> Any:
    """An option of the config's "objective" section, as :func:`opd.config.fields.opt` declares one (this
    module sits below the config, so it writes the field's metadata itself)."""
    meta = {"help": help, "per_task": per_task}
    if isinstance(default, list):
        value = default
        return field(default_factory=lambda: list(value), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ObjectiveOptions:
    """The objective section of a training run's options (``--objective``, ``--k``, ``--support``, ...),
    declared with the objectives that read them; :meth:`problem` is their check."""

    objective: str = _option("lsm", objectives_help())
    k: int = _option(32, "Support size K for lsm (and the top-K of the diagnostics).")
    support: str = _option("teacher_topk", f"Support set for lsm: {', '.join(L.SUPPORT_KINDS)}.")
    renormalize: bool = _option(
        True,
        "Renormalize student and teacher over the support (lsm). Off is the collapsing ablation.",
    )
    tail: bool = _option(
        False,
        "lsm with a tail bucket: KL over the support's tokens (full-vocabulary probabilities, not "
        "renormalized) plus one category for each model's mass outside the support, so the student's "
        "mass outside it is no longer free (TRL's loss_add_tail). Works with every --support and a "
        "served teacher (it needs only the teacher's top-K log-probs); replaces renormalization, so "
        "not with --no-renormalize. Costs a pass over the student's head per step.",
    )
    forward_kl_share: float = _option(
        0.0,
        "lsm: the share b of forward KL on the renormalized support, loss (1 - b) KL(student||teacher) + "
        "b KL(teacher||student). Reverse KL's pull on a token scales with the student's own probability of "
        "it, so a token the teacher wants and the student has all but dropped is barely pulled back; forward "
        "KL's pull does not shrink (docs/losses.md). 0: LSM as the paper has it.",
    )
    gamma: float = _option(0.0, "Discount of the sampled-token reward-to-go: 0 token level, 1 sequence level.")
    kl_direction: str = _option("reverse", "Direction of full_kl: reverse (KL(student||teacher)) or forward.")
    mask_special: bool | None = _option(
        None,
        "Leave positions whose sampled token is special (--special-tokens) out of the loss (default: on for "
        "lsm, off otherwise; settable per task). With teacher top-K LSM this also leaves a format token the "
        "teacher never ranks uncorrected; --tail corrects it at the positions before it is written.",
        per_task=True,
    )
    special_tokens: list[Any] = _option(list(DEFAULT_SPECIAL_TOKENS), "Tokens masked when mask_special is on.")
    reduction: str = _option(
        "token_mean",
        "Loss reduction: token_mean (over the batch's loss tokens), sequence_mean, or "
        "constant_sum (summed, divided by rollouts x max_new_tokens, a constant that "
        "does not depend on the batch, as in Dr. GRPO).",
    )

    def __bool__(self) -> bool:
        # the section shares its name with the option: `if cfg.objective:` would always hold (as opd.config's
        # Section refuses a truth test, which this module, below the config, cannot import)
        raise TypeError("ObjectiveOptions is a section of options, never true or false; read cfg.objective.objective")

    def problem(self) -> str | None:
        """What is wrong with these options, as one message naming the option and the fix; None: nothing.
        Each option's own range first, then what the chosen objective refuses of their combination."""
        entry = REGISTRY.get(self.objective)
        if entry is None:
            return f"objective={self.objective!r}: choose one of {', '.join(REGISTRY)}"
        checks = (
            (self.support in L.SUPPORT_KINDS, f"support={self.support!r}: choose one of {', '.join(L.SUPPORT_KINDS)}"),
            (self.k >= 1, f"k={self.k} must be >= 1; set --k to 1 or more"),
            (0.0 <= self.gamma <= 1.0, f"gamma={self.gamma} must lie in [0, 1]"),
            (self.kl_direction in ("reverse", "forward"), f"kl_direction={self.kl_direction!r}: reverse or forward"),
            (0.0 <= self.forward_kl_share <= 1.0, f"forward_kl_share={self.forward_kl_share} must lie in [0, 1]"),
            (not self.forward_kl_share or entry.name == "lsm", _FORWARD_SHARE),
            (self.reduction in REDUCTIONS, f"reduction={self.reduction!r}: token_mean, sequence_mean or constant_sum"),
        )
        for ok, message in checks:
            if not ok:
                return message
        for o in REGISTRY.values():  # a variant flag (--tail) set with an objective it is not a variant of
            for flag in o.variants:
                if getattr(self, flag) and flag not in entry.variants:
                    return (
                        f"{flag} is a variant of --objective {o.name}, not of {self.objective}; "
                        f"drop --{flag} or use --objective {o.name}"
                    )
        return entry.check(self)
