"""Shared fixtures: a locally trained tokenizer and tiny random Qwen2 models (no downloads).

Under pytest-xdist each worker gets one torch thread, so two workers on two cores do not fight.
"""

from __future__ import annotations

import os

# No test reaches the Hub: Hub names resolve from caches the tests lay out themselves (tests/hub_cache.py).
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# opd_warnings: a deprecation warning that opd's own code causes fails the test.
# xdist_groups: --dist loadgroup keeps an xdist_group on one worker (pytest 9.2 broke xdist's own way).
# vllm_servers: the vLLM teacher server that the slow vLLM tests of several modules share.
pytest_plugins = ["opd_warnings", "pytester", "hub_cache", "xdist_groups", "vllm_servers"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from opd.models.tokenizer import train_tokenizer
    from opd.tasks import ArithmeticTask

    examples = ArithmeticTask(n_train=1500, n_test=50).examples("train")
    tok = train_tokenizer([e.prompt for e in examples] + [e.solution for e in examples], vocab_size=1024)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return path


def make_tiny_model(tok_dir, out_dir, layers=1, width=32, seed=0):
    from opd.models.loading import load_tokenizer, tiny_qwen2

    tok = load_tokenizer(tok_dir, "tokenizer")
    torch.manual_seed(seed)
    model = tiny_qwen2(len(tok), layers, width, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tiny_tokenizer, tmp_path_factory):
    """(student_dir, teacher_dir): one-layer random models sharing the tokenizer."""
    root = tmp_path_factory.mktemp("models")
    student = make_tiny_model(tiny_tokenizer, root / "student", layers=1, width=32, seed=1)
    teacher = make_tiny_model(tiny_tokenizer, root / "teacher", layers=1, width=64, seed=2)
    return student, teacher
