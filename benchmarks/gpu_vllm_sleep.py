"""The ``vllm_sleep`` section of benchmarks/gpu_check.py: ``--vllm-sleep`` on a real vLLM server on a GPU.

vLLM's sleep mode runs on CUDA only, so the tests on CPU check opd's calls against a stand-in
(tests/rollout/test_vllm_sleep.py); this checks what the stand-in assumes, with opd's own engine
(:class:`opd.rollout.vllm_engine.VLLMRollout`) on a server opd starts (``--enable-sleep-mode``, eager,
30% of the GPU) with the demo student, at each level:

* asleep after a rollout, the engine frees GPU memory: the device's free memory asleep minus awake
  (``torch.cuda.mem_get_info``, the whole device), which should be most of the engine's share;
* woken and synced, it serves the student: greedy rollouts before and after a sleep are the same, and
  after the student's weights change (noise added, as an optimizer step would) the next rollout passes
  the policy check (the engine's log-probs of its tokens against the student's; level 2 drops the weights,
  so this fails unless the sync ran between the two wakes).

Needs vLLM set up (``opd vllm-setup``, or ``OPD_VLLM_PYTHON``); skipped otherwise, and on a CPU run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

MAX_GAP = 0.05  # nats per token: a sync that did not happen shows as whole nats (random or stale weights)


def section_vllm_sleep(sec, a) -> None:
    import torch

    from opd.errors import UserError
    from opd.rollout.vllm_server import vllm_python

    if sec.device == "cpu" or not torch.cuda.is_available():
        sec.result["items"]["levels"] = {"status": "skipped: vLLM's sleep mode runs on CUDA GPUs only"}
        return
    try:
        sec.result["info"]["vllm_python"] = str(vllm_python())
    except UserError as exc:
        sec.result["items"]["levels"] = {"status": f"skipped: {exc}"}
        return
    with tempfile.TemporaryDirectory(prefix="opd-vllm-sleep-") as tmp:
        state: dict = {}
        sec.item("start", lambda: _start(sec, Path(tmp), state), min_left=60)
        if "server" not in state:
            return
        try:
            for level in (1, 2):
                sec.item(f"level{level}", lambda level=level: _level(sec, state, level, Path(tmp)), min_left=20)
        finally:
            state["server"].stop()


def _start(sec, tmp: Path, state: dict) -> dict:
    from opd.models.loading import load_model, load_tokenizer
    from opd.rollout.vllm_server import start_vllm_server

    demo = Path(__file__).resolve().parent.parent / "src" / "opd" / "assets" / "demo" / "student"
    dev = f"cuda:{sec.device.split(':')[1]}" if ":" in sec.device else "cuda"
    state["student"] = load_model(demo, "student", "float32", dev)
    state["tok"] = load_tokenizer(demo, "student")
    args = ["--enable-sleep-mode", "--enforce-eager", "--gpu-memory-utilization", "0.3"]
    timeout = max(30.0, sec.left() - 60)
    state["server"] = start_vllm_server(
        demo, tmp / "server.log", dtype="float32", max_model_len=512, dev_mode=True, extra_args=args, timeout=timeout
    )
    return {"server_args": " ".join(args)}


def _level(sec, state: dict, level: int, tmp: Path) -> dict:
    import torch

    from opd.rollout.vllm_engine import VLLMRollout
    from opd.rollout.vllm_sync import FolderSync

    student, tok = state["student"], state["tok"]
    engine = VLLMRollout(
        student,
        tok,
        tmp,
        server=state["server"],
        sync=FolderSync("file", tmp / f"w{level}"),
        max_gap=MAX_GAP,
        sleep=level,
    )
    prompts = [tok.encode(p) for p in ("12+7=", "3*4+5=", "Compute 8-3.", "9+9+1=")]
    roll = lambda: engine.generate(prompts, list(range(len(prompts))), max_new_tokens=24, greedy=True)
    free = lambda: torch.cuda.mem_get_info()[0] / 2**30
    first = roll()  # synced (the engine is new), then asleep
    asleep_gib = free()
    second = roll()  # woken; level 2 synced again
    assert engine.sleep_mode is not None and engine.sleep_mode.asleep
    engine.sleep_mode.wake(lambda: None)  # awake, to measure; the next rollout finds it awake
    awake_gib = free()
    with torch.no_grad():  # as an optimizer step would: the next rollout must serve these weights
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    engine.weights_changed()
    gap_after_change = roll().report.policy_gap
    last = roll().report  # asleep and woken once more on the changed weights
    engine.sleep_mode.wake(lambda: None)  # left awake: the next level's engine starts on an awake server
    freed = asleep_gib - awake_gib
    same = bool(torch.equal(first.response_ids_NT, second.response_ids_NT))
    ok = same and freed > 1.0
    return {
        "status": "ok" if ok else "mismatch",
        "free_asleep_GiB": round(asleep_gib, 2),
        "free_awake_GiB": round(awake_gib, 2),
        "freed_GiB": round(freed, 2),
        "same_greedy_rollouts_across_a_sleep": same,
        "policy_gap_after_weights_changed": gap_after_change,
        "policy_gap_last": last.policy_gap,
        "wake_and_sync_s_last": round(last.sync_seconds or 0.0, 3),
    }
