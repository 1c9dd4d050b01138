"""A teacher pool of a real vLLM server (vLLM's CPU build) and an ``opd serve-teacher`` process on the
demo teacher: one pool across the two formats (vLLM's JSON, opd's binary answers), scores equal to the
in-process teacher's, and the opd server killed between two scorings costing nothing.

Slow (vLLM's start takes minutes here): CI's second step, like tests/rollout/test_vllm.py, whose
tolerance it shares. Without a vLLM environment it skips (fails under ``OPD_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import needs_vllm, rollouts
from test_teacher_restart import ServedTeacher

from opd.models.loading import load_model, load_tokenizer
from opd.teachers.client import HTTPTeacher
from opd.teachers.scoring import HFTeacher

DEMO = Path(__file__).resolve().parents[2] / "src" / "opd" / "assets" / "demo"
K = 32
TOL = 2e-4  # float32 on both sides, different kernels (tests/rollout/test_vllm.py)

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]  # one vLLM server at a time on a worker


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """(vLLM's server, opd's server) on the demo teacher, both under the same model name (its path)."""
    from opd.rollout.vllm_server import start_vllm_server

    needs_vllm()
    logs = tmp_path_factory.mktemp("pool-vllm")
    opd = ServedTeacher(DEMO / "teacher", logs / "opd.txt")
    opd.start()
    vllm = start_vllm_server(DEMO / "teacher", logs / "vllm.txt", max_model_len=512, max_logprobs=K, timeout=900)
    try:
        opd.wait_ready(300)
        yield vllm, opd
    finally:
        opd.stop()
        vllm.stop()


def test_a_pool_of_vllm_and_opd_servers_scores_as_the_in_process_teacher(pool):
    vllm, opd = pool
    tok = load_tokenizer(DEMO / "student", "student")
    batch = rollouts(tok, DEMO / "student", n=12, new_tokens=40)
    lines = []
    client = HTTPTeacher([vllm.url, opd.url], tok, 2048, k=K, prompts_per_request=2, wait=0, log=lines.append)
    vllm_info, opd_info = (s.info for s in client.pool.servers)
    assert vllm_info == {"opd": False, "binary": False} and opd_info == {"opd": True, "binary": True}
    want = HFTeacher(load_model(DEMO / "teacher", "teacher")).score(batch, K)
    m = batch.response_mask_NT

    def same(got) -> None:  # log-probs sorted descending, so near-ties that swap ids still compare
        torch.testing.assert_close(got.topk_logprobs_NTK[m], want.topk_logprobs_NTK[m].float(), atol=TOL, rtol=0)
        torch.testing.assert_close(got.sampled_logprobs_NT[m], want.sampled_logprobs_NT[m].float(), atol=TOL, rtol=0)
        assert (got.topk_ids_NTK[m] == want.topk_ids_NTK[m]).float().mean() > 0.99

    same(client.score(batch, K))
    answered = [s.answered for s in client.pool.servers]
    assert sum(answered) == 6 and min(answered) >= 1  # six requests of two rollouts, shared
    opd.kill()
    same(client.score(batch, K))  # with --teacher-wait 0: moving to another server is not waiting
    assert [s.answered for s in client.pool.servers] == [answered[0] + 6, answered[1]]
    assert lines == [
        f"teacher server {opd.url} failed (connection refused); its requests go to the other 1 server(s) while it "
        "is asked again, every 15 s at most"
    ]
