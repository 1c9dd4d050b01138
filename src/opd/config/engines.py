"""The rollout engine's options, the same in ``opd train`` and ``opd eval`` (:class:`EngineOptions`): which
engine (``--rollout-engine``), opd's own loop's static cache (``--static-cache``), and for ``vllm`` which
server (one opd starts per rank, or one shared server, ``--vllm-url``), vLLM's own options for the servers
opd starts (``--vllm-args``), the policy check's bound and how long to wait for the engine."""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from typing import Any

from opd.config.fields import ConfigError, Section, opt, require
from opd.config.sources import GenerationOptions
from opd.service import url_problem

# vLLM options opd sets on the servers it starts, from the run's own settings: given in --vllm-args they
# would make the engine serve another model, dtype or length than the trainer's, or put the key on a
# command line any user of the machine can read.
OPD_SETS = {
    "--model": "--student",
    "--dtype": "--dtype",
    "--max-model-len": "--max-prompt-tokens and --max-new-tokens",
    "--host": "opd (loopback)",
    "--port": "opd (a free port)",
    "--api-key": "OPD_VLLM_API_KEY (opd passes it in the server's environment)",
}


@dataclass(frozen=True)
class VLLMOptions(Section):
    """Options of ``--rollout-engine vllm`` (section "rollout")."""

    vllm_url: str = opt(
        "",
        "With --rollout-engine vllm: a vLLM server you started (in dev mode, VLLM_SERVER_DEV_MODE=1, reading "
        "--out at the same path; its API key, if any, from OPD_VLLM_API_KEY), shared by every rank: rank 0 "
        "gives it the weights, each rank sends its share of the prompts. Unset, opd starts one per rank on the "
        "student from opd vllm-setup's environment, on the rank's GPU(s).",
    )
    vllm_args: str = opt(
        "",
        "vLLM's own server options for the servers opd starts, passed through as a shell would split them, "
        "e.g. '--tensor-parallel-size 2' or '--gpu-memory-utilization 0.5' (which replaces "
        "opd's 0.3 where an engine shares a GPU with a trainer); a server that refuses one stops the run with "
        "its error line.",
    )
    vllm_sync: str = opt(
        "auto",
        "How the weights reach the vLLM engine after each update: file (a safetensors file in RUN/vllm/weights, "
        "reloaded in place), shm (the same in /dev/shm, memory-backed, for a server on this machine), adapter (a "
        "LoRA run: the adapter alone, loaded by a server with --enable-lora), or auto: adapter for a LoRA run on a "
        "server opd starts on GPUs (not with --vllm-sleep 2), else shm where /dev/shm has room and opd starts the "
        "server, else file.",
    )
    vllm_sleep: int = opt(
        0,
        "vLLM's sleep mode between rollouts, for engines opd starts beside a trainer on GPUs: after each rollout "
        "the engine frees its GPU memory for the training step and takes it back before the next weight sync. 1: "
        "the weights wait in CPU memory, the KV cache is dropped; 2: both are dropped (no copy in CPU memory; "
        "the sync writes the weights again: not with --vllm-sync adapter); 0: off, or 1 where --vllm-args has "
        "--enable-sleep-mode. opd adds --enable-sleep-mode to the servers it starts. opd train only (opd eval has "
        "no trainer to free the memory for).",
    )
    vllm_max_gap: float = opt(
        0.0,
        "The policy check: the most the vLLM engine's log-probs of the sampled tokens may differ from the "
        "student's, in nats per token on average, before the run stops (0: 1e-3 in float32, 0.05 otherwise).",
    )
    vllm_start_timeout: float = opt(600.0, "Seconds to wait for the vLLM server opd starts to become healthy.")
    vllm_wait: float = opt(
        600.0,
        "Seconds to wait for a vLLM engine that stops answering (at startup too), then checkpoint and stop; a "
        "server opd started that exits is restarted at once instead.",
    )

    @functools.cached_property
    def vllm_argv(self) -> tuple[str, ...]:
        """``--vllm-args`` as the list of options it stands for, split once (when the config is checked) as a
        shell would split it; every reader takes this, never the string."""
        return tuple(vllm_arg_list(self.vllm_args))


STATIC_CACHE = ("auto", "on", "off")  # --static-cache (opd.rollout.static_cache)


@dataclass(frozen=True)
class EngineOptions(GenerationOptions, VLLMOptions):
    """What generates the responses (section "rollout"): training's rollouts and evaluations, and ``opd eval``'s."""

    rollout_engine: str = opt(
        "hf",
        "What generates the rollouts and evaluation responses: hf (opd's own sampling loop: per-prompt seeded, "
        "resumable exactly), vllm (a vLLM server given the student's weights before every batch; opd vllm-setup; "
        "docs/scale-out.md), or an engine registered with opd.rollout.registry.register (docs/architecture.md).",
    )
    static_cache: str = opt(
        "off",
        "opd's own sampling loop (--rollout-engine hf) with a static KV cache: preallocated for the batch and its "
        "token budget, its decode step captured once as a CUDA graph and replayed (the same samples as the dynamic "
        "cache, which grows every step). auto: on a GPU (not with --fsdp); on: on the CPU too, without a graph; off: "
        "the dynamic cache. Off by default until its speed on a GPU is measured (benchmarks/bench_decode.py, "
        "docs/benchmarks.md): then auto becomes the default if it is faster.",
    )


def check_engine_options(
    cfg: EngineOptions, lora: bool = False, fsdp: bool = False, trains: bool = True, staleness: int = 0
) -> None:
    """The engine options of a run that trains a LoRA adapter or not, under FSDP or not, that trains or
    (``opd eval``) not, with rollouts ``staleness`` steps ahead (the engine's name is checked against the registry,
    opd.rollout.registry, when the engine is made)."""
    require(bool(cfg.rollout_engine), "rollout_engine is empty: give hf, vllm or a registered engine's name")
    require(
        cfg.static_cache in STATIC_CACHE,
        f"static_cache={cfg.static_cache!r}: choose one of {', '.join(STATIC_CACHE)}",
    )
    if cfg.static_cache == "on":  # auto does what the engine and the launch allow
        require(
            cfg.rollout_engine == "hf",
            f"static_cache=on is a setting of opd's own sampling loop (--rollout-engine hf), not of "
            f"{cfg.rollout_engine}; drop --static-cache on",
        )
        require(
            not fsdp,
            "static_cache=on does not run with --fsdp (the sharded forward gathers the weights in hooks that a CUDA "
            "graph cannot capture); use --static-cache auto or off",
        )
    check_vllm(cfg, cfg.rollout_engine, lora, trains, staleness)


def vllm_arg_list(args: str) -> list[str]:
    """``--vllm-args`` split as a shell would split it."""
    try:
        return shlex.split(args)
    except ValueError as exc:
        raise ConfigError(f"vllm_args={args!r} cannot be split into options ({exc}); check its quotes") from None


SYNC_WAYS = ("auto", "file", "shm", "adapter")  # opd.rollout.vllm_sync's
SLEEP_FLAG = "--enable-sleep-mode"  # the vLLM server option that opens its sleep mode


def check_vllm(cfg: VLLMOptions, engine: str, lora: bool, trains: bool = True, staleness: int = 0) -> None:
    """The vLLM options of a run whose engine is ``engine``, that trains a LoRA adapter or not, trains or not,
    with rollouts ``staleness`` steps ahead (:func:`resolve_vllm` has made their defaults explicit)."""
    require(
        cfg.vllm_max_gap >= 0 and cfg.vllm_start_timeout > 0 and cfg.vllm_wait >= 0,
        "vllm_max_gap must be >= 0, vllm_start_timeout > 0 and vllm_wait >= 0",
    )
    problem = url_problem(cfg.vllm_url, "--vllm-url") if cfg.vllm_url else ""
    require(not problem, problem)
    require(cfg.vllm_sync in SYNC_WAYS, f"vllm_sync={cfg.vllm_sync!r}: choose one of {', '.join(SYNC_WAYS)}")
    require(cfg.vllm_sleep in (0, 1, 2), f"vllm_sleep={cfg.vllm_sleep} must be 0 (off), 1 or 2 (vLLM's sleep levels)")
    require(
        lora or cfg.vllm_sync != "adapter",
        "--vllm-sync adapter sends the LoRA adapter alone, and this run trains none: add --lora-r, or drop it",
    )
    if engine != "vllm":
        given = [
            f"--{name.replace('_', '-')}" for name in ("vllm_url", "vllm_args", "vllm_sleep") if getattr(cfg, name)
        ]
        given += ["--vllm-sync"] if cfg.vllm_sync != "auto" else []
        require(not given, f"{' and '.join(given)} set but rollout_engine is {engine}; add --rollout-engine vllm")
        return
    args = cfg.vllm_argv
    require(
        not (args and cfg.vllm_url),
        "--vllm-args are the options of the servers opd starts, and --vllm-url names your own: start yours with "
        "them, and drop --vllm-args",
    )
    for arg in args:
        name = arg.split("=", 1)[0]
        require(
            name not in OPD_SETS,
            f"--vllm-args {name}: opd sets it on the servers it starts, from {OPD_SETS.get(name)}; drop it there",
        )
    require(
        not (cfg.vllm_sleep and cfg.vllm_url),
        "--vllm-sleep puts to sleep the servers opd starts, and --vllm-url names your own: drop one of them",
    )
    if cfg.vllm_sleep:
        _check_sleep(cfg, trains, staleness)


def resolve_vllm(values: dict[str, Any], trains: bool) -> dict[str, Any]:
    """``values`` (a config's options) with the vLLM engine's defaults that depend on other options made
    explicit: the policy check's bound where it is left at 0 (by ``--dtype``), and the sleep level where
    vLLM's sleep mode is asked for in ``--vllm-args`` (in a run that trains)."""
    if values["rollout_engine"] != "vllm":
        return values
    if trains and not values["vllm_sleep"] and SLEEP_FLAG in vllm_arg_list(values["vllm_args"]):
        values["vllm_sleep"] = 1  # asked for in vLLM's words: the level that keeps the weights
    if not values["vllm_max_gap"]:
        values["vllm_max_gap"] = 1e-3 if values["dtype"] == "float32" else 0.05
    return values


def sleep_flag(cfg: VLLMOptions) -> str:
    """The option that asked for vLLM's sleep mode, as it was given (to name it in an error)."""
    if cfg.vllm_sleep == 1 and SLEEP_FLAG in cfg.vllm_argv:
        return f"--vllm-args {SLEEP_FLAG}"
    return f"--vllm-sleep {cfg.vllm_sleep}"


def _check_sleep(cfg: VLLMOptions, trains: bool, staleness: int) -> None:
    """What the sleep mode between rollouts cannot do, known from the config (GPUs are checked when the
    engine starts): sleep in ``opd eval``, beside a staleness worker, or drop the weights an adapter sync
    does not send again."""
    flag = sleep_flag(cfg)
    require(
        trains,
        f"{flag}: opd eval has no trainer to free the GPU's memory for between rollouts; drop it",
    )
    require(
        not staleness,
        f"{flag} with --max-staleness: the rollout worker samples while the trainer trains, so the engine never "
        "rests; drop one of them",
    )
    require(
        not (cfg.vllm_sleep == 2 and cfg.vllm_sync == "adapter"),
        f"{flag} drops the engine's weights and --vllm-sync adapter sends the adapter alone: use --vllm-sleep 1, "
        "or --vllm-sync shm (or file)",
    )
