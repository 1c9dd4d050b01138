"""Rollouts from a vLLM server (``opd train --rollout-engine vllm``): a :class:`~opd.rollout.served.ServerEngine`
over vLLM's OpenAI-compatible completions endpoint, reached through opd's one HTTP client
(:class:`opd.service.Client`: its retry policy, ``--vllm-wait``, the key from ``OPD_VLLM_API_KEY``).

Before a rollout the student's current weights go to the engine (``--vllm-sync``, :mod:`opd.rollout.vllm_sync`):
one safetensors file (a LoRA adapter's update added to the weights) in the run's ``vllm/weights/`` folder or
in ``/dev/shm``, loaded in place by the server (``POST /collective_rpc`` with ``reload_weights``), or a LoRA
run's adapter alone, and the prefix cache reset (``POST /reset_prefix_cache``): vLLM's dev-mode endpoints
(``VLLM_SERVER_DEV_MODE=1``), outside ``/v1`` and so outside ``--api-key``'s reach, which is why the engine
must stay on loopback or a private network. Each prompt (each turn of an episode) is one completions request with its own ``seed`` (vLLM
batches concurrent requests), sampling with opd's temperature, top-p and top-k (``top_k`` -1 when off), and asks for the
sampled token's log-prob (``logprobs: 0``): with vLLM's default ``--logprobs-mode raw_logprobs`` that is
the unmodified policy's log-prob, the quantity opd's own sampler records and the policy check compares
(:mod:`opd.rollout.served`; its bound is ``--vllm-max-gap``).

**When the engine stops answering.** Requests are retried under ``--vllm-wait``. A server opd started
(``--vllm-url`` unset) that exited is started again, at once, at most :data:`MAX_RESTARTS` times a run,
and given the weights again; a server that stays silent past the wait stops the run, which checkpoints
the last completed step (:class:`~opd.rollout.engine.EngineUnavailable`). Under ``--max-staleness`` the
worker process reaches the trainer's engine (:meth:`VLLMRollout.handle`, :mod:`opd.rollout.reach`) without
waiting: finding it gone, it hands the request back (:class:`~opd.rollout.reach.EngineDown`), and the trainer, which owns the
engine, applies the same policy (:meth:`VLLMRollout.recover`) and sends the request again, to the
restarted server's new address.

What the HF loop guarantees and vLLM does not: vLLM's samples depend on its batch (which requests
run together), so a prompt's rollout is not a pure function of its seed; resumed runs and N-rank
runs do not reproduce single-process ones token for token. The default engine stays the HF loop.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as tdist

from opd.config import TrainConfig
from opd.config.engines import SLEEP_FLAG, EngineOptions, VLLMOptions, sleep_flag
from opd.errors import ServiceUnavailable, UserError
from opd.models.loading import model_device
from opd.models.precision import engine_dtype
from opd.rollout.engine import EngineContext, EngineUnavailable, Sample
from opd.rollout.reach import EngineDown, EngineHandle
from opd.rollout.served import Request, ServerEngine, SleepMode
from opd.rollout.vllm_server import Placement, VLLMServer, place_engine, start_vllm_server
from opd.rollout.vllm_sync import FolderSync, WeightSync, attach, choose, describe, server_options
from opd.service import VLLM_KEY_ENV, Client, Patience, api_key

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# vLLM's CPU build (0.32) dies on a seeded request whose prefill is split across steps (chunked prefill:
# a batch of prompts over its token budget): it rewinds the request's generator, which a CPU generator
# cannot do ("CPU Generator does not use offset", found with the demo's 64 prompts). Unsplit prefills
# never rewind; the scheduler then fits whole prompts into each step.
SEEDED_ON_CPU = ("--no-enable-chunked-prefill",)
MAX_RESTARTS = 2  # how often opd restarts the engine it started, in one run, when it exits
_T = TypeVar("_T")


class _Gone(ServiceUnavailable):
    """The client gave up on the engine: its wait spent, or the server opd started has exited."""


class _EngineClient(Client):
    """The engine's requests, with its errors: a refusal names the engine (and its log), silence is :class:`_Gone`."""

    def __init__(self, engine: VLLMRollout, url: str, **kw: Any):
        super().__init__(url, "--vllm-url", **kw)
        self.engine = engine

    def refused(self, path: str, code: int, message: str) -> UserError:
        return UserError(self.engine.failed(path, f"HTTP {code}: {message}"))

    def gave_up(self, path: str, attempts: int, seconds: float, reason: str) -> _Gone:
        return _Gone(
            f"{reason}; no answer after {attempts} attempts over {seconds:.0f} s, {self.patience.spent(attempts)}"
        )


class VLLMRollout(ServerEngine):
    """Rollouts from a vLLM server that is given the student's weights before each batch.

    ``server``: a server opd started (``relaunch`` starts it again; stopped by :meth:`close`), or ``url`` of
    one the user runs in dev mode. ``sync``: how the weights travel (:mod:`opd.rollout.vllm_sync`; by default
    a file in ``weights_dir``, which a user's server must read at the same path). ``max_gap``: the policy
    check's bound; ``wait``: ``--vllm-wait``; ``attached``: a staleness worker's view of the trainer's
    engine, which raises :class:`EngineDown` at the first silence (``wait`` 0) for its owner to handle.
    ``shared``: ``url`` is one server all the launch's ranks roll out from, which rank 0 syncs.
    ``sleep``: vLLM's sleep level between rollouts (``--vllm-sleep``; 0: awake throughout).
    ``patience``: more of :class:`~opd.service.Patience`'s options (an injected clock, for tests)."""

    name = "vllm"
    gap_option = "--vllm-max-gap"

    def __init__(
        self,
        model: PreTrainedModel,
        tok,
        weights_dir: Path,
        *,
        url: str = "",
        server: VLLMServer | None = None,
        relaunch: Callable[[], VLLMServer] | None = None,
        max_gap: float = 1e-3,
        concurrency: int = 64,
        timeout: float = 600.0,
        wait: float = 600.0,
        attached: bool = False,
        shared: bool = False,
        weights_dtype: torch.dtype | None = None,
        sync: WeightSync | None = None,
        sleep: int = 0,
        **patience: Any,
    ):
        super().__init__(model, tok.eos_token_id, tok.pad_token_id, max_gap=max_gap)
        self.server, self.relaunch, self.restarts = server, relaunch, 0
        self.way = sync or FolderSync("file", Path(weights_dir))
        self.concurrency, self.attached = concurrency, attached
        self.weights_dtype = weights_dtype  # the engine's compute dtype: what each sync writes
        self.shared = shared  # one server for all the launch's ranks (--vllm-url): rank 0 syncs it
        url = server.url if server else url
        how_long = dict(what="vLLM engine", wait_option="--vllm-wait", abandon=self._exited, **patience)
        self.client = _EngineClient(
            self, url, key=api_key(VLLM_KEY_ENV), timeout=timeout, patience=Patience(url, wait, **how_long)
        )
        try:
            self.model_name = self.base_name = self.client.model_name()  # an adapter's name once synced (adapter)
        except _Gone as gone:
            if attached:
                raise EngineDown(self.failed("/v1/models", str(gone))) from None
            raise UserError(self.failed("/v1/models", str(gone)) + "; start it, or fix --vllm-url") from None
        if sleep:
            self.sleep_mode = SleepMode(sleep, self._post_now)

    @property
    def url(self) -> str:
        return self.client.url

    def _exited(self) -> bool:
        return self.server is not None and self.server.process.poll() is not None

    def failed(self, path: str, why: str) -> str:
        """What went wrong at ``path``, with how to fix it and, for a server opd started, its log's error lines."""
        hint = ""
        if path in ("/collective_rpc", "/reset_prefix_cache"):
            hint = "; a vLLM server given with --vllm-url must run with VLLM_SERVER_DEV_MODE=1 and read --out's folder at the same path"
        elif path.startswith(("/sleep", "/wake_up")):
            hint = "; --vllm-sleep needs vLLM's sleep mode: a server on GPUs started with --enable-sleep-mode"
        elif path == "/v1/load_lora_adapter":
            hint = "; --vllm-sync adapter needs a server started with --enable-lora (and --max-lora-rank >= --lora-r) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
        if self.server is not None:
            hint += f"; from {self.server.log_path}:\n{self.server.log_tail()}"
        return f"the vLLM rollout engine at {self.url}{path} failed ({why}){hint}"

    # ------------------------------------------------------------------ weights
    def sync(self) -> None:
        """The student's current weights into the engine (:mod:`opd.rollout.vllm_sync`). A server the ranks
        share is synced by rank 0 while the others wait, and told which model name to sample; its failure is
        every rank's (each raises it: the run stops on every rank together)."""
        if not self.shared:
            self._restarting(self._sync, resync=False)
            return
        failure = None
        if tdist.get_rank() == 0:
            try:
                self._restarting(self._sync, resync=False)
            except UserError as exc:
                failure = exc
        down = None if failure is None else isinstance(failure, ServiceUnavailable)
        said = [(self.model_name, down, str(failure or ""))]
        tdist.broadcast_object_list(said, src=0)
        if failure is not None:
            raise failure
        self.model_name, down, why = said[0]
        if down is not None:
            raise (EngineUnavailable if down else UserError)(f"rank 0 could not sync the shared engine: {why}")

    def _post_now(self, path: str) -> None:
        """One POST to ``path`` (the sleep mode's), under the restart policy; not retried on a refusal."""
        self._restarting(lambda: self.client.request("POST", path, retry_5xx=False), resync=False)

    def _sync(self) -> None:
        self.model_name = self.way.push(self.model, self.client, self.weights_dtype) or self.base_name

    # ------------------------------------------------------------------ rollouts
    def complete(self, requests: list[Request]) -> list[Sample]:
        """Each request sent, together (vLLM batches them); the engine's restart policy around them."""
        return self._restarting(lambda: self._post(requests))

    def _post(self, requests: list[Request]) -> list[Sample]:
        def one(r: Request) -> Sample:
            choice = self.client.request("POST", "/v1/completions", self.payload(r))["choices"][0]
            return Sample(list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]), False)

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
            return list(pool.map(one, requests))

    def payload(self, r: Request) -> dict:
        """One completions request: raw log-probs of the sampled tokens, the token ids, stopping at EOS."""
        how = r.sampling
        top_k = how.top_k or -1  # vLLM's "off" (its default may not be)
        sampling = (
            {"temperature": 0.0} if how.greedy else {"temperature": how.temperature, "top_p": how.top_p, "top_k": top_k}
        )
        return {
            "model": self.model_name,
            "prompt": list(r.prompt),
            "max_tokens": r.max_tokens,
            **sampling,
            "seed": int(r.seed),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": [self.eos_id],
        }

    # ------------------------------------------------------------------ when it stops answering
    def _restarting(self, call: Callable[[], _T], resync: bool = True) -> _T:
        """``call()`` under the restart policy (see the module docstring); after a restart the new server
        is given the weights (``resync``) before ``call`` is tried again."""
        restarted = False
        while True:
            try:
                if restarted and resync:
                    self._sync()
                return call()
            except _Gone as gone:
                if not self._exited():
                    kind = EngineDown if self.attached else EngineUnavailable
                    raise kind(self.failed("", str(gone))) from None
                self._restart(str(gone))
                restarted = True

    def _restart(self, why: str) -> None:
        """opd's own engine exited: start it again (it loads the student's directory, so the caller gives it
        the current weights), at most ``MAX_RESTARTS`` times a run."""
        if self.relaunch is None or self.restarts >= MAX_RESTARTS:
            raise EngineUnavailable(self.failed("", f"{why}; the engine exited ({self.restarts} restarts)")) from None
        self.restarts += 1
        print(
            f"opd train: the vLLM engine exited ({why}); restarting it ({self.restarts} of {MAX_RESTARTS})",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.server = self.relaunch()
        except UserError as exc:  # it would not start again: stop as for an engine gone for good
            raise EngineUnavailable(str(exc)) from None
        self.client.url = self.client.patience.url = self.server.url
        self.stale = True  # the new server holds the student's first weights, awake
        if self.sleep_mode is not None:
            self.sleep_mode.asleep = False

    def handle(self) -> EngineHandle:
        return EngineHandle(self.name, (self.url, describe(self.way), self.max_gap))

    def recover(self, down: EngineDown) -> None:
        """A staleness worker found the engine gone: restart it when opd started it and it exited, else
        wait for it (``--vllm-wait``); EngineUnavailable when it cannot be brought back."""
        if not self._exited():
            try:
                self.client.request("GET", "/v1/models")
                return
            except _Gone as gone:
                if not self._exited():
                    raise EngineUnavailable(self.failed("", str(gone))) from None
        self._restart("the rollout worker's requests got no answer")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if not self.attached:  # a staleness worker's view leaves the owner's folder alone
            self.way.close()


def rank_placement(engine: EngineOptions, model) -> Placement:
    """This rank's engine's GPUs (:func:`~opd.rollout.vllm_server.place_engine`), from the launcher's
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, the GPUs torch sees and where the trainer computes."""
    return place_engine(
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        torch.cuda.device_count(),
        trainer_on_gpu=model_device(model).type == "cuda",
        vllm_args=engine.vllm_argv,
        visible=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    )


def start_vllm(ctx: EngineContext) -> VLLMRollout:
    """The registry's ``vllm`` engine: a server opd starts on the student's directory (``--vllm-url`` unset),
    one per rank, on the rank's GPUs (:func:`rank_placement`) with ``--vllm-args``; or the user's, which all
    the launch's ranks share (rank 0 syncs it). Its log and the synced weights in ``ctx.folder``. Its context
    holds the longest prompt plus response of any task. In a staleness worker (``ctx.attach``): the
    trainer's engine, reached."""
    cfg = ctx.cfg
    if ctx.attach is not None:
        url, way, max_gap = ctx.attach
        return VLLMRollout(
            ctx.model,
            ctx.tokenizer,
            Path(),
            sync=attach(way),
            url=url,
            max_gap=max_gap,
            wait=0.0,
            attached=True,
            weights_dtype=engine_dtype(cfg.model.dtype),
        )
    shared = ctx.world > 1 and bool(cfg.rollout.vllm_url)
    if shared and isinstance(cfg, TrainConfig) and cfg.rollout.max_staleness:  # opd eval's config has no staleness
        raise UserError(
            "--max-staleness with one server shared by several ranks (--vllm-url): each rank's rollout worker "
            "would reload its weights at its own moment; leave --vllm-url out (opd starts a server per rank), or "
            "train with --max-staleness 0"
        )
    worst = max((cfg, *ctx.task_cfgs), key=lambda c: c.data.max_prompt_tokens + c.rollout.max_new_tokens)
    context = worst.data.max_prompt_tokens + worst.rollout.max_new_tokens
    limit = getattr(ctx.model.config, "max_position_embeddings", None) or context
    if context > limit:
        raise UserError(
            f"--max-prompt-tokens {worst.data.max_prompt_tokens} + --max-new-tokens {worst.rollout.max_new_tokens} = {context} "
            f"tokens exceed the student's context ({limit}, max_position_embeddings); lower one of them"
        )
    own, gpus = not cfg.rollout.vllm_url, torch.cuda.is_available()
    way = choose(
        cfg.rollout.vllm_sync,
        ctx.model,
        ctx.folder,
        own_server=own,
        dtype=engine_dtype(cfg.model.dtype),
        on_gpu=gpus,
        sleep=cfg.rollout.vllm_sleep,
    )
    user_args = cfg.rollout.vllm_argv
    way_args, way_env = server_options(way, cfg.lora.lora_r if isinstance(cfg, TrainConfig) else 0, user_args)
    way_args += sleep_options(cfg.rollout, gpus, user_args)
    launch = functools.partial(
        start_vllm_server,
        ctx.model_dir or cfg.model.student,
        ctx.folder / "server.log",
        dtype=cfg.model.dtype,
        max_model_len=context,
        dev_mode=True,
        extra_args=[*(SEEDED_ON_CPU if not torch.cuda.is_available() else ()), *way_args, *user_args],
        extra_env=way_env,
        placement=rank_placement(cfg.rollout, ctx.model),
        timeout=cfg.rollout.vllm_start_timeout,
    )
    server = None if cfg.rollout.vllm_url else launch()
    try:
        return VLLMRollout(
            ctx.model,
            ctx.tokenizer,
            ctx.folder / "weights",
            sync=way,
            url=cfg.rollout.vllm_url,
            server=server,
            relaunch=None if cfg.rollout.vllm_url else launch,
            max_gap=cfg.rollout.vllm_max_gap,
            wait=cfg.rollout.vllm_wait,
            shared=shared,
            weights_dtype=engine_dtype(cfg.model.dtype),
            sleep=cfg.rollout.vllm_sleep,
        )
    except BaseException:
        if server is not None:
            server.stop()
        way.close()
        raise


def sleep_options(engine: VLLMOptions, gpus: bool, user_args: Sequence[str]) -> list[str]:
    """The server options the sleep mode needs (``--enable-sleep-mode``, unless given), refused without GPUs
    (what the config alone shows it cannot do is refused when the config is made,
    :func:`opd.config.engines.check_vllm`)."""
    if not engine.vllm_sleep:
        return []
    if not gpus:
        raise UserError(f"{sleep_flag(engine)}: vLLM's sleep mode runs on GPUs only, and torch sees none here; drop it")
    return [] if SLEEP_FLAG in user_args else [SLEEP_FLAG]
