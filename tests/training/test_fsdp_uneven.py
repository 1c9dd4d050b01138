"""FSDP training when the ranks' micro-batches need different numbers of forwards (tests/training/fsdp_uneven.py):
rank 0's one micro-batch of 11 short rows runs in two chunks of rows and its padding micro-batch in one, rank
1's two micro-batches of long rows in one each. Every rank must still make the same collectives (FSDP gathers
each block in every forward and again in its backward): the step completes, within the ranks' 30 s collective
timeout, and its loss and gradients equal those of one process training on both ranks' rollouts (float64:
relative 1e-12; observed about 2e-16). Work without gradients on the gathered student (``Dist.full_call``)
may still make any number of forwards on each rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import ENV, free_port


def test_fsdp_uneven_chunks_match_one_process(tmp_path):
    script = str(Path(__file__).with_name("fsdp_uneven.py"))
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path)], env={**env, "RANK": str(r)}, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        errs = [p.communicate(timeout=120)[1] for p in ranks]
    finally:  # a hang past the collective timeout must not leave the ranks running
        for p in ranks:
            p.kill()
    assert all(p.returncode == 0 for p in ranks), errs
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["rows"] for f in found] == [11, 3]
    for rank, f in enumerate(found):
        for objective in ("lsm", "full_kl"):
            got = f[objective]
            assert got["micro_batches"] == 2 and got["grad_norm"] > 0, (rank, objective, got)
            assert got["loss"] < 1e-12 and got["grad"] < 1e-12, (rank, objective, got)
        assert f["full_call"] == 0.0  # the gathered weights are the whole student's: the same computation
