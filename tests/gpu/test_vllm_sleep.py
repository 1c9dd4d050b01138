"""``--vllm-sleep`` 1 and 2 on a real vLLM server on a GPU. vLLM's sleep mode runs on CUDA only, so the CPU
tests check opd's calls against a stand-in (tests/rollout/test_vllm_sleep.py); this checks what the stand-in
assumes, with opd's own engine (:class:`opd.rollout.vllm_engine.VLLMRollout`) on a server opd starts
(``--enable-sleep-mode``, eager, 30% of the GPU) with the demo student, at each level:

* asleep after a rollout, the engine frees GPU memory: the device's free memory asleep minus awake
  (``torch.cuda.mem_get_info``, the whole device), more than 1 GiB;
* woken and synced, it serves the student: greedy rollouts before and after a sleep are the same, and after
  the student's weights change (noise added, as an optimizer step would) the next rollouts pass the policy
  check (the engine's log-probs of its tokens against the student's; level 2 drops the weights, so this
  fails unless the sync ran between the two wakes).

Needs vLLM set up (``opd vllm-setup``, or ``OPD_VLLM_PYTHON``) and CUDA: skipped otherwise, the dry run too.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import DEMO

pytestmark = pytest.mark.gpu
MAX_GAP = 0.05  # nats per token: a sync that did not happen shows as whole nats (random or stale weights)


@pytest.fixture(scope="module")
def served(device, tmp_path_factory):
    """The demo student, its tokenizer and a vLLM server with sleep mode on (CUDA and vLLM, or a skip)."""
    from opd.errors import UserError
    from opd.models.loading import load_model, load_tokenizer
    from opd.rollout.vllm_server import start_vllm_server, vllm_python

    if device.type != "cuda":
        pytest.skip("vLLM's sleep mode runs on CUDA GPUs only")
    try:
        vllm_python()
    except UserError as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("vllm_sleep")
    student = load_model(DEMO / "student", "student", "float32", str(device))
    tok = load_tokenizer(DEMO / "student", "student")
    args = ["--enable-sleep-mode", "--enforce-eager", "--gpu-memory-utilization", "0.3"]
    server = start_vllm_server(
        DEMO / "student", tmp / "server.log", dtype="float32", max_model_len=512, dev_mode=True, extra_args=args,
        timeout=180.0,
    )  # fmt: skip
    try:
        yield student, tok, server, tmp
    finally:
        server.stop()


@pytest.mark.parametrize("level", [1, 2])
def test_vllm_sleep_frees_memory_and_serves_the_student(level, served, record_property):
    from opd.rollout.vllm_engine import VLLMRollout
    from opd.rollout.vllm_sync import FolderSync

    student, tok, server, tmp = served
    sync = FolderSync("file", tmp / f"w{level}")
    engine = VLLMRollout(student, tok, tmp, server=server, sync=sync, max_gap=MAX_GAP, sleep=level)
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
    third = roll()  # the policy check (max_gap) raises if the served weights are not the student's
    record_property("policy_gap_after_weights_changed", third.report.policy_gap)
    engine.weights_changed()  # so that the last rollout times a wake and a sync at each level
    last = roll()  # asleep and woken once more, synced
    engine.sleep_mode.wake(lambda: None)  # left awake: the next level's engine starts on an awake server
    record_property("free_asleep_GiB", round(asleep_gib, 2))
    record_property("free_awake_GiB", round(awake_gib, 2))
    record_property("policy_gap_last", last.report.policy_gap)
    record_property("wake_and_sync_s_last", round(last.report.sync_seconds, 3))
    assert torch.equal(first.response_ids_NT, second.response_ids_NT), "greedy rollouts differ across a sleep"
    assert asleep_gib - awake_gib > 1.0, f"asleep, the engine freed {asleep_gib - awake_gib:.2f} GiB"
