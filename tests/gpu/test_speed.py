"""What opd's device paths cost at real shapes, recorded for the card, with the checks they carry:

* loss steps: forward+backward time and peak device memory of LSM from hidden states, the tail bucket, LSM
  from logits, sampled-token OPD and full-vocabulary KL (from logits and from hidden) at V=151936, d=1536,
  T=4096, K=32 in float32 and bfloat16 (benchmarks/bench_losses.py's step builders, inputs made on the
  device); the check: every gradient there and finite. ``peak_extra_MB``: torch.cuda.max_memory_allocated
  during the step (reset before it) minus what was allocated before it, the gradients of h and W included
  (``peak_beyond_grads_MB`` leaves them out); not measured on the CPU.
* sampling: opd's HF sampling loop (opd.rollout.sampling.HFRollout, KV cache, top-p 0.9) on a
  Qwen2.5-0.5B-shaped model with random weights, float32 and bfloat16, batch 16 and 64, and HF generate
  (dynamic cache) beside it: tokens/s; the check: every row writes all its new tokens (EOS never).
  HF generate with its static cache (compiled): benchmarks/bench_decode.py's ``HF static`` rows.

Timings are medians after a warm-up; they are measurements for the card, never asserted.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import pytest
import torch

from .conftest import DRY_RUN, NOT_IN_DRY_RUN, benchmark, sync

pytestmark = pytest.mark.gpu
VARIANTS = ["lsm_hidden", "lsm_tail_hidden", "lsm_logits", "sampled", "full_kl", "full_kl_hidden"]
V, D, T, K = (2048, 64, 128, 32) if DRY_RUN else (151936, 1536, 4096, 32)
CHUNKS = dict(kl_chunk=512, kl_hidden_chunk=128, tail_chunk=128)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def loss_inputs(variant: str, dt: torch.dtype, dev: torch.device) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float32)
    x = {
        "W": (rnd(V, D) * (2.0 / math.sqrt(D))).to(dt).requires_grad_(),
        "h": rnd(1, T, D).to(dt).requires_grad_(),
        "mask": torch.ones(1, T, dtype=torch.bool, device=dev),
    }
    if variant in ("lsm_hidden", "lsm_tail_hidden", "lsm_logits"):  # as bench_losses.make_inputs
        base = torch.randint(0, V, (1, T, 1), generator=g, device=dev)
        x["ids"] = (base + torch.arange(K, device=dev) * (V // K)) % V
        lp = torch.log_softmax(2.0 * rnd(1, T, K), -1) - 0.3
        x["lp"] = lp.sort(-1, descending=True).values.to(dt)
    elif variant == "sampled":
        x["y"] = torch.randint(0, V, (1, T), generator=g, device=dev)
        x["t_logp"] = (-3.0 * torch.rand(1, T, generator=g, device=dev)).to(dt)
    elif variant == "full_kl":
        x["t_logits"] = (rnd(1, T, V) * 2.0).to(dt)
    elif variant == "full_kl_hidden":
        x["Wt"] = (rnd(V, D) * (2.0 / math.sqrt(D))).to(dt)
        x["ht"] = rnd(1, T, D).to(dt)
    return x


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_step(variant, dtype, device, record_property):
    BL = benchmark("bench_losses")  # its step builders and analytic FLOPs

    warmup, repeats = (1, 3) if device.type == "cpu" else (2, 5)
    gc.collect()  # what an earlier test that failed (out of memory) left behind
    if device.type == "cuda":
        torch.cuda.empty_cache()
    x = loss_inputs(variant, DTYPES[dtype], device)
    step = BL.build_step(variant, x, K, **CHUNKS)
    params = [x["W"], x["h"]]
    grads_mb = sum(p.numel() * p.element_size() for p in params) / 1e6
    times, peaks = [], []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            if device.type == "cuda":
                peaks.append((torch.cuda.max_memory_allocated(device) - base) / 1e6)
    flops, _ = BL.analytic(variant, T, V, D, D, K, CHUNKS["kl_hidden_chunk"], CHUNKS["tail_chunk"])
    med = statistics.median(times)
    record_property("shape", dict(V=V, d=D, T=T, K=K))
    record_property("median_ms", round(1e3 * med, 3))
    record_property("TFLOPs", float(f"{flops / med / 1e12:.4g}"))
    if peaks:
        record_property("peak_extra_MB", round(max(peaks), 1))
        record_property("peak_beyond_grads_MB", round(max(peaks) - grads_mb, 1))
    for name, p in zip("Wh", params):
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), f"grad of {name} missing or not finite"


# Final-norm gain: random-init logits have std ~0.02 * sqrt(896) ~ 0.6 (near uniform: the top-p 0.9 nucleus
# holds most of the vocabulary and opd's sampler falls back to a full sort, see NUCLEUS_CANDIDATES); x13
# gives std ~8, whose nucleus is a few tokens (median ~6 for Gaussian logits), like a trained model's.
LOGIT_SCALE = 13.0
NEW = 32 if DRY_RUN else 128


@pytest.fixture(scope="module")
def rollout_model(device):
    """Qwen2.5-0.5B's shape (its config.json), random weights, peaked logits (a tiny 2-layer one in the dry run)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864)
    if DRY_RUN:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    cfg = Qwen2Config(
        **shape,
        num_key_value_heads=2,
        vocab_size=2048 if DRY_RUN else 151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_SCALE)
    return model.eval()


def prompts(batch: int, vocab: int) -> list[list[int]]:
    P = 16 if DRY_RUN else 64
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(P - 8, P + 1, (batch,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def timed(fn, dev, repeats: int = 2):
    """(median seconds, last output) of ``fn`` after an untimed warm-up call."""
    fn()
    times, out = [], None
    for _ in range(repeats):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


@pytest.mark.parametrize(
    "dtype,batch,logits",
    [
        ("float32", 16, "peaked"),
        *(pytest.param(*p, marks=NOT_IN_DRY_RUN) for p in [("float32", 64, "peaked"), ("bfloat16", 16, "peaked")]),
        ("bfloat16", 64, "peaked"),
        ("bfloat16", 64, "flat"),  # random init's near-uniform logits: the sampler's full-sort fallback
    ],
)
def test_sampling_loop(dtype, batch, logits, rollout_model, device, record_property):
    from opd.rollout.sampling import HFRollout, left_pad

    model = rollout_model.to(DTYPES[dtype])
    gain = 1.0 if logits == "peaked" else 1.0 / LOGIT_SCALE
    ps = prompts(batch, model.config.vocab_size)
    engine = HFRollout(model, eos_id=-1, pad_id=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(gain)
    try:
        med, out = timed(lambda: engine.generate(ps, list(range(batch)), max_new_tokens=NEW, top_p=0.9), device)
        ids, attn = (x.to(device) for x in left_pad(ps, 0))
        with torch.no_grad():
            last = model(input_ids=ids, attention_mask=attn, logits_to_keep=1).logits[:, -1].float()
    finally:
        with torch.no_grad():
            model.model.norm.weight.div_(gain)
    p = torch.softmax(last, -1).sort(-1, descending=True).values
    tokens = int(out.response_mask_NT.sum())
    record_property("tokens_per_s", round(tokens / med, 1))
    record_property("ms_per_decode_step", round(1e3 * med / NEW, 2))
    record_property("nucleus_tokens_median", float(((p.cumsum(-1) - p) < 0.9).sum(-1).float().median()))
    record_property("top1_prob_median", float(p[:, 0].median()))
    if device.type == "cuda":
        record_property("max_memory_MB", round(torch.cuda.max_memory_allocated(device) / 1e6, 1))
    assert tokens == batch * NEW, f"{tokens} tokens generated, {batch * NEW} expected"


def test_hf_generate_dynamic_cache(rollout_model, device, record_property):
    """HF generate (DynamicCache) at bfloat16 and batch 64: the reference point beside opd's loop."""
    from opd.rollout.sampling import left_pad

    model, batch = rollout_model.to(torch.bfloat16), 64
    ids, attn = (x.to(device) for x in left_pad(prompts(batch, model.config.vocab_size), 0))
    model.generation_config.eos_token_id = None
    kw = dict(do_sample=True, top_p=0.9, top_k=0, temperature=1.0, max_new_tokens=NEW, pad_token_id=0)
    med, out = timed(lambda: model.generate(input_ids=ids, attention_mask=attn, **kw), device)
    record_property("tokens_per_s", round((out.shape[1] - ids.shape[1]) * batch / med, 1))
    assert out.shape[1] - ids.shape[1] == NEW
