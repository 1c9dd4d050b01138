"""The token inspector's data: a compact per-token view of logged rollouts for the page.

For each run, up to ``max_steps`` logged steps (evenly spaced, first and last included) keep all
their rollouts. Per token: the display text, whether the loss sees it, the sampled token's student
and teacher log-probabilities, its loss, and the teacher's top-K ids with the teacher's and the
student's probabilities on them; for an episode also which tokens are the environment's (context:
none of those values), its turns with their rewards, and how it ended. Probabilities are stored as
integers in units of 1e-4 (bars cannot show finer), which keeps a 200-step demo's report near a
megabyte per run.

Usage::

    from opd.report.inspector import inspector_data
    data = inspector_data(run, max_steps=24)   # {"steps": [...], "rollouts": {"0": [...]}, "vocab": {...}}
"""

from __future__ import annotations

import math

from opd.report.load import RunData

PROB_SCALE = 10_000


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2, Qwen2): printable stand-ins back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_DECODER = _byte_decoder()


def display_token(token: str) -> str:
    """What a token reads as: byte-level stand-ins (``Ġ`` for a space) decoded, ``▁`` shown as a space."""
    if token and all(ch in BYTE_DECODER for ch in token):
        return bytes(BYTE_DECODER[ch] for ch in token).decode("utf-8", errors="replace")
    return token.replace("▁", " ")


def pick_steps(steps: list[int], max_steps: int) -> list[int]:
    """Up to ``max_steps`` of ``steps`` (sorted, unique), evenly spaced, first and last included."""
    steps = sorted(set(steps))
    if len(steps) <= max_steps:
        return steps
    if max_steps <= 1:
        return steps[-1:]
    idx = {round(i * (len(steps) - 1) / (max_steps - 1)) for i in range(max_steps)}
    return [steps[i] for i in sorted(idx)]


def _prob(logprob: float) -> int:
    return int(round(math.exp(logprob) * PROB_SCALE)) if math.isfinite(logprob) else 0


def _each(values: list, f) -> list:
    """``f`` of each value; None (an environment token's unscored field) stays None."""
    return [None if v is None else f(v) for v in values]


def _episode(r: dict) -> dict:
    """What the inspector shows of an episode beyond its tokens: which are the environment's, the
    turns with their rewards, and how it ended."""
    turns = [t for t in r.get("turns") or [] if isinstance(t, dict)]
    return {
        "env": [0 if a else 1 for a in r["action"]],
        "turns": [
            {k: t.get(k) for k in ("start", "end", "action", "reward", "observation")}
            for t in turns
            if isinstance(t.get("start"), int) and isinstance(t.get("end"), int)
        ],
        "outcome": {"won": bool(r.get("won")), "end": str(r.get("end", "")), "turns": len(turns)},
    }


def _rollout(r: dict) -> dict:
    return {
        "prompt": str(r.get("prompt", "")),
        "answer": str(r.get("answer", "")),
        "correct": None if r.get("correct") is None else bool(r.get("correct")),  # None: no answer, not graded
        "ids": r["token_ids"],
        "mask": [1 if m else 0 for m in r["loss_mask"]],
        "s": _each(r["student_logprobs"], lambda x: round(x, 3)),
        "t": _each(r["teacher_logprobs"], lambda x: round(x, 3)),
        "loss": _each(r["token_loss"], lambda x: round(x, 5)),
        "topk": r["teacher_topk_ids"],
        "tp": _each(r["teacher_topk_logprobs"], lambda row: [_prob(x) for x in row]),
        "sp": _each(r["student_topk_logprobs"], lambda row: [_prob(x) for x in row]),
        **(_episode(r) if "action" in r else {}),
    }


def inspector_data(run: RunData, max_steps: int = 24) -> dict:
    by_step: dict[int, list[dict]] = {}
    for r in run.rollouts:
        by_step.setdefault(r["step"], []).append(r)
    steps = pick_steps(list(by_step), max_steps)
    rollouts = {str(s): [_rollout(r) for r in by_step[s]] for s in steps}
    used = {i for rs in rollouts.values() for r in rs for i in r["ids"] + [j for row in r["topk"] if row for j in row]}
    vocab = {str(i): display_token(run.vocab[i]) for i in sorted(used) if i in run.vocab}
    return {
        "steps": steps,
        "logged_steps": len(by_step),
        "rollouts": rollouts,
        "vocab": vocab,
        "prob_scale": PROB_SCALE,
        "k": run.config.get("k"),
    }
