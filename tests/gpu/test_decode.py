"""opd's static KV cache on the device (``--static-cache``), against the dynamic cache it replaces: the checks
of benchmarks/bench_decode.py, whose tables (tokens/s of every engine, batch and precision, HF generate's
static cache beside them) stay a benchmark. On CUDA the decode step is captured as a CUDA graph and
replayed; the checks are that it was captured, that the log-probs it records are a plain forward's over
its rollouts (a graph that read stale buffers or weights is off by nats, not rounding), and that weights
changed in place after the capture (as an optimizer step writes them) are the ones the replayed graph
uses, with no second capture. On the CPU (no graph) the rows equal the dynamic cache's token for token.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import DRY_RUN, NOT_IN_DRY_RUN, benchmark

pytestmark = pytest.mark.gpu
# Max |recorded - forward| log-prob (nats): the CPU computes both paths alike (float32: rounding only); CUDA
# rounds otherwise between kernels and runs float32 matmuls in TF32 as opd trains, so its bound is the
# "not whole nats" one.
GAP = {
    "cpu": {"float32": 1e-4, "bf16-mixed": 0.1, "bf16-pure": 0.1},
    "cuda": dict.fromkeys(("float32", "bf16-mixed", "bf16-pure"), 0.1),
}


@pytest.fixture
def decode(device):
    """bench_decode's settings (a Qwen2.5-0.5B body, or the tiny one in the dry run) at one batch of 16, as
    opd train sets the device math up (TF32 on, cuDNN attention off on CUDA)."""
    BD = benchmark("bench_decode")
    from opd.models.precision import configure_device_math

    configure_device_math(device, "float32", None, "gpu tests")
    s = {**BD.settings(DRY_RUN), "batches": (4,) if DRY_RUN else (16,), "repeats": 1}
    return BD, s


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_static_cache_matches_dynamic(precision, decode, device, record_property):
    BD, s = decode
    batch, gap = s["batches"][0], GAP[device.type][precision]
    model, tok = BD.build(s["shape"], device, precision)
    dyn_row, dynamic = BD.opd_row(model, tok, s, batch, "off")
    row, static = BD.opd_row(model, tok, s, batch, "on")
    same = BD.same_rows(static, dynamic)
    for key in ("tokens_per_s", "first_call_s", "capture_s", "logp_gap", "graph", "graph_error"):
        record_property(key, row.get(key))
    record_property("dynamic_tokens_per_s", dyn_row["tokens_per_s"])
    record_property("dynamic_logp_gap", dyn_row["logp_gap"])
    record_property("same_tokens", same)
    assert row["tokens"] == dyn_row["tokens"] == batch * s["new"]
    assert row["logp_gap"] < gap and dyn_row["logp_gap"] < gap, (row["logp_gap"], dyn_row["logp_gap"])
    if device.type == "cuda":
        assert row["graph"], f"no CUDA graph: {row['graph_error']}"
    else:
        assert same == 1.0, "the static cache's tokens differ from the dynamic cache's on the CPU"
    got = BD.inplace_check(model, s, batch, row["_engine"])
    record_property("inplace_logp_gap", got["logp_gap"])
    assert got["new_captures"] == 0, "the weights changed in place and the graph was captured again"
    assert got["logp_gap"] < gap, f"after an in-place update the replay is {got['logp_gap']} nats off"


@pytest.mark.parametrize(
    "precision,graphs", [("bf16-pure", None), pytest.param("float32", False, marks=NOT_IN_DRY_RUN)]
)
def test_static_cache_other_paths(precision, graphs, decode, device, record_property):
    """Pure bfloat16 weights (what HF generate's figures ran), and the static cache run eagerly (no graph):
    every token written, the log-probs a forward's."""
    BD, s = decode
    batch = s["batches"][0]
    model, tok = BD.build(s["shape"], device, precision)
    row, _ = BD.opd_row(model, tok, s, batch, "on", graphs=graphs)
    record_property("tokens_per_s", row["tokens_per_s"])
    record_property("logp_gap", row["logp_gap"])
    assert row["tokens"] == batch * s["new"]
    assert row["logp_gap"] < GAP[device.type][precision], row["logp_gap"]
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
