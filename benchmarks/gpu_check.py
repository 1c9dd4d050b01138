#!/usr/bin/env python
"""One-shot device check of opd on a GPU: its losses, training paths and costs, in at most ~8 minutes.

Sections (each in a fresh subprocess, with a wall-clock budget; ``--skip a,b`` leaves some out):

  env            torch / CUDA / GPU / transformers versions, the opd commit, the fp32-matmul (TF32) settings
  losses         every opd loss on the device in float32 and bfloat16, values and gradients, against the
                 float64 loop reference of tests/reference.py computed on the CPU from the same (rounded)
                 inputs; masks with an all-masked row, ties, -inf logits, invalid support slots
  train          ``opd train`` on the packaged demo models for each objective the CLI offers (and the
                 tail bucket, bfloat16, a bfloat16 teacher, LoRA), checkpoint/resume equality, and
                 torchrun launches with one rank: plain, DDP and FSDP (nccl on CUDA) -- opd runs a
                 one-process launch without a process group and refuses --fsdp there, so the DDP and
                 FSDP runs force a one-rank process group through a patched ``init_distributed``
  loss_bench     forward+backward time and peak device memory of LSM from hidden states, the tail
                 bucket, LSM from logits, sampled-token OPD and full-vocabulary KL (from logits and
                 from hidden) at V=151936, d=1536, T=4096, K=32 in float32 and bfloat16
                 (benchmarks/bench_losses.py's step builders, inputs made on the device)
  rollout_bench  opd's HF sampling loop (opd.rollout.sampling.HFRollout, KV cache, top-p 0.9) on a
                 Qwen2.5-0.5B-shaped model with random weights, bf16 and fp32, batch 16 and 64: tokens/s;
                 HF generate (dynamic cache, and static cache in a subprocess) as reference points
  vllm_sleep     ``--vllm-sleep`` 1 and 2 on a real vLLM server opd starts (benchmarks/gpu_vllm_sleep.py): the
                 GPU memory freed asleep, and the engine serving the student's changed weights after a wake;
                 skipped without vLLM set up (``opd vllm-setup``). Alone: ``--skip env,losses,train,loss_bench,rollout_bench``

Every item runs inside try/except and records ok / failed (the error's last lines) / mismatch (ran,
but a check failed) / skipped (why); a section past its budget skips its remaining items, and a
section subprocess that overruns is killed. The JSON (``--out``) and a Markdown table next to it
(same name, ``.md``) are rewritten while sections run, so a timeout still leaves results; every
subprocess's output is kept in a log next to them (same name, ``.log``).

Run (repository root):
  python benchmarks/gpu_check.py                                   # on a GPU machine (~6-8 min on an H100)
  python benchmarks/gpu_check.py --device cpu --small --out /tmp/gpu_check_cpu.json   # dry run (5-10 min on 2 busy cores)
Offline GPU machines: benchmarks/gpu_carry.sh downloads the wheels opd needs and prints the command.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sections kept in modules of their own
from gpu_vllm_sleep import section_vllm_sleep  # noqa: E402

ROOT = HERE.parent
SRC = ROOT / "src"
TESTS = ROOT / "tests"
DEMO = SRC / "opd" / "assets" / "demo"
SECTIONS = ("env", "losses", "train", "loss_bench", "rollout_bench", "vllm_sleep")
# Per-section budgets (s). The GPU ones add up to more than the global budget on purpose: a section
# that finishes early leaves its time to the next ones; the global budget caps the whole run.
BUDGETS = {
    "cuda": {"env": 40, "losses": 75, "train": 330, "loss_bench": 90, "rollout_bench": 170, "vllm_sleep": 240},
    "cpu": {"env": 60, "losses": 150, "train": 800, "loss_bench": 150, "rollout_bench": 400, "vllm_sleep": 30},
}
GLOBAL_BUDGET = {"cuda": 460, "cpu": 1800}
GRACE_S = 20  # a section subprocess is killed this long after its budget (its items check the budget between them)
PREFIX = "[gpu_check]"

# make the checked-out opd importable here and in every subprocess, installed or not
sys.path.insert(0, str(SRC))
os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def log(msg: str) -> None:
    print(f"{PREFIX} {time.strftime('%H:%M:%S')} {msg}", flush=True)


def tail(text: str, n: int = 15) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# =============================================================================== section framework


class Section:
    """A section's items, each timed and caught; the result is rewritten to ``partial`` after each."""

    def __init__(self, name: str, partial: Path, budget_s: float, device: str, small: bool):
        self.name, self.partial, self.device, self.small = name, partial, device, small
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + budget_s
        self.result: dict = {"name": name, "status": "running", "budget_s": budget_s, "items": {}, "info": {}}
        self.save()

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        self.result["wall_s"] = round(time.perf_counter() - self.t0, 2)
        write_json(self.partial, self.result)

    def item(self, key: str, fn, min_left: float = 0.0):
        """Run ``fn()`` (a dict of results; ``"status": "mismatch"`` in it marks a failed check)."""
        if self.left() < max(min_left, 0.5):
            self.result["items"][key] = {"status": f"skipped: section budget ({self.left():.0f} s left)"}
            log(f"{self.name}/{key}: skipped (budget)")
            self.save()
            return None
        log(f"{self.name}/{key} ...")
        t = time.perf_counter()
        try:
            entry = {"status": "ok", **(fn() or {})}
        except Exception:
            entry = {"status": "failed", "error": tail(traceback.format_exc())}
        entry["wall_s"] = round(time.perf_counter() - t, 3)
        self.result["items"][key] = entry
        log(f"{self.name}/{key}: {entry['status']} ({entry['wall_s']:.1f} s)")
        self.save()
        return entry

    def finish(self) -> None:
        states = [it["status"] for it in self.result["items"].values()]
        if self.result.get("error") or any(s in ("failed", "mismatch") for s in states):
            self.result["status"] = "failed"
        elif any(s.startswith("skipped: section budget") for s in states):
            self.result["status"] = "partial: budget"
        else:
            self.result["status"] = "ok"
        self.save()


def device_of(name: str):
    import torch

    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name}: torch {torch.__version__} sees no CUDA GPU")
    return torch.device(name)


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# =============================================================================== env


def section_env(sec: Section, a) -> None:
    def versions():
        import torch

        info = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cudnn": _try(lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
            "cuda_available": torch.cuda.is_available(),
            "opd_commit": opd_commit(),
            "hostname": platform.node(),
            "cpu_count": os.cpu_count(),
            "matmul_allow_tf32": _try(lambda: torch.backends.cuda.matmul.allow_tf32),
            "float32_matmul_precision": _try(torch.get_float32_matmul_precision),
            "argv": sys.argv,
        }
        for pkg in ("transformers", "peft", "accelerate", "tokenizers", "huggingface_hub", "safetensors"):
            info[pkg] = _version(pkg)
        for pkg in ("math_verify", "datasets", "starlette", "uvicorn"):
            info[pkg] = _version(pkg) or "not installed"
        import opd

        info["opd_path"] = str(Path(opd.__file__).parent)
        return info

    def gpu():
        import torch

        if sec.device == "cpu":
            return {"note": "cpu run"}
        dev = device_of(sec.device)
        p = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        info = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "memory_total_GB": round(total / 1e9, 2),
            "memory_free_GB": round(free / 1e9, 2),
            "multiprocessors": p.multi_processor_count,
            "device_count": torch.cuda.device_count(),
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }
        with contextlib.suppress(Exception):
            import torch.cuda.nccl as nccl

            v = nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        if shutil.which("nvidia-smi"):
            q = "name,driver_version,memory.total,clocks.max.sm,power.limit"
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            info["nvidia_smi"] = out.stdout.strip() or tail(out.stderr, 3)
        x = torch.randn(4096, 4096, device=dev)
        sync(dev)
        t = time.perf_counter()
        for _ in range(10):
            x @ x
        sync(dev)
        info["fp32_matmul_TFLOPs"] = round(10 * 2 * 4096**3 / (time.perf_counter() - t) / 1e12, 1)
        return info

    sec.item("versions", versions)
    sec.item("gpu", gpu)
    v = sec.result["items"].get("versions", {})
    sec.result["info"] = {k: v.get(k) for k in ("torch", "torch_cuda", "transformers", "opd_commit")}
    sec.result["info"]["gpu"] = sec.result["items"].get("gpu", {}).get("name")


def _try(fn):
    try:
        return fn()
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def _version(pkg: str):
    import importlib.metadata

    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_from_env(env: dict) -> dict:
    """The GPU and torch the env section found (nothing where it did not run)."""
    items = env.get("items", {})
    versions, gpu = items.get("versions", {}), items.get("gpu", {})
    found = {"gpu": gpu.get("name"), "torch": versions.get("torch"), "torch_cuda": versions.get("torch_cuda")}
    return {k: v for k, v in found.items() if v}


def opd_commit() -> str | None:
    if os.environ.get("OPD_COMMIT"):
        return os.environ["OPD_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
            )
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


# =============================================================================== losses

# Tolerances (rtol, atol) of tests/losses/test_losses.py, so the device is held to the CPU suite's standard.
# The reference gets the very inputs the device got (rounded to the dtype, then widened to float64),
# so the error measured is the device's arithmetic only: opd computes in float32 whatever the input
# dtype, so float32 is ~1e-7 relative per op, summed over V=50 terms (1e-5 leaves a 10-100x margin;
# TF32 matmuls, ~1e-3, would fail it, as they should). bfloat16 adds the rounding of each gradient
# back to bfloat16 (2^-9 relative), on values of order 1: 2e-2 bounds that with margin.
LOSS_TOL = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}
B_, T_, V_, K_, D_, E_ = 3, 7, 50, 5, 16, 12


def compare(got, ref, rtol: float, atol: float) -> dict:
    """Max abs / rel error of ``got`` (any device, dtype) against a float64 ``ref``; pass when
    |got - ref| <= atol + rtol |ref| everywhere and the non-finite entries agree exactly."""
    import torch

    g = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if g.shape != r.shape:
        return {"pass": False, "why": f"shape {tuple(g.shape)} != reference {tuple(r.shape)}"}
    fin = torch.isfinite(r)
    nonfinite_ok = torch.equal(torch.isfinite(g), fin) and torch.equal(g[~fin], r[~fin])
    d, rr = (g - r).abs()[fin], r[fin].abs()
    big = rr > atol
    out = {
        "max_abs": float(d.max()) if d.numel() else 0.0,
        "max_rel": float((d[big] / rr[big]).max()) if bool(big.any()) else 0.0,
        "tol_used": float((d / (atol + rtol * rr)).max()) if d.numel() else 0.0,
    }
    out["pass"] = bool(nonfinite_ok and out["tol_used"] <= 1.0 and not torch.isnan(g).any())
    if not nonfinite_ok:
        out["why"] = "non-finite entries differ from the reference"
    return out


def section_losses(sec: Section, a) -> None:
    import torch

    sys.path.insert(0, str(TESTS))
    import reference as R  # tests/reference.py: float64 loops, pure torch I/O

    import opd.losses as L

    dev = device_of(sec.device)
    F64 = torch.float64
    sec.result["info"]["shapes"] = dict(B=B_, T=T_, V=V_, K=K_, D=D_, E=E_)
    sec.result["info"]["tolerances"] = {k: {"rtol": v[0], "atol": v[1]} for k, v in LOSS_TOL.items()}
    gen = lambda seed: torch.Generator().manual_seed(seed)

    def rn(g, *shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=F64) * scale

    def distinct(g, K=K_):
        return torch.stack([torch.randperm(V_, generator=g)[:K] for _ in range(B_ * T_)]).view(B_, T_, K)

    def bt_mask(g):
        m = torch.rand(B_, T_, generator=g) < 0.7
        m[0] = False  # an all-masked row
        m[1, 0] = m[2, -1] = True
        return m

    def prefix_support(g):  # variable-size supports, some empty
        return torch.arange(K_) < torch.randint(0, K_ + 1, (B_, T_, 1), generator=g)

    def run_case(dtype_name, fn_dev, inputs, grad_of, ref_fn, mask, gout, extra_out=None):
        """``inputs``: name -> float64 CPU tensor (rounded to the dtype here); ``grad_of``: names that get
        gradients; ``fn_dev(**device inputs)`` -> (out, {name: other output}); ``ref_fn(**rounded f64
        inputs)`` -> (value, {grad name: ref grad}, {other output name: ref})."""
        dt = getattr(torch, dtype_name)
        rtol, atol = LOSS_TOL[dtype_name]
        rounded = {k: (v.to(dt).to(F64) if v.is_floating_point() else v) for k, v in inputs.items()}
        on_dev = {
            k: (v.to(dt).to(dev).requires_grad_(k in grad_of) if v.is_floating_point() else v.to(dev))
            for k, v in rounded.items()
        }
        out, others = fn_dev(**on_dev)
        gs = torch.autograd.grad(
            out, [on_dev[k] for k in grad_of], grad_outputs=gout.to(dev, out.dtype), allow_unused=True
        )
        ref_val, ref_grads, ref_others = ref_fn(**rounded)
        res = {"out_dtype": str(out.dtype).replace("torch.", ""), "value": compare(out, ref_val, rtol, atol)}
        masked_ok = bool((out.detach()[~mask.to(dev)] == 0).all())
        for k, g in zip(grad_of, gs):
            g = torch.zeros_like(on_dev[k]) if g is None else g
            res[f"grad_{k}"] = compare(g, ref_grads[k], rtol, atol)
            if g.dtype != on_dev[k].dtype:  # gradients come back in each input's own dtype (opd.losses)
                res[f"grad_{k}"].update({"pass": False, "why": f"grad dtype {g.dtype} != input {on_dev[k].dtype}"})
            if g.dim() >= 2 and tuple(g.shape[:2]) == tuple(mask.shape):
                masked_ok = masked_ok and bool((g[~mask.to(dev)] == 0).all())
        for k, v in others.items():
            res[k] = compare(v, ref_others[k], rtol, atol)
        res["masked_exact"] = masked_ok
        checks = [v["pass"] for v in res.values() if isinstance(v, dict) and "pass" in v] + [masked_ok]
        res["worst_tol_used"] = max(v.get("tol_used", 0.0) for v in res.values() if isinstance(v, dict))
        if not all(checks):
            res["status"] = "mismatch"
        return res

    # ------------------------------------------------------------------ the cases
    def lsm_inputs(seed):
        g = gen(seed)
        zs, zt = rn(g, B_, T_, V_, scale=2.0), rn(g, B_, T_, V_, scale=2.0)
        ids = distinct(g)
        tlp = R.ref_log_softmax(zt).gather(-1, ids)
        zs[1, 2, ids[1, 2, 0]] = -math.inf  # a support slot the student gives no mass
        zs[2, 4, ids[2, 4]] = -math.inf  # the student -inf on every slot of a position
        zs[2, 3, 7] = zs[2, 3, 8]  # ties in the student
        tlp[2, 1, 2] = -math.inf  # a slot outside the teacher's support
        tlp[1, 3, 1] = tlp[1, 3, 0]  # ties in the teacher
        sm = torch.rand(B_, T_, K_, generator=g) < 0.8
        return dict(zs=zs, tlp=tlp), ids, sm, bt_mask(g), rn(g, B_, T_)

    def case_lsm(dtype_name, renormalize, share=0.0):
        x, ids, sm, mask, gout = lsm_inputs(1)

        def dev_fn(zs, tlp):
            out = L.local_support_kl(zs, ids.to(dev), tlp, mask.to(dev), renormalize, sm.to(dev), forward_share=share)
            return out, {}

        def ref(zs, tlp):
            v, gz = R.ref_local_support_kl(zs, ids, tlp, mask, renormalize, sm, gout, forward_share=share)
            return v, {"zs": gz}, {}

        return run_case(dtype_name, dev_fn, x, ["zs"], ref, mask, gout)

    def hidden_inputs(seed, ban=False):
        g = gen(seed)
        h, w = rn(g, B_, T_, D_), rn(g, V_, D_, scale=0.7)
        ids = distinct(g)
        tlp = R.ref_log_softmax(rn(g, B_, T_, V_, scale=2.0)).gather(-1, ids)
        tlp[..., -1][torch.rand(B_, T_, generator=g) < 0.3] = -math.inf
        return g, h, w, ids, tlp, bt_mask(g), prefix_support(g), rn(g, B_, T_)

    def case_lsm_hidden(dtype_name, share=0.0):
        g, h, w, ids, tlp, mask, sm, gout = hidden_inputs(2)

        def dev_fn(h, w, tlp):
            out = L.local_support_kl_from_hidden(
                h, w, ids.to(dev), tlp, mask.to(dev), support_mask=sm.to(dev), chunk_size=4, forward_share=share
            )
            return out, {}

        def ref(h, w, tlp):
            v, gl = R.ref_local_support_kl(R.ref_logits(h, w), ids, tlp, mask, True, sm, gout, forward_share=share)
            gh, gw = R.ref_hidden_grads(h, w, gl)
            return v, {"h": gh, "w": gw}, {}

        return run_case(dtype_name, dev_fn, dict(h=h, w=w, tlp=tlp), ["h", "w"], ref, mask, gout)

    def case_full_kl(dtype_name, fn):
        g = gen(3)
        zs, zt = rn(g, B_, T_, V_, scale=2.0), rn(g, B_, T_, V_, scale=2.0)
        zs[..., V_ - 2 :] = zt[..., V_ - 2 :] = -math.inf  # a padded vocabulary
        if fn != "forward":
            zs[1, 1, :3] = -math.inf  # student zeros (0 log 0)
        if fn != "reverse":
            zt[2, 2, 3:5] = -math.inf  # teacher zeros
        zs[2, 5, 10] = zs[2, 5, 11]
        mask, gout = bt_mask(g), rn(g, B_, T_)
        chunk = None if fn == "forward" else 4

        def dev_fn(zs, zt):
            if fn == "jsd":
                return L.generalized_jsd(zs, zt, mask.to(dev), beta=0.5, chunk_size=chunk), {}
            return L.full_vocab_kl(zs, zt, mask.to(dev), direction=fn, chunk_size=chunk), {}

        def ref(zs, zt):
            if fn == "jsd":
                v, gz = R.ref_generalized_jsd(zs, zt, mask, 0.5, gout)
            else:
                v, gz = R.ref_full_vocab_kl(zs, zt, mask, fn, gout)
            return v, {"zs": gz}, {}

        return run_case(dtype_name, dev_fn, dict(zs=zs, zt=zt), ["zs"], ref, mask, gout)

    def case_full_kl_hidden(dtype_name, direction):
        g = gen(4)
        hs, ws = rn(g, B_, T_, D_), rn(g, V_, D_, scale=0.7)
        ht, wt = rn(g, B_, T_, E_), rn(g, V_, E_, scale=0.7)
        # banned tokens: a -inf head entry against a hidden coordinate fixed at 1 (tests/losses/test_losses.py)
        hs[..., -1] = ht[..., -1] = 1.0
        ws[[0, V_ - 2, V_ - 1], -1] = -math.inf
        wt[[1, V_ - 2, V_ - 1], -1] = -math.inf
        mask, gout = bt_mask(g), rn(g, B_, T_)

        def dev_fn(hs, ws, ht, wt):
            return L.full_vocab_kl_from_hidden(hs, ws, ht, wt, mask.to(dev), direction, chunk_size=3), {}

        def ref(hs, ws, ht, wt):
            v, gh, gw = R.ref_full_vocab_kl_from_hidden(hs, ws, ht, wt, mask, direction, gout)
            return v, {"hs": gh, "ws": gw}, {}

        return run_case(dtype_name, dev_fn, dict(hs=hs, ws=ws, ht=ht, wt=wt), ["hs", "ws"], ref, mask, gout)

    def case_sampled(dtype_name):
        g = gen(5)
        h, w = rn(g, B_, T_, D_), rn(g, V_, D_, scale=0.7)
        y = torch.randint(0, V_, (B_, T_), generator=g)
        lp0 = R.ref_gather_logprobs(R.ref_logits(h, w), y)[0]
        t_lp = lp0 + rn(g, B_, T_, scale=0.5)  # rewards of order 1, so the gradients are too (as in the tests)
        old = lp0 + rn(g, B_, T_, scale=0.3)
        mask, gout = bt_mask(g), rn(g, B_, T_)
        gamma, clip = 0.9, 0.2

        def dev_fn(h, w, t_lp, old):
            logp = L.token_logprobs_from_hidden(h, w, y.to(dev), chunk_size=4)
            adv = L.sampled_token_advantages(logp, t_lp, mask.to(dev), gamma=gamma)
            loss = L.sampled_token_pg_loss(logp, adv, mask.to(dev), old, clip_eps=clip)
            return loss, {"logprobs": logp, "advantages": adv}

        def ref(h, w, t_lp, old):
            logits = R.ref_logits(h, w)
            lp = R.ref_gather_logprobs(logits, y)[0]
            adv = R.ref_sampled_token_advantages(lp, t_lp, mask, gamma)
            loss, g_lp = R.ref_sampled_token_pg_loss(lp, adv, mask, old, clip, gout)
            gl = R.ref_gather_logprobs(logits, y, g_lp)[1]
            gh, gw = R.ref_hidden_grads(h, w, gl)
            return loss, {"h": gh, "w": gw}, {"logprobs": lp, "advantages": adv}

        return run_case(dtype_name, dev_fn, dict(h=h, w=w, t_lp=t_lp, old=old), ["h", "w"], ref, mask, gout)

    def case_gather(dtype_name):
        g = gen(6)
        z = rn(g, B_, T_, V_, scale=2.0)
        y = torch.randint(0, V_, (B_, T_), generator=g)
        gout = rn(g, B_, T_)
        everything = torch.ones(B_, T_, dtype=torch.bool)

        def dev_fn(z):
            return L.gather_logprobs(z, y.to(dev)), {}

        def ref(z):
            v, gz = R.ref_gather_logprobs(z, y, gout)
            return v, {"z": gz}, {}

        return run_case(dtype_name, dev_fn, dict(z=z), ["z"], ref, everything, gout)

    def case_tail(dtype_name, direction, hidden):
        g = gen(7)
        ids = distinct(g)
        mask, sm, gout = bt_mask(g), torch.rand(B_, T_, K_, generator=g) < 0.8, rn(g, B_, T_)
        tlp = R.ref_log_softmax(rn(g, B_, T_, V_, scale=2.0)).gather(-1, ids)
        tlp[2, 2, 1] = -math.inf
        if hidden:
            h, w = rn(g, B_, T_, D_), rn(g, V_, D_, scale=0.7)

            def dev_fn(h, w, tlp):
                return L.local_support_kl_tail_from_hidden(
                    h, w, ids.to(dev), tlp, mask.to(dev), support_mask=sm.to(dev), direction=direction, chunk_size=4
                ), {}

            def ref(h, w, tlp):
                v, gh, gw = R.ref_local_support_kl_tail_from_hidden(h, w, ids, tlp, mask, sm, direction, gout)
                return v, {"h": gh, "w": gw}, {}

            return run_case(dtype_name, dev_fn, dict(h=h, w=w, tlp=tlp), ["h", "w"], ref, mask, gout)
        zs = rn(g, B_, T_, V_, scale=2.0)
        zs[1, 4, ids[1, 4, 0]] = -math.inf  # a support slot with no student mass
        outside = [v for v in range(V_) if v not in ids[2, 3].tolist()][0]
        zs[2, 3, outside] = -math.inf  # a token outside S with no student mass

        def dev_fn(zs, tlp):
            out = L.local_support_kl_tail(
                zs, ids.to(dev), tlp, mask.to(dev), support_mask=sm.to(dev), direction=direction
            )
            return out, {}

        def ref(zs, tlp):
            v, gz = R.ref_local_support_kl_tail(zs, ids, tlp, mask, sm, direction, gout)
            return v, {"zs": gz}, {}

        return run_case(dtype_name, dev_fn, dict(zs=zs, tlp=tlp), ["zs"], ref, mask, gout)

    def case_topk(dtype_name):
        dt = getattr(torch, dtype_name)
        rtol, atol = LOSS_TOL[dtype_name]
        g = gen(8)
        zt = rn(g, B_, T_, V_, scale=3.0)
        zt[0, 0, 3] = zt[0, 0, 7] = zt[0, 0].max() + 0.5  # a tie at the top
        zt[1, 2, 10] = zt[1, 2, 11]
        h, w = rn(g, B_, T_, D_), rn(g, V_, D_, scale=0.7)
        res = {}
        for name in ("teacher_topk", "topk_from_hidden"):
            if name == "teacher_topk":
                logits = zt.to(dt).to(F64)
                ids, lps = L.teacher_topk(zt.to(dt).to(dev), K_, chunk_size=4)
            else:
                hq, wq = h.to(dt), w.to(dt)
                logits = R.ref_logits(hq.to(F64), wq.to(F64))
                ids, lps = L.topk_from_hidden(hq.to(dev), wq.to(dev), K_, chunk_size=4)
            ref_ids, ref_lps = R.ref_teacher_topk(logits, K_)
            ids_c = ids.cpu()
            res[f"{name}_values"] = compare(lps, ref_lps, rtol, atol)
            res[f"{name}_own_logprobs"] = compare(lps, R.ref_log_softmax(logits).gather(-1, ids_c), rtol, atol)
            res[f"{name}_sorted_distinct"] = bool(
                (lps[..., :-1] >= lps[..., 1:]).all() and (ids_c.sort(-1).values.diff(dim=-1) != 0).all()
            )
            res[f"{name}_ids_equal_reference"] = bool(torch.equal(ids_c, ref_ids))  # ties may reorder: informational
            res[f"{name}_no_grad"] = not lps.requires_grad
        checks = [v["pass"] for v in res.values() if isinstance(v, dict)]
        checks += [v for k, v in res.items() if k.endswith(("_sorted_distinct", "_no_grad"))]
        res["worst_tol_used"] = max(v["tol_used"] for v in res.values() if isinstance(v, dict))
        if not all(checks):
            res["status"] = "mismatch"
        return res

    def case_build_support():
        g = gen(9)
        perms = torch.stack([torch.randperm(V_, generator=g) for _ in range(B_ * T_)]).view(B_, T_, V_)
        tids, sids = perms[..., :K_], perms[..., K_ - 2 : 2 * K_ - 2]  # two ids shared
        sampled = torch.where(torch.rand(B_, T_, generator=g) < 0.5, perms[..., 0], perms[..., 3 * K_])
        res, ok = {}, True
        for kind in L.SUPPORT_KINDS:
            ids, valid = L.build_support(kind, tids.to(dev), sids.to(dev), sampled.to(dev))
            rids, rvalid = R.ref_build_support(kind, tids, sids, sampled)
            res[kind] = bool(torch.equal(ids.cpu(), rids) and torch.equal(valid.cpu(), rvalid))
            ok = ok and res[kind]
        if not ok:
            res["status"] = "mismatch"
        return res

    cases = [
        ("lsm", lambda d: case_lsm(d, True)),
        ("lsm_no_renormalize", lambda d: case_lsm(d, False)),
        ("lsm_from_hidden", case_lsm_hidden),
        ("lsm_forward_share_0.3", lambda d: case_lsm(d, True, 0.3)),
        ("lsm_from_hidden_forward_share_0.3", lambda d: case_lsm_hidden(d, 0.3)),
        ("full_vocab_kl_reverse", lambda d: case_full_kl(d, "reverse")),
        ("full_vocab_kl_forward", lambda d: case_full_kl(d, "forward")),
        ("generalized_jsd_0.5", lambda d: case_full_kl(d, "jsd")),
        ("full_vocab_kl_from_hidden_reverse", lambda d: case_full_kl_hidden(d, "reverse")),
        ("full_vocab_kl_from_hidden_forward", lambda d: case_full_kl_hidden(d, "forward")),
        ("sampled_token_from_hidden", case_sampled),
        ("gather_logprobs", case_gather),
        ("lsm_tail_reverse", lambda d: case_tail(d, "reverse", False)),
        ("lsm_tail_forward", lambda d: case_tail(d, "forward", False)),
        ("lsm_tail_from_hidden_reverse", lambda d: case_tail(d, "reverse", True)),
        ("lsm_tail_from_hidden_forward", lambda d: case_tail(d, "forward", True)),
        ("topk", case_topk),
    ]
    for dtype_name in ("float32", "bfloat16"):
        for name, fn in cases:
            sec.item(f"{name}/{dtype_name}", lambda fn=fn, d=dtype_name: fn(d))
    sec.item("build_support/int64", case_build_support)


# =============================================================================== train


def train_settings(small: bool) -> dict:
    return dict(
        steps=2 if small else 3,
        batch_size=4 if small else 8,
        max_new_tokens=16 if small else 32,
        eval_size=4 if small else 8,
        eval_samples=0,
        k=8,
        warmup_steps=1,
        log_rollouts=2,
        diag_positions=16,
        eval_every=0,
        ckpt_every=0,
        seed=0,
        lr=3e-3,
    )


def opd_argv(out: Path, device: str, settings: dict, extra: list[str]) -> list[str]:
    argv = ["train", "--student", str(DEMO / "student"), "--teacher", str(DEMO / "teacher")]
    argv += ["--out", str(out), "--device", device]
    for k, v in settings.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv + extra


# the objectives and options `opd train --help` offers (src/opd/config/options.py), as
# tests/training/test_loop_end_to_end.py runs them, in order of priority (a section out of budget skips the
# last ones); the resume runs go after the first six
TRAIN_JOBS = [
    ("lsm", ["--objective", "lsm"]),
    ("sampled", ["--objective", "sampled"]),
    ("full_kl", ["--objective", "full_kl"]),
    ("lsm_tail", ["--objective", "lsm", "--tail"]),
    ("lsm_bfloat16", ["--objective", "lsm", "--dtype", "bfloat16"]),
    ("lora_lsm", ["--objective", "lsm", "--lora-r", "8", "--lora-alpha", "16"]),
    # rollouts one step ahead: the worker process generates on the same GPU from the weights each request carries
    ("lsm_max_staleness_1", ["--objective", "lsm", "--max-staleness", "1"]),
    ("sampled_max_staleness_1", ["--objective", "sampled", "--max-staleness", "1"]),
    ("lsm_forward_kl_share", ["--objective", "lsm", "--forward-kl-share", "0.3"]),
    ("lsm_no_renormalize", ["--objective", "lsm", "--no-renormalize"]),
    ("lsm_student_topk", ["--objective", "lsm", "--support", "student_topk"]),
    ("lsm_union", ["--objective", "lsm", "--support", "union"]),
    ("lsm_intersection", ["--objective", "lsm", "--support", "intersection"]),
    ("lsm_symmetric_difference", ["--objective", "lsm", "--support", "symmetric_difference"]),
    ("lsm_teacher_topk_plus_sampled", ["--objective", "lsm", "--support", "teacher_topk_plus_sampled"]),
    (
        "sampled_gamma_ppo",
        ["--objective", "sampled", "--gamma", "0.9", "--updates-per-batch", "2", "--grad-accum", "2"],
    ),
    ("full_kl_forward", ["--objective", "full_kl", "--kl-direction", "forward"]),
    ("full_kl_bfloat16", ["--objective", "full_kl", "--dtype", "bfloat16"]),
    ("lsm_teacher_bfloat16", ["--objective", "lsm", "--teacher-dtype", "bfloat16"]),
    (
        "lora_sampled",
        ["--objective", "sampled", "--lora-r", "8", "--lora-alpha", "16", "--lora-targets", "q_proj,v_proj"],
    ),
]
TRAIN_JOBS_FIRST = 6  # then the resume runs
# --small (the CPU dry run): one run per objective and per device path (dtype, LoRA); the full list was
# checked on the CPU too, it only takes longer (15-45 s a run on 2 busy cores)
TRAIN_JOBS_SMALL = ("lsm_tail", "sampled", "full_kl", "lsm_bfloat16", "lora_lsm")  # plain lsm: the resume runs
RESUME_STEPS = {False: 4, True: 2}  # by --small: the reference run; the resumed one stops at half and goes on
TRAJ_REL, TRAJ_ABS = 1e-4, 1e-5  # tests/helpers.py assert_same_trajectory (DDP vs one process)


def step_records(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    return [r for r in (json.loads(x) for x in p.read_text().splitlines() if x.strip()) if "train/loss" in r]


def summarize_run(run_dir: Path) -> dict:
    recs = step_records(run_dir)
    out: dict = {"steps_logged": len(recs)}
    if not recs:
        return out
    later = recs[1:] or recs  # step 0 carries the warm-up (CUDA init, kernel selection, allocator)
    out["final_loss"] = recs[-1]["train/loss"]
    out["losses_finite"] = all(math.isfinite(float(r["train/loss"])) for r in recs)
    out["grad_norms_finite"] = all(math.isfinite(float(r.get("train/grad_norm", 0.0))) for r in recs)
    for key in ("step", "generate", "score", "update"):
        out[f"{key}_s"] = median([r.get(f"time/{key}") for r in later])
    out["step0_s"] = recs[0].get("time/step")
    out["final_saved"] = (run_dir / "final").exists() and any((run_dir / "final").iterdir())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in (json.loads(x) for x in lines if x.strip()) if "eval/accuracy" in r]
    out["eval_accuracy"] = evals[-1]["eval/accuracy"] if evals else None
    return out


def compare_runs(got_dir: Path, want_dir: Path, lr: float) -> dict:
    """tests/helpers.py's trajectory and weight checks, reporting the worst deviation instead of asserting."""
    import torch
    from safetensors.torch import load_file

    from opd.training.stepstats import FULL_VOCAB_KEYS

    got, want = step_records(got_dir), step_records(want_dir)
    res: dict = {"steps": [r["step"] for r in got], "want_steps": [r["step"] for r in want]}
    ok = bool(want) and res["steps"] == res["want_steps"]
    worst, worst_key = 0.0, None
    for g, w in zip(got, want):
        for key, wv in w.items():
            if key.startswith("time/") or key in FULL_VOCAB_KEYS:
                continue
            if key not in g:
                ok, worst_key = False, f"missing {key}"
                continue
            atol = 1e-9 if key in ("train/loss", "train/grad_norm") else TRAJ_ABS
            gv = g[key] if isinstance(g[key], list) else [g[key]]
            wvs = wv if isinstance(wv, list) else [wv]
            for x, y in zip(gv, wvs):
                if not isinstance(y, (int, float)) or isinstance(y, bool):
                    continue
                dev = abs(float(x) - float(y))
                ratio = dev / (atol + TRAJ_REL * abs(float(y)))
                if ratio > worst:
                    worst, worst_key = ratio, f"step {w['step']} {key}: {x} vs {y}"
    res["trajectory_tol_used"] = worst
    res["trajectory_worst"] = worst_key
    res["trajectory_pass"] = ok and worst <= 1.0
    a, b = (
        load_file(str(got_dir / "final" / "model.safetensors")),
        load_file(str(want_dir / "final" / "model.safetensors")),
    )
    res["weights_same_keys"] = a.keys() == b.keys()
    res["weights_max_abs"] = (
        max(float((a[k].float() - b[k].float()).abs().max()) for k in b) if a.keys() == b.keys() else None
    )
    res["weights_exact"] = bool(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b))
    res["weights_pass"] = res["weights_max_abs"] is not None and res["weights_max_abs"] < 0.1 * lr
    if not (res["trajectory_pass"] and res["weights_pass"]):
        res["status"] = "mismatch"
    return res


def train_worker(jobs_path: str, results_path: str) -> None:
    """Run opd's CLI in this process for each job not yet in ``results_path`` (one JSON line each)."""
    import torch

    from opd.cli import app

    jobs = json.loads(Path(jobs_path).read_text())
    done = set()
    if Path(results_path).exists():
        done = {json.loads(x)["key"] for x in Path(results_path).read_text().splitlines() if x.strip()}
    for job in jobs:
        if job["key"] in done:
            continue
        log(f"train/{job['key']}: opd {' '.join(job['argv'][:1] + job['argv'][-6:])}")
        with open(results_path, "a") as f:  # mark it started: a crash leaves it recorded as such
            f.write(json.dumps({"key": job["key"], "started": True}) + "\n")
        t = time.perf_counter()
        rec: dict = {"key": job["key"], "rc": 0}
        try:
            app(job["argv"], prog_name="opd", standalone_mode=False)
        except SystemExit as e:
            rec["rc"] = e.code if isinstance(e.code, int) else 1
        except BaseException as e:
            rec["rc"] = 1
            rec["error"] = tail(traceback.format_exc())
            if isinstance(e, KeyboardInterrupt):
                raise
        rec["wall_s"] = round(time.perf_counter() - t, 2)
        if rec["rc"] == 0:  # now: a later job may write to the same run directory (--resume)
            with contextlib.suppress(Exception):
                rec["summary"] = summarize_run(Path(job["argv"][job["argv"].index("--out") + 1]))
        with open(results_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec["rc"] and torch.cuda.is_available() and torch.cuda.is_initialized():
            try:  # a sticky CUDA error spoils this process for every later job: start a fresh one
                torch.cuda.synchronize()
            except Exception:
                sys.exit(3)


def dist_worker(mode: str, argv: list[str]) -> None:
    """Under torchrun with one rank: ``opd train`` with a one-rank process group (nccl on CUDA) and the
    student wrapped in DDP or FSDP. opd itself runs a one-process launch without a group (and refuses
    --fsdp there), so ``init_distributed`` is replaced by one that always joins the group and a ``Dist``
    whose collectives run (``active``) with one rank."""
    import torch
    import torch.distributed as tdist

    import opd.training.setup as setup_mod  # where the run calls init_distributed (by its own name)
    from opd.cli import app
    from opd.training.distributed import Dist

    class OneRankDist(Dist):
        @property
        def active(self) -> bool:
            return True

    def init_one_rank(fsdp: bool = False, device: torch.device = torch.device("cpu")) -> Dist:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        d = OneRankDist(rank=tdist.get_rank(), world=tdist.get_world_size(), fsdp=fsdp, device=device)
        print(f"{PREFIX} {mode}: one-rank group, backend {tdist.get_backend()}, world {d.world}", flush=True)
        return d

    setup_mod.init_distributed = init_one_rank
    wrapped = []
    real_wrap = Dist.wrap

    def wrap(self, student):
        module = real_wrap(self, student)
        wrapped.append(type(module).__name__)
        return module

    Dist.wrap = wrap
    if mode == "fsdp" and "--fsdp" not in argv:
        argv = argv + ["--fsdp"]
    app(argv, prog_name="opd", standalone_mode=False)
    print(f"{PREFIX} {mode}: student wrapped as {wrapped}", flush=True)
    expect = "DistributedDataParallel" if mode == "ddp" else "FSDP"
    if not wrapped or expect not in wrapped[0]:
        raise SystemExit(f"{mode}: the student was wrapped as {wrapped}, expected {expect}")


def section_train(sec: Section, a) -> None:
    settings = train_settings(sec.small)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    sec.result["info"].update(settings=settings, work=str(work), demo=str(DEMO))
    dev = sec.device
    try:
        _train_jobs(sec, a, settings, work, dev)
        _train_launches(sec, settings, work, dev)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _train_jobs(sec: Section, a, settings: dict, work: Path, dev: str) -> None:
    n = RESUME_STEPS[sec.small]
    ref = {**settings, "steps": n, "ckpt_every": n // 2}
    half = {**ref, "steps": n // 2}
    chosen = [(k, extra) for k, extra in TRAIN_JOBS if not sec.small or k in TRAIN_JOBS_SMALL]
    if a.train_jobs != "all":  # a rerun of a few items: the resume runs stay (the launches compare with them)
        chosen = [(k, extra) for k, extra in chosen if k in a.train_jobs.split(",")]
    sec.result["info"]["jobs"] = [k for k, _ in chosen]
    jobs = [{"key": k, "argv": opd_argv(work / k, dev, settings, extra)} for k, extra in chosen]
    jobs[TRAIN_JOBS_FIRST:TRAIN_JOBS_FIRST] = [
        {"key": "resume_reference", "argv": opd_argv(work / "resume_reference", dev, ref, [])},
        {"key": "resume_first_half", "argv": opd_argv(work / "resumed", dev, half, [])},
        {"key": "resume_second_half", "argv": opd_argv(work / "resumed", dev, ref, ["--resume"])},
    ]
    jobs_path, results_path = work / "jobs.json", work / "results.jsonl"
    jobs_path.write_text(json.dumps(jobs))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_train-worker", str(jobs_path), str(results_path)]
    results: dict = {}
    for attempt in range(4):  # a worker that dies is restarted on the jobs it had not finished
        left = sec.left() - (75 if dev.startswith("cuda") else 100)  # keep time for the torchrun launches
        if left < 10:
            break
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            rc = "timeout"
        results = read_results(results_path)
        if rc == 0 or all(j["key"] in results for j in jobs):
            break
        # the job it was running when it died (or ran out of time) counts as failed; restart after it
        for key, rec in results.items():
            if rec.get("started") and "rc" not in rec:
                if rc == "timeout":
                    rec.update(rc="budget", error="the section's budget ran out during this job: killed")
                else:
                    rec.update(rc="died", error=f"the worker exited ({rc}) during this job (attempt {attempt})")
                with open(results_path, "a") as f:
                    f.write(json.dumps({"key": key, **rec}) + "\n")
        if rc == "timeout":
            break
    results = read_results(results_path)
    sec.result["info"]["worker_attempts"] = attempt + 1
    for job in jobs:
        key = job["key"]
        rec = results.get(key)

        def one(key=key, rec=rec, job=job):
            if rec is None:
                return {"status": f"skipped: section budget (not reached), argv tail {job['argv'][-4:]}"}
            if rec.get("rc") == "budget":
                return {"status": "skipped: section budget (killed mid-run)", "error": rec["error"]}
            if rec.get("rc") != 0:
                return {"status": "failed", "rc": rec.get("rc"), "error": rec.get("error", "see the log")}
            out = {
                "args": " ".join(x for x in job["argv"][job["argv"].index("--lr") + 2 :]),
                "job_wall_s": rec["wall_s"],
            }
            out.update(rec.get("summary") or {"steps_logged": 0})
            want = n // 2 if key == "resume_first_half" else n if key.startswith("resume") else settings["steps"]
            if out["steps_logged"] != want or not out.get("losses_finite") or not out.get("grad_norms_finite"):
                out["status"] = "mismatch"
                out["why"] = f"{out['steps_logged']} steps logged (want {want}), finite losses/grad norms required"
            return out

        sec.item(key, one, min_left=-1e9)  # bookkeeping only: never skipped
    if all(results.get(k, {}).get("rc") == 0 for k in ("resume_reference", "resume_second_half")):
        sec.item(
            "resume_equals_uninterrupted",
            lambda: compare_runs(work / "resumed", work / "resume_reference", settings["lr"]),
        )


def _train_launches(sec: Section, settings: dict, work: Path, dev: str) -> None:
    n = RESUME_STEPS[sec.small]
    ref = {**settings, "steps": n, "ckpt_every": n // 2}
    half = {**ref, "steps": n // 2}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    me = str(Path(__file__).resolve())
    have_ref = (work / "resume_reference" / "final").exists()
    launches = [
        ("torchrun_1rank_plain", [torchrun + ["-m", "opd"] + opd_argv(work / "tr_plain", dev, ref, [])], "tr_plain"),
        (
            "torchrun_1rank_ddp",
            [torchrun + [me, "--_dist-worker", "ddp"] + opd_argv(work / "tr_ddp", dev, ref, [])],
            "tr_ddp",
        ),
        (
            "torchrun_1rank_fsdp_and_resume",
            [
                torchrun + [me, "--_dist-worker", "fsdp"] + opd_argv(work / "tr_fsdp", dev, half, []),
                torchrun + [me, "--_dist-worker", "fsdp"] + opd_argv(work / "tr_fsdp", dev, ref, ["--resume"]),
            ],
            "tr_fsdp",
        ),
    ]
    for key, cmds, out_name in launches:

        def one(cmds=cmds, out_name=out_name):
            res: dict = {"launches": []}
            for cmd in cmds:
                t = time.perf_counter()
                rc, text = run_captured(cmd, timeout=max(min(150, sec.left() - 5), 5))
                res["launches"].append({"rc": rc, "wall_s": round(time.perf_counter() - t, 2)})
                backend = [ln.split(PREFIX, 1)[1].strip() for ln in text.splitlines() if PREFIX in ln]
                if backend:
                    res.setdefault("worker_says", []).extend(backend)
                if rc != 0:
                    print(tail(text, 40), flush=True)
                    return {**res, "status": "failed", "error": tail(text)}
            res.update(summarize_run(work / out_name))
            if have_ref:
                res["vs_single_process"] = compare_runs(work / out_name, work / "resume_reference", settings["lr"])
                if res["vs_single_process"].get("status") == "mismatch":
                    res["status"] = "mismatch"
            return res

        sec.item(key, one, min_left=20)


def read_results(path: Path) -> dict:
    out: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out.setdefault(rec["key"], {}).update(rec)
    return out


def run_captured(cmd: list[str], timeout: float, env: dict | None = None) -> tuple:
    """(returncode or 'timeout', combined output) of ``cmd`` in its own process group."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        return "timeout", (out or "") + f"\n(killed after {timeout:.0f} s)"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc): torchrun starts its ranks in sessions of their own, so
    killing a process group would leave them running."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{d}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every descendant (listed before anything dies)."""
    below = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in [proc.pid, *below]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


# =============================================================================== loss_bench

BENCH_VARIANTS = ["lsm_hidden", "lsm_tail_hidden", "lsm_logits", "sampled", "full_kl", "full_kl_hidden"]


def section_loss_bench(sec: Section, a) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_losses as BL  # its step builders (build_step) and analytic FLOPs; inputs are made here

    dev = device_of(sec.device)
    V, d, T, K = (2048, 64, 128, 32) if sec.small else (151936, 1536, 4096, 32)
    warmup, repeats = (1, 3) if sec.small or dev.type == "cpu" else (2, 5)
    chunks = dict(kl_chunk=512, kl_hidden_chunk=128, tail_chunk=128)
    sec.result["info"].update(V=V, d=d, T=T, K=K, B=1, warmup=warmup, repeats=repeats, **chunks)
    sec.result["info"]["memory"] = (
        "peak_extra_MB: torch.cuda.max_memory_allocated during the step (reset before it) minus the memory "
        "allocated before it (inputs, parameters); includes the gradients of h and W (grads_MB), which "
        "peak_beyond_grads_MB leaves out"
        if dev.type == "cuda"
        else "not measured on the CPU (see benchmarks/bench_losses.py for RSS-based CPU memory)"
    )

    def inputs(variant, dt):
        g = torch.Generator(device=dev).manual_seed(0)
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float32)
        x = {
            "W": (rnd(V, d) * (2.0 / math.sqrt(d))).to(dt).requires_grad_(),
            "h": rnd(1, T, d).to(dt).requires_grad_(),
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
            x["Wt"] = (rnd(V, d) * (2.0 / math.sqrt(d))).to(dt)
            x["ht"] = rnd(1, T, d).to(dt)
        return x

    def bench(variant, dtype_name):
        dt = getattr(torch, dtype_name)
        gc.collect()  # what an earlier item that failed (e.g. out of memory) left behind
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        x = inputs(variant, dt)
        step = BL.build_step(variant, x, K, **chunks)
        params = [x["W"], x["h"]]
        grads_mb = sum(p.numel() * p.element_size() for p in params) / 1e6
        times, peaks = [], []
        for i in range(warmup + repeats):
            for p in params:
                p.grad = None
            sync(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            t = time.perf_counter()
            step()
            sync(dev)
            dt_s = time.perf_counter() - t
            if i >= warmup:
                times.append(dt_s)
                if dev.type == "cuda":
                    peaks.append((torch.cuda.max_memory_allocated(dev) - base) / 1e6)
        ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in params)
        flops, _ = BL.analytic(variant, T, V, d, d, K, chunks["kl_hidden_chunk"], chunks["tail_chunk"])
        med = statistics.median(times)
        out = {
            "median_ms": round(1e3 * med, 3),
            "min_ms": round(1e3 * min(times), 3),
            "times_ms": [round(1e3 * t, 3) for t in times],
            "TFLOPs": float(f"{flops / med / 1e12:.4g}"),
            "grads_MB": round(grads_mb, 1),
            "grads_finite": ok,
        }
        if peaks:
            out["peak_extra_MB"] = round(max(peaks), 1)
            out["peak_beyond_grads_MB"] = round(max(peaks) - grads_mb, 1)
        del x, step, params
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if not ok:
            out["status"] = "mismatch"
            out["why"] = "a gradient is missing or not finite"
        return out

    for dtype_name in ("float32", "bfloat16"):
        for v in BENCH_VARIANTS:
            sec.item(f"{v}/{dtype_name}", lambda v=v, d=dtype_name: bench(v, d), min_left=3)
    ratios = {}
    for dtype_name in ("float32", "bfloat16"):
        it = lambda v, d=dtype_name: sec.result["items"].get(f"{v}/{d}", {})
        base = it("lsm_hidden")
        for v in BENCH_VARIANTS[1:]:
            if "median_ms" in base and "median_ms" in it(v):
                r = {"time": round(it(v)["median_ms"] / base["median_ms"], 2)}
                if "peak_extra_MB" in base:
                    r["memory"] = round(it(v)["peak_extra_MB"] / max(base["peak_extra_MB"], 1.0), 2)
                ratios[f"{v}_vs_lsm_hidden/{dtype_name}"] = r
    sec.result["info"]["ratios"] = ratios


# =============================================================================== rollout_bench


def rollout_config(small: bool):
    from transformers import Qwen2Config

    if small:
        return Qwen2Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=2048,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
    # Qwen2.5-0.5B's shape (its config.json), random weights
    return Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


# Final-norm gain: random-init logits have std ~0.02 * sqrt(896) ~ 0.6 (near uniform: the top-p 0.9 nucleus
# holds most of the vocabulary and opd's sampler falls back to a full sort, see NUCLEUS_CANDIDATES); x13
# gives std ~8, whose nucleus is a few tokens (median ~6 for Gaussian logits), like a trained model's.
LOGIT_SCALE = 13.0


def build_rollout_model(small: bool, dev, peaked: bool = True):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = rollout_config(small)
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    if peaked:
        with torch.no_grad():
            model.model.norm.weight.mul_(LOGIT_SCALE)
    return model


def rollout_prompts(small: bool, batch: int, vocab: int):
    import torch

    P = 16 if small else 64
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(P - 8, P + 1, (batch,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def section_rollout_bench(sec: Section, a) -> None:
    import torch

    from opd.rollout.sampling import HFRollout

    dev = device_of(sec.device)
    small = sec.small
    new = 32 if small else 128
    batches = (16, 64)
    repeats = 2
    t = time.perf_counter()
    model = build_rollout_model(small, dev)
    cfg = model.config
    sec.result["info"].update(
        model="tiny 2-layer Qwen2 (random)" if small else "Qwen2.5-0.5B shape, random weights",
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        vocab=cfg.vocab_size,
        attn_implementation=getattr(cfg, "_attn_implementation", None),
        prompt_tokens=f"{16 - 8 if small else 64 - 8}..{16 if small else 64}",
        new_tokens=new,
        top_p=0.9,
        temperature=1.0,
        repeats=repeats,
        build_s=round(time.perf_counter() - t, 2),
        logits=f"final-norm gain x{LOGIT_SCALE:g} (peaked, like a trained model) unless 'flat' (random init)",
        eos="never (eos_id -1): every row writes all new tokens",
        static_cache="not offered by opd's loop (HFRollout: DynamicCache, eager, no CUDA graphs or torch.compile)",
    )

    def nucleus_size(prompts, top_p=0.9):
        from opd.rollout.sampling import left_pad

        ids, attn = (x.to(dev) for x in left_pad(prompts, 0))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=1).logits[:, -1].float()
        p = torch.softmax(logits, -1).sort(-1, descending=True).values
        n = ((p.cumsum(-1) - p) < top_p).sum(-1).float()
        return {"nucleus_tokens_median": float(n.median()), "top1_prob_median": float(p[:, 0].median())}

    def opd_loop(batch):
        engine = HFRollout(model, eos_id=-1, pad_id=0)
        prompts = rollout_prompts(small, batch, cfg.vocab_size)
        seeds = list(range(batch))
        run = lambda: engine.generate(prompts, seeds, max_new_tokens=new, temperature=1.0, top_p=0.9)
        run()  # warm-up
        times, tokens = [], None
        for _ in range(repeats):
            sync(dev)
            t = time.perf_counter()
            out = run()
            sync(dev)
            times.append(time.perf_counter() - t)
            tokens = int(out.response_mask_NT.sum())
        med = statistics.median(times)
        res = {
            "tokens": tokens,
            "median_s": round(med, 3),
            "tokens_per_s": round(tokens / med, 1),
            "ms_per_decode_step": round(1e3 * med / new, 2),
            **nucleus_size(prompts),
        }
        if dev.type == "cuda":
            res["max_memory_MB"] = round(torch.cuda.max_memory_allocated(dev) / 1e6, 1)
        if tokens != batch * new:
            res["status"] = "mismatch"
            res["why"] = f"{tokens} tokens generated, {batch * new} expected"
        return res

    def hf_generate(batch, label):
        from opd.rollout.sampling import left_pad

        ids, attn = (x.to(dev) for x in left_pad(rollout_prompts(small, batch, cfg.vocab_size), 0))
        kw = dict(do_sample=True, top_p=0.9, top_k=0, temperature=1.0, max_new_tokens=new, pad_token_id=0)
        model.generation_config.eos_token_id = None
        gen = lambda: model.generate(input_ids=ids, attention_mask=attn, **kw)
        gen()
        times = []
        for _ in range(repeats):
            sync(dev)
            t = time.perf_counter()
            out = gen()
            sync(dev)
            times.append(time.perf_counter() - t)
        tokens = int((out.shape[1] - ids.shape[1]) * batch)
        med = statistics.median(times)
        return {"engine": label, "tokens": tokens, "median_s": round(med, 3), "tokens_per_s": round(tokens / med, 1)}

    for dtype_name in ("float32", "bfloat16"):
        model.to(getattr(torch, dtype_name))
        for b in batches:
            sec.item(f"opd_hf_loop/{dtype_name}/b{b}", lambda b=b: opd_loop(b), min_left=8)
    # bfloat16 from here on
    with torch.no_grad():
        model.model.norm.weight.div_(LOGIT_SCALE)
    sec.item("opd_hf_loop_flat_logits/bfloat16/b64", lambda: opd_loop(64), min_left=10)
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_SCALE)
    sec.item("hf_generate_dynamic/bfloat16/b64", lambda: hf_generate(64, "HF generate, DynamicCache"), min_left=10)

    def static():
        budget = min(200.0, sec.left() - 5)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_static-worker", sec.device, str(int(small)), "64"]
        rc, text = run_captured(cmd, timeout=budget)
        lines = [ln for ln in text.splitlines() if ln.startswith("STATIC_RESULT ")]
        if rc != 0 or not lines:
            print(tail(text, 30), flush=True)
            return {"status": "failed", "rc": rc, "error": tail(text)}
        return json.loads(lines[-1].split(" ", 1)[1])

    sec.item("hf_generate_static/bfloat16/b64", static, min_left=60 if dev.type == "cuda" else 5)


def static_worker(device: str, small: bool, batch: int) -> None:
    """HF generate with cache_implementation='static' (on CUDA transformers compiles the decode step)."""
    import torch

    from opd.rollout.sampling import left_pad

    dev = device_of(device)
    model = build_rollout_model(small, dev).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    new = 32 if small else 128
    ids, attn = (x.to(dev) for x in left_pad(rollout_prompts(small, batch, model.config.vocab_size), 0))
    kw = dict(do_sample=True, top_p=0.9, top_k=0, max_new_tokens=new, pad_token_id=0, cache_implementation="static")
    times = []
    for _ in range(3):  # the first call compiles
        sync(dev)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=attn, **kw)
        sync(dev)
        times.append(time.perf_counter() - t)
    tokens = int((out.shape[1] - ids.shape[1]) * batch)
    res = {
        "engine": "HF generate, StaticCache"
        + (" (auto torch.compile on CUDA)" if dev.type == "cuda" else " (no compile on CPU)"),
        "first_call_s": round(times[0], 2),
        "tokens": tokens,
        "median_s": round(statistics.median(times[1:]), 3),
        "tokens_per_s": round(tokens / statistics.median(times[1:]), 1),
    }
    print("STATIC_RESULT " + json.dumps(res), flush=True)


# =============================================================================== report


def _fmt(v, spec=".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def render(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# opd GPU check ({s['device']}{', small' if s['small'] else ''})",
        "",
        f"- started {report['started']}, wall {report.get('wall_s', 0):.0f} s of a {s['global_budget_s']} s budget; "
        f"opd {report.get('opd_commit') or '?'}",
    ]
    env = report["sections"].get("env", {}).get("items", {})
    v, g = env.get("versions", {}), env.get("gpu", {})
    if v:
        lines.append(
            f"- torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), transformers {v.get('transformers')}, "
            f"python {v.get('python')}, TF32 matmul {v.get('matmul_allow_tf32')}"
        )
    if g.get("name"):
        lines.append(
            f"- GPU {g.get('name')} ({g.get('memory_total_GB')} GB, capability {g.get('capability')}, "
            f"nccl {g.get('nccl')}); fp32 matmul {g.get('fp32_matmul_TFLOPs')} TFLOP/s"
        )
    lines += ["", "| section | status | wall s | budget s | items ok / all |", "|---|---|---:|---:|---:|"]
    for name in SECTIONS:
        r = report["sections"].get(name)
        if not r:
            continue
        items = r.get("items", {})
        n_ok = sum(1 for it in items.values() if it.get("status") == "ok")
        lines.append(
            f"| {name} | {r.get('status')} | {_fmt(r.get('wall_s'), '.1f')} | {_fmt(r.get('budget_s'), '.0f')} "
            f"| {n_ok} / {len(items)} |"
        )
    for name in SECTIONS:
        r = report["sections"].get(name)
        if r and r.get("items"):
            lines += ["", *RENDERERS.get(name, _render_generic)(r)]
    bad = [
        (n, k, it)
        for n, r in report["sections"].items()
        for k, it in r.get("items", {}).items()
        if it.get("status") in ("failed", "mismatch")
    ]
    errs = [(n, r["error"]) for n, r in report["sections"].items() if r.get("error")]
    if bad or errs:
        lines += ["", "## Failures", ""]
        for n, err in errs:
            lines += [f"**{n}** (section):", "```", err, "```"]
        for n, k, it in bad:
            msg = it.get("error") or it.get("why") or json.dumps({a: b for a, b in it.items() if a != "status"})[:800]
            lines += [f"**{n}/{k}** {it['status']}:", "```", msg, "```"]
    return "\n".join(lines + [""])


def _render_generic(r: dict) -> list[str]:
    out = [f"## {r['name']}", "", "| item | status | wall s |", "|---|---|---:|"]
    for k, it in r.get("items", {}).items():
        out.append(f"| {k} | {it.get('status')} | {_fmt(it.get('wall_s'), '.2f')} |")
    return out


def _render_losses(r: dict) -> list[str]:
    out = [
        "## losses (device vs float64 CPU reference; tol used = max |err| / (atol + rtol |ref|), pass <= 1)",
        "",
        "| loss | dtype | status | value max abs err | grads max abs err | tol used | masked exact |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for k, it in r.get("items", {}).items():
        name, _, dtype = k.rpartition("/")
        value = it.get("value", {}).get("max_abs")
        grads = [x.get("max_abs", 0.0) for key, x in it.items() if key.startswith("grad_") and isinstance(x, dict)]
        out.append(
            f"| {name} | {dtype} | {it.get('status')} | {_fmt(value, '.2e')} | {_fmt(max(grads) if grads else None, '.2e')} "
            f"| {_fmt(it.get('worst_tol_used'), '.3f')} | {_fmt(it.get('masked_exact'))} |"
        )
    return out


def _render_train(r: dict) -> list[str]:
    out = [
        f"## train (demo models; {json.dumps(r.get('info', {}).get('settings', {}))})",
        "",
        "| run | status | steps | final loss | step s (median, after step 0) | generate / score / update s | job s |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    cmp_rows = []
    for k, it in r.get("items", {}).items():
        parts = "/".join(_fmt(it.get(f"{p}_s"), ".3f") for p in ("generate", "score", "update"))
        wall = it.get("job_wall_s") or sum(x["wall_s"] for x in it.get("launches", [])) or None
        out.append(
            f"| {k} | {it.get('status')} | {_fmt(it.get('steps_logged'))} | {_fmt(it.get('final_loss'), '.4f')} "
            f"| {_fmt(it.get('step_s'), '.3f')} | {parts} | {_fmt(wall, '.1f')} |"
        )
        c = it if k == "resume_equals_uninterrupted" else it.get("vs_single_process")
        if c:
            cmp_rows.append((k, c))
    if cmp_rows:
        out += [
            "",
            f"Equality with the uninterrupted single-process run (trajectory: rel {TRAJ_REL:g} / abs {TRAJ_ABS:g}; "
            "weights: max |diff| < 0.1 lr):",
            "",
            "| check | trajectory tol used | trajectory | weights max abs diff | weights exact | pass |",
            "|---|---:|---|---:|---|---|",
        ]
        for k, c in cmp_rows:
            ok = c.get("trajectory_pass") and c.get("weights_pass")
            out.append(
                f"| {k} | {_fmt(c.get('trajectory_tol_used'), '.3g')} | {c.get('trajectory_worst') or '-'} "
                f"| {_fmt(c.get('weights_max_abs'), '.2e')} | {_fmt(c.get('weights_exact'))} | {_fmt(bool(ok))} |"
            )
    return out


def _render_loss_bench(r: dict) -> list[str]:
    i = r.get("info", {})
    out = [
        f"## loss_bench (V={i.get('V')}, d={i.get('d')}, T={i.get('T')}, K={i.get('K')}, forward+backward, "
        f"median of {i.get('repeats')} after {i.get('warmup')} warm-up)",
        "",
        "| variant | dtype | status | median ms | TFLOP/s | peak extra MB | beyond grads MB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for k, it in r.get("items", {}).items():
        name, _, dtype = k.rpartition("/")
        out.append(
            f"| {name} | {dtype} | {it.get('status')} | {_fmt(it.get('median_ms'), '.2f')} | {_fmt(it.get('TFLOPs'), '.3g')} "
            f"| {_fmt(it.get('peak_extra_MB'), '.0f')} | {_fmt(it.get('peak_beyond_grads_MB'), '.0f')} |"
        )
    ratios = i.get("ratios", {})
    if ratios:
        out += ["", "| ratio to LSM from hidden | time | memory |", "|---|---:|---:|"]
        out += [f"| {k} | {_fmt(v.get('time'), '.2f')} | {_fmt(v.get('memory'), '.2f')} |" for k, v in ratios.items()]
    return out


def _render_rollout(r: dict) -> list[str]:
    i = r.get("info", {})
    out = [
        f"## rollout_bench ({i.get('model')}, prompts {i.get('prompt_tokens')} tokens, {i.get('new_tokens')} new, "
        f"top-p {i.get('top_p')}; static cache in opd: {i.get('static_cache')})",
        "",
        "| engine / dtype / batch | status | tokens/s | median s | ms per step | nucleus tokens | top-1 p | first call s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, it in r.get("items", {}).items():
        out.append(
            f"| {k} | {it.get('status')} | {_fmt(it.get('tokens_per_s'), '.0f')} | {_fmt(it.get('median_s'), '.3f')} "
            f"| {_fmt(it.get('ms_per_decode_step'), '.2f')} | {_fmt(it.get('nucleus_tokens_median'), '.0f')} "
            f"| {_fmt(it.get('top1_prob_median'), '.2f')} | {_fmt(it.get('first_call_s'), '.1f')} |"
        )
    return out


def _render_env(r: dict) -> list[str]:
    v = r.get("items", {}).get("versions", {})
    keys = (
        "torch",
        "torch_cuda",
        "cudnn",
        "transformers",
        "peft",
        "accelerate",
        "tokenizers",
        "math_verify",
        "datasets",
        "opd_commit",
    )
    return ["## env", "", "| key | value |", "|---|---|"] + [f"| {k} | {v.get(k)} |" for k in keys if k in v]


RENDERERS = {
    "env": _render_env,
    "losses": _render_losses,
    "train": _render_train,
    "loss_bench": _render_loss_bench,
    "rollout_bench": _render_rollout,
}


# =============================================================================== driver


def run_section(name: str, a, budget: float, report: dict, flush, logf) -> None:
    partial = a.out.with_name(f".{a.out.stem}.{name}.partial.json")
    partial.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_section", name, "--_partial", str(partial)]
    cmd += ["--_budget", f"{budget:.0f}", "--device", a.device] + (["--small"] if a.small else [])
    cmd += ["--train-jobs", a.train_jobs]
    log(f"section {name}: budget {budget:.0f} s")
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, bufsize=1
    )
    recent: list[str] = []

    def pump():
        for line in proc.stdout:
            logf.write(line)
            logf.flush()
            recent.append(line)
            del recent[:-60]
            if line.startswith(PREFIX):
                print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = None
    while proc.poll() is None:
        if time.perf_counter() - t > budget + GRACE_S:
            kill_group(proc)
            status = f"timeout: killed after {budget + GRACE_S:.0f} s"
            break
        time.sleep(1.0)
        merge_partial(report, name, partial)
        flush()
    reader.join(timeout=10)
    merge_partial(report, name, partial)
    sec = report["sections"].setdefault(name, {"name": name, "items": {}})
    sec["wall_s"] = round(time.perf_counter() - t, 1)
    sec["budget_s"] = round(budget)
    rc = proc.returncode
    if status:
        sec["status"] = status
    elif rc != 0:
        sec["status"] = "failed"
        sec["error"] = f"section process exited {rc}:\n" + tail("".join(recent), 25)
    elif sec.get("status") in (None, "running"):
        sec["status"] = "failed"
        sec["error"] = "section process ended without a result:\n" + tail("".join(recent), 25)
    log(f"section {name}: {sec['status']} ({sec['wall_s']:.0f} s)")
    flush()


def merge_partial(report: dict, name: str, partial: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        report["sections"][name] = json.loads(partial.read_text())


def main_parent(a) -> int:
    a.out = a.out.resolve()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    md_path, log_path = a.out.with_suffix(".md"), a.out.with_suffix(".log")
    budgets = dict(BUDGETS["cuda" if a.device.startswith("cuda") else "cpu"])
    global_budget = a.budget or GLOBAL_BUDGET["cuda" if a.device.startswith("cuda") else "cpu"]
    skip = {s.strip() for s in (a.skip or "").split(",") if s.strip()}
    unknown = skip - set(SECTIONS)
    if unknown:
        print(f"--skip: unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    report = {
        "tool": "benchmarks/gpu_check.py",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "opd_commit": opd_commit(),
        "commit": opd_commit(),  # the key every benchmark JSON has (tests/test_docs.py)
        # the GPU and torch are added from the env section when it has run (machine_from_env)
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": {"device": a.device, "small": a.small, "global_budget_s": global_budget, "budgets_s": budgets},
        "sections": {},
    }
    t0 = time.perf_counter()

    def flush() -> str:
        report["wall_s"] = round(time.perf_counter() - t0, 1)
        report["machine"].update(machine_from_env(report["sections"].get("env", {})))
        with contextlib.suppress(Exception):
            write_json(a.out, report)
        try:
            md = render(report)
        except Exception:
            md = "# opd GPU check: the Markdown could not be rendered (the JSON holds the results)\n\n```\n"
            md += traceback.format_exc() + "```\n"
        with contextlib.suppress(OSError):
            md_path.write_text(md)
        return md

    log(f"device {a.device}{' (small)' if a.small else ''}; global budget {global_budget} s; out {a.out}")
    with open(log_path, "w") as logf:
        for name in SECTIONS:
            if name in skip:
                report["sections"][name] = {"name": name, "status": "skipped: --skip", "items": {}}
                continue
            left = global_budget - (time.perf_counter() - t0)
            budget = min(budgets[name], left - GRACE_S)
            if budget < 10:
                report["sections"][name] = {
                    "name": name,
                    "status": f"skipped: global budget ({left:.0f} s left)",
                    "items": {},
                }
                flush()
                continue
            try:
                run_section(name, a, budget, report, flush, logf)
            except Exception:
                report["sections"][name] = {
                    "name": name,
                    "status": "failed",
                    "items": {},
                    "error": tail(traceback.format_exc()),
                }
            flush()
    for p in a.out.parent.glob(f".{a.out.stem}.*.partial.json"):
        p.unlink(missing_ok=True)
    print(flush(), flush=True)
    log(f"wrote {a.out}, {md_path} and {log_path}")
    return 0


SECTION_FUNCS = {
    "env": section_env,
    "losses": section_losses,
    "train": section_train,
    "loss_bench": section_loss_bench,
    "rollout_bench": section_rollout_bench,
    "vllm_sleep": section_vllm_sleep,
}


def main_section(a) -> int:
    sec = Section(a._section, Path(a._partial), a._budget, a.device, a.small)
    try:
        SECTION_FUNCS[a._section](sec, a)
    except Exception:
        sec.result["error"] = tail(traceback.format_exc())
        log(f"{a._section}: section error\n{sec.result['error']}")
    sec.finish()
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a dry run)")
    p.add_argument("--small", action="store_true", help="small sizes everywhere (the CPU dry run)")
    p.add_argument(
        "--out", type=Path, default=HERE / "results" / "gpu_check.json", help="JSON path (.md and .log next to it)"
    )
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {', '.join(SECTIONS)}")
    p.add_argument(
        "--budget", type=float, default=None, help="global wall-clock budget in s (default 460 on cuda, 1800 on cpu)"
    )
    p.add_argument(
        "--train-jobs",
        default="all",
        help="the train section's objective runs to do, comma-separated (none: only the resume and torchrun ones)",
    )
    p.add_argument("--_section", help=argparse.SUPPRESS)
    p.add_argument("--_partial", help=argparse.SUPPRESS)
    p.add_argument("--_budget", type=float, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["--_train-worker"]:
        train_worker(argv[1], argv[2])
        return 0
    if argv[:1] == ["--_dist-worker"]:
        dist_worker(argv[1], argv[2:])
        return 0
    if argv[:1] == ["--_static-worker"]:
        static_worker(argv[1], bool(int(argv[2])), int(argv[3]))
        return 0
    a = parse_args(argv)
    return main_section(a) if a._section else main_parent(a)


if __name__ == "__main__":
    sys.exit(main())
