"""FSDP training when the ranks' micro-batches need different numbers of forwards (tests/training/fsdp_uneven.py):
rank 0's one micro-batch of 11 short rows runs in two chunks of rows and its padding micro-batch in one, rank
1's two micro-batches of long rows in one each. Every rank must still make the same collectives (FSDP gathers
each block in every forward and again in its backward): the step completes, within the ranks' 30 s collective
timeout, and its loss and gradients equal those of one process training on both ranks' rollouts (float64:
relative 1e-12; observed about 2e-16). Work without gradients on the gathered student (``Dist.full_call``)
may still make any number of forwards on each rank."""

from __future__ import annotations

from pathlib import Path

from helpers import two_rank_script


def test_fsdp_uneven_chunks_match_one_process(tmp_path):
    script = str(Path(__file__).with_name("fsdp_uneven.py"))
    found = two_rank_script(script, tmp_path, timeout=120)
    assert [f["rows"] for f in found] == [11, 3]
    for rank, f in enumerate(found):
        for objective in ("lsm", "full_kl"):
            got = f[objective]
            assert got["micro_batches"] == 2 and got["grad_norm"] > 0, (rank, objective, got)
            assert got["loss"] < 1e-12 and got["grad"] < 1e-12, (rank, objective, got)
        assert f["full_call"] == 0.0  # the gathered weights are the whole student's: the same computation
