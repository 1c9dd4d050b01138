"""The vLLM teacher server the slow tests share (vLLM's CPU build, set up by ``opd vllm-setup``).

One server on the packaged demo teacher (float32, ``--max-logprobs MAX_LOGPROBS``, ``--api-key KEY``),
started once per session for every module that takes the ``vllm_teacher`` fixture
(tests/rollout/test_vllm.py, tests/teachers/test_pool_vllm.py): a vLLM start costs 1-2 minutes here.
Their tests carry ``ON_TEACHER_SERVER`` (one ``xdist_group``), so that under ``--dist loadgroup`` they
run on one worker and the server starts once. Without a vLLM environment the fixture skips (fails under
``OPD_REQUIRE_VLLM=1``, as in CI).
"""

from __future__ import annotations

from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "src" / "opd" / "assets" / "demo"
KEY = "opd-test-key-7f3c9a"  # grepped for in run directories: it must never be written there
MAX_LOGPROBS = 32
ON_TEACHER_SERVER = pytest.mark.xdist_group("vllm-teacher")  # every test that takes the fixture vllm_teacher


@pytest.fixture(scope="session")
def vllm_teacher(tmp_path_factory):
    """The URL of a vLLM server on the demo teacher (float32, --max-logprobs 32, --api-key KEY)."""
    from helpers import needs_vllm

    from opd.rollout.vllm_server import start_vllm_server

    needs_vllm()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = start_vllm_server(
        DEMO / "teacher", log, max_model_len=512, max_logprobs=MAX_LOGPROBS, api_key=KEY, timeout=900
    )
    yield server.url
    server.stop()
