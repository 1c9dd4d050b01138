"""A teacher pool of a real vLLM server (vLLM's CPU build) and an ``opd serve-teacher`` process on the
demo teacher: one pool across the two formats (vLLM's JSON, opd's binary answers), scores equal to the
in-process teacher's, and the opd server killed between two scorings costing nothing.

The vLLM server is tests/rollout/test_vllm.py's (``vllm_teacher``, tests/vllm_servers.py: one vLLM start
for both modules), whose API key the client sends to both servers (opd's, without keys, ignores it).
Slow: CI's second step, like tests/rollout/test_vllm.py, whose tolerance it shares. Without a vLLM
environment it skips (fails under ``OPD_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import rollouts
from test_teacher_restart import ServedTeacher
from vllm_servers import DEMO, KEY, MAX_LOGPROBS, ON_TEACHER_SERVER

from opd.models.loading import load_model, load_tokenizer
from opd.teachers.client import HTTPTeacher
from opd.teachers.scoring import HFTeacher

K = MAX_LOGPROBS
TOL = 2e-4  # float32 on both sides, different kernels (tests/rollout/test_vllm.py)

pytestmark = [ON_TEACHER_SERVER, pytest.mark.slow]  # on the worker that holds the shared vLLM server


@pytest.fixture(scope="module")
def pool(vllm_teacher, tmp_path_factory):
    """(vLLM's server's URL, opd's server) on the demo teacher, both under the same model name (its path)."""
    opd = ServedTeacher(DEMO / "teacher", tmp_path_factory.mktemp("pool-vllm") / "opd.txt")
    opd.start()
    try:
        opd.wait_ready(300)
        yield vllm_teacher, opd
    finally:
        opd.stop()


def test_a_pool_of_vllm_and_opd_servers_scores_as_the_in_process_teacher(pool):
    vllm_url, opd = pool
    tok = load_tokenizer(DEMO / "student", "student")
    batch = rollouts(tok, DEMO / "student", n=12, new_tokens=40)
    lines = []
    urls = [vllm_url, opd.url]
    client = HTTPTeacher(urls, tok, 2048, k=K, prompts_per_request=2, wait=0, log=lines.append, api_key=KEY)
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
