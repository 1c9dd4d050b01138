"""AdamW with linear warm-up and a constant, linear or cosine schedule (shared by OPD and SFT)."""

from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


def make_scheduler(
    opt: torch.optim.Optimizer, warmup: int, total: int, schedule: str
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def rng_state(device: torch.device = torch.device("cpu")) -> dict:
    """The CPU generator's state, and this process's GPU's when it computes on one (only its own:
    a run may resume on a machine that shows a different set of GPUs)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(
    state: dict | list[dict], rank: int = 0, world: int = 1, device: torch.device = torch.device("cpu")
) -> None:
    """Restore a saved state: one dict, or (data-parallel runs) one per rank, indexed by rank.

    A run resumed with a different number of ranks keeps its seeded state instead: sampling and
    data order are derived from seeds and the step, not from this generator.
    """
    if isinstance(state, list):
        if len(state) != world:
            return
        state = state[rank]
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
