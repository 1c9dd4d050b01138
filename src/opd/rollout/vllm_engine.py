"""Rollouts from a vLLM server (``opd train --rollout-engine vllm``), behind :class:`~opd.rollout.sampling.RolloutEngine`.

Before every rollout the student's current weights go to the engine: written as one safetensors
file into the run's ``vllm/weights/`` folder (atomically; a LoRA adapter's update added to them),
loaded in place by the server (``POST /collective_rpc`` with ``reload_weights``), and its prefix cache
reset (``POST /reset_prefix_cache``): both are vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``),
outside ``/v1`` and so outside ``--api-key``'s reach, which is why the engine must stay on loopback or a
private network. Each prompt is one completions request with its own ``seed`` (vLLM batches
concurrent requests), sampling with opd's temperature and top-p (``top_k`` off), and asks for the
sampled token's log-prob (``logprobs: 0``): with vLLM's default ``--logprobs-mode raw_logprobs`` that is
the unmodified policy's log-prob, the quantity opd's own sampler records.

**The policy check.** The engine could serve other weights than the trainer's (a failed or skipped
reload, another dtype, a kernel bug) and nothing would fail: the run would train on another policy's
samples. So after each rollout the trainer's student scores the sampled tokens itself (one forward
pass without gradients) and the mean absolute gap between the two log-probs per sampled token is
logged (``rollout/engine_logprob_gap``); past ``--vllm-max-gap`` the run stops with an error.

What the HF loop guarantees and vLLM does not: vLLM's samples depend on its batch (which requests
run together), so a prompt's rollout is not a pure function of its seed; resumed runs and N-rank
runs do not reproduce single-process ones token for token. The default engine stays the HF loop.
"""

from __future__ import annotations

import functools
import http.client
import itertools
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from opd.errors import ServiceUnavailable, UserError
from opd.losses import topk_and_gather_from_hidden
from opd.models.loading import final_hidden, head_weight, model_device
from opd.rollout.sampling import RolloutBatch
from opd.rollout.vllm_server import VLLMServer, start_vllm_server

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# vLLM's CPU build (0.32) dies on a seeded request whose prefill is split across steps (chunked prefill:
# a batch of prompts over its token budget): it rewinds the request's generator, which a CPU generator
# cannot do ("CPU Generator does not use offset", found with the demo's 64 prompts). Unsplit prefills
# never rewind; the scheduler then fits whole prompts into each step.
SEEDED_ON_CPU = ("--no-enable-chunked-prefill",)
WAIT_S = 600.0  # how long a --vllm-url engine that stops answering is waited for
MAX_RESTARTS = 2  # how often opd restarts the engine it started, in one run, when it exits


class EngineUnavailable(ServiceUnavailable):
    """The vLLM rollout engine stopped answering and could not be brought back: the trainer checkpoints
    the last completed step and stops."""


class _Down(Exception):
    """A request to the engine got no answer (refused, reset, timed out, 5xx): it may come back."""


def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The student's weights under their Hugging Face names, as a plain model would save them, with a LoRA
    adapter's update added to the weights it adapts. Computed beside the model (peft's
    ``get_delta_weight``), not by merging and unmerging it in place, whose float rounding would creep
    into the trained base weights at every sync."""
    from opd.models.lora import is_lora

    state = _plain_state(model)
    if not is_lora(model):
        return state
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
                for adapter in module.active_adapters:
                    state[f"{name}.base_layer.weight"] += module.get_delta_weight(adapter).to(
                        "cpu", state[f"{name}.base_layer.weight"].dtype
                    )
    return {
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
        for k, v in state.items()
        if ".lora_" not in k
    }


def _plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Tied copies (the head of a tied model) are written too, each its own tensor: vLLM's in-place reload
    # refills its head from lm_head.weight and leaves it stale without it ("ParallelLMHead: Failed to load").
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


class VLLMRollout:
    """Single-turn rollouts from a vLLM server that is given the student's weights before each batch.

    ``server``: a server opd started (stopped by :meth:`close`), or ``url`` of one the user runs in dev
    mode that can read ``weights_dir`` at the same path. ``max_gap``: the policy check's bound on the
    mean absolute log-prob gap per sampled token."""

    def __init__(
        self,
        model: PreTrainedModel,
        tok,
        weights_dir: Path,
        *,
        url: str = "",
        server: VLLMServer | None = None,
        relaunch: Callable[[], VLLMServer] | None = None,
        api_key: str = "",
        max_gap: float = 1e-3,
        concurrency: int = 64,
        timeout: float = 600.0,
    ):
        self.model, self.eos_id, self.pad_id = model, tok.eos_token_id, tok.pad_token_id
        self.server, self.url = server, (server.url if server else url).rstrip("/").removesuffix("/v1")
        self.weights_dir, self.max_gap = Path(weights_dir), max_gap
        self.headers = {
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        }
        self.concurrency, self.timeout = concurrency, timeout
        self.relaunch, self.restarts = relaunch, 0
        self.stale, self.watched = True, False
        try:
            self.model_name = self._call("GET", "/v1/models")["data"][0]["id"]
        except _Down as down:
            raise UserError(self._failed("/v1/models", str(down)) + "; start it, or fix --vllm-url") from None
        self.last_gap = float("nan")

    # ------------------------------------------------------------------ HTTP
    def _call(self, method: str, path: str, payload: dict | None = None, retry_5xx: bool = True):
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as err:
            said = f"HTTP {err.code}: {err.read()[:300].decode(errors='replace')}"
            if (err.code >= 500 and retry_5xx) or err.code in (408, 429):
                raise _Down(said) from None
            raise UserError(self._failed(path, said)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            raise _Down(str(getattr(err, "reason", err)) or type(err).__name__) from None
        return json.loads(body) if body.strip() else None

    def _failed(self, path: str, why: str) -> str:
        hint = ""
        if path in ("/collective_rpc", "/reset_prefix_cache"):
            hint = "; a vLLM server given with --vllm-url must run with VLLM_SERVER_DEV_MODE=1 and read --out's folder at the same path"
        if self.server is not None:
            hint += f"; the last lines of {self.server.log_path}:\n{self.server.log_tail()}"
        return f"the vLLM rollout engine at {self.url}{path} failed ({why}){hint}"

    # ------------------------------------------------------------------ weights
    def sync(self) -> None:
        """The student's current weights into the engine, and its prefix cache reset (it holds keys and
        values computed with the old weights)."""
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        path = self.weights_dir / "model.safetensors"
        tmp = path.with_name(path.name + ".tmp")  # not *.safetensors: the loader never reads a half-written file
        save_file(merged_weights(self.model), tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir.resolve())}}
        self._call("POST", "/collective_rpc", rpc, retry_5xx=False)  # a folder it cannot read stays so
        self._call("POST", "/reset_prefix_cache")

    def weights_changed(self, *_) -> None:
        """The student's weights changed (an optimizer step): the next rollout syncs them first. Hooked to
        the optimizer by :meth:`watch`; without one, every rollout syncs."""
        self.stale = True

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Sync only after the weights change, so the tasks of a multi-task step share one sync."""
        optimizer.register_step_post_hook(self.weights_changed)
        self.watched = True

    # ------------------------------------------------------------------ rollouts
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> RolloutBatch:
        """Single-turn rollouts of the student's current weights, checked against it (the policy check)."""
        self.begin()
        sampling = self.sampling(temperature, top_p, greedy)
        payloads = [self.payload(p, s, max_new_tokens, sampling) for p, s in zip(prompt_ids, seeds, strict=True)]
        batch = self._batch(prompt_ids, self.complete(payloads))
        self.check_policy(batch)
        return batch

    def begin(self) -> None:
        """A rollout starts: without an optimizer watched, the weights may have changed since the last."""
        if not self.watched:
            self.stale = True

    @staticmethod
    def sampling(temperature: float, top_p: float, greedy: bool) -> dict:
        return {"temperature": 0.0} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": -1}

    def payload(self, prompt: Sequence[int], seed: int, max_tokens: int, sampling: dict) -> dict:
        """One completions request: raw log-probs of the sampled tokens, the token ids, stopping at EOS."""
        return {
            "model": self.model_name,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            **sampling,
            "seed": int(seed),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": [self.eos_id],
        }

    def complete(self, payloads: list[dict]) -> list[dict]:
        """Each request's first choice, sent together (vLLM batches them), once the engine has the current
        weights. An engine that stops answering is restarted when opd started it (it exited), else
        waited for up to ``WAIT_S`` seconds; then :class:`EngineUnavailable`."""
        first_failure = None
        for attempt in itertools.count():
            try:
                if self.stale:
                    self.sync()
                    self.stale = False
                return self._complete(payloads)
            except _Down as down:
                now = time.monotonic()
                first_failure = first_failure or now
                if self.server is not None and self.server.process.poll() is not None:
                    self._restart(str(down))
                    continue
                if now - first_failure >= WAIT_S:
                    raise EngineUnavailable(
                        self._failed("", f"{down}; no answer for {now - first_failure:.0f} s")
                    ) from None
                if attempt == 0:  # a wait of minutes must not look like a hang
                    print(
                        f"opd train: the vLLM engine at {self.url} does not answer ({down}); waiting up to {WAIT_S:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(min(0.5 * 2**attempt, 15.0, WAIT_S - (now - first_failure)))
        raise AssertionError("unreachable: the loop returns or raises")

    def _complete(self, payloads: list[dict]) -> list[dict]:
        def one(payload: dict) -> dict:
            return self._call("POST", "/v1/completions", payload)["choices"][0]

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(payloads)))) as pool:
            return list(pool.map(one, payloads))

    def _restart(self, why: str) -> None:
        """opd's own engine exited: start it again (it loads the student's directory, so the retried
        request syncs the current weights first), at most ``MAX_RESTARTS`` times a run."""
        if self.relaunch is None or self.restarts >= MAX_RESTARTS:
            raise EngineUnavailable(self._failed("", f"{why}; the engine exited ({self.restarts} restarts)")) from None
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
        self.url, self.stale = self.server.url, True

    def cut_at_eos(self, choice: dict) -> tuple[list[int], list[float], bool]:
        """A choice's sampled ids and their log-probs up to and with the first EOS; whether it wrote one."""
        ids, lps = list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if self.eos_id in ids:
            end = ids.index(self.eos_id) + 1
            return ids[:end], lps[:end], True
        return ids, lps, False

    def _batch(self, prompt_ids: Sequence[Sequence[int]], choices: list[dict]) -> RolloutBatch:
        """Left-padded prompts and responses cut after their first EOS, as :class:`HFRollout` makes them."""
        dev = model_device(self.model)
        N, P = len(prompt_ids), max(len(p) for p in prompt_ids)
        responses, logps, _ = zip(*map(self.cut_at_eos, choices), strict=True)
        T = max(1, max(len(r) for r in responses))
        input_NL = torch.full((N, P + T), self.pad_id, dtype=torch.long)
        attn_NL = torch.zeros((N, P + T), dtype=torch.long)
        mask_NT, lp_NT = torch.zeros((N, T), dtype=torch.bool), torch.zeros((N, T))
        for n, (p, r, lp) in enumerate(zip(prompt_ids, responses, logps)):
            input_NL[n, P - len(p) : P] = torch.as_tensor(list(p))
            attn_NL[n, P - len(p) : P + len(r)] = 1
            input_NL[n, P : P + len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask_NT[n, : len(r)] = True
            lp_NT[n, : len(r)] = torch.as_tensor(lp)
        finished_N = torch.tensor([bool(r) and r[-1] == self.eos_id for r in responses])
        response_NT = input_NL[:, P:]
        return RolloutBatch(
            input_NL.to(dev),
            attn_NL.to(dev),
            P,
            response_NT.to(dev),
            mask_NT.to(dev),
            lp_NT.to(dev),
            finished_N.to(dev),
        )

    @torch.no_grad()
    def check_policy(self, batch: RolloutBatch) -> None:
        """The engine's log-probs of the sampled tokens against the student's own (see the module's docstring)."""
        h_NLD = final_hidden(self.model, batch.input_ids_NL, batch.attention_mask_NL)
        h_NTD = h_NLD[:, batch.prompt_len - 1 : -1]  # hidden row j predicts token j + 1
        _, _, ours_NT1 = topk_and_gather_from_hidden(
            h_NTD, head_weight(self.model), 1, batch.response_ids_NT[..., None]
        )
        gap = (ours_NT1[..., 0].float() - batch.logprobs_NT.float()).abs()[batch.action_mask_NT]
        self.last_gap = float(gap.mean()) if gap.numel() else 0.0
        if self.last_gap > self.max_gap:
            raise UserError(
                f"the vLLM rollout engine does not serve the policy being trained: its log-probs of the sampled "
                f"tokens differ from the student's by {self.last_gap:.3g} nats on average (largest "
                f"{float(gap.max()):.3g}; --vllm-max-gap {self.max_gap:g}); the weight sync failed, or the engine "
                "runs another dtype or model: check its log, or raise --vllm-max-gap for a lower-precision engine"
            )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_engine(model, tok, student_dir: str, folder: Path, cfg, task_cfgs=(), api_key: str = "") -> VLLMRollout:
    """The engine of ``opd train --rollout-engine vllm``: a server opd starts on the student's directory
    (``--vllm-url`` unset), or the user's; its log and the synced weights in ``folder``. Its context
    holds the longest prompt plus response of any task (``task_cfgs``: a multi-task run's tasks)."""
    server = None
    worst = max((cfg, *task_cfgs), key=lambda c: c.max_prompt_tokens + c.max_new_tokens)
    context = worst.max_prompt_tokens + worst.max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None) or context
    if context > limit:
        raise UserError(
            f"--max-prompt-tokens {worst.max_prompt_tokens} + --max-new-tokens {worst.max_new_tokens} = {context} "
            f"tokens exceed the student's context ({limit}, max_position_embeddings); lower one of them"
        )
    launch = functools.partial(
        start_vllm_server,
        student_dir,
        folder / "server.log",
        dtype=cfg.dtype,
        max_model_len=context,
        dev_mode=True,
        extra_args=SEEDED_ON_CPU if not torch.cuda.is_available() else (),
        timeout=cfg.vllm_start_timeout,
    )
    if not cfg.vllm_url:
        server = launch()
    try:
        return VLLMRollout(
            model,
            tok,
            folder / "weights",
            url=cfg.vllm_url,
            server=server,
            relaunch=None if cfg.vllm_url else launch,
            api_key=api_key,
            max_gap=cfg.vllm_max_gap,
        )
    except BaseException:
        if server is not None:
            server.stop()
        raise
