"""Run by tests/training/test_sharded_teacher.py in each of 2 gloo ranks (RANK, WORLD_SIZE, MASTER_* set):
a 2-block teacher, untied and tied, scored whole (:class:`HFTeacher`) and sharded by FSDP
(:class:`ShardedTeacher`) on this rank's batch, which holds a different number of rows on each rank
(11 and 3: two forwards of ``response_hidden``'s chunks of 8 on rank 0, one on rank 1). Each rank
writes what it found to ``OUT/rank<r>.json``.

Usage: python sharded_teacher.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from opd.models.loading import tiny_qwen2
from opd.rollout.engine import Sample
from opd.rollout.forward import response_hidden
from opd.rollout.served import single_turn_batch
from opd.teachers.scoring import HFTeacher
from opd.teachers.sharded import ShardedTeacher
from opd.training.distributed import init_distributed, shutdown

V, K = 97, 5


def teacher(tied: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(3)  # the same weights on every rank (FSDP keeps each rank's part of its own copy)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


def rank_batch(rank: int):
    g = torch.Generator().manual_seed(rank)
    rows = 11 if rank == 0 else 3
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    prompts = [torch.randint(1, V, (rand(2, 9),), generator=g).tolist() for _ in range(rows)]
    samples = [Sample(torch.randint(1, V, (rand(1, 8),), generator=g).tolist(), [0.0] * 8, False) for _ in range(rows)]
    samples = [Sample(s.ids, s.logprobs[: len(s.ids)], False) for s in samples]
    return single_turn_batch(prompts, samples, 0, torch.device("cpu"))


def differences(want, got) -> dict:
    """Largest absolute difference of each score field (ids: the count of differing ids)."""
    out = {"ids": int((want.topk_ids_NTK != got.topk_ids_NTK).sum())}
    for name in ("topk_logprobs_NTK", "sampled_logprobs_NT", "query_logprobs_NTQ", "diag_logits_MV"):
        out[name] = float((getattr(want, name) - getattr(got, name)).abs().max())
    return out


def main(out: Path) -> None:
    dist = init_distributed(fsdp=True)
    batch = rank_batch(dist.rank)
    N, T = batch.response_ids_NT.shape
    query = torch.randint(0, V, (N, T, 3), generator=torch.Generator().manual_seed(9))
    diag = batch.action_mask_NT.reshape(-1).nonzero().squeeze(-1)[:4]
    found: dict = {"rows": N}
    for tied in (False, True):
        plain, sharded = HFTeacher(teacher(tied)), ShardedTeacher(teacher(tied))
        params = list(sharded.model.parameters())
        found[f"local_share_tied{tied}"] = sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params)
        want = plain.score(batch, K, query, diag)
        found[f"score_tied{tied}"] = differences(want, sharded.score(batch, K, query, diag))
        h_want, head_want = plain.hidden_and_head(batch)
        h_got, head_got = sharded.hidden_and_head(batch)  # the head read after the call: whole, a copy
        found[f"hidden_tied{tied}"] = float((h_want - h_got).abs().max())
        found[f"head_tied{tied}"] = float((head_want.weight_VD - head_got.weight_VD).abs().max())
        found[f"head_shape_tied{tied}"] = list(head_got.weight_VD.shape)
        # a rank whose computation fails at once: the other's forwards still complete, the error is this
        # rank's alone, and the next call is in step again
        try:
            sharded._call(lambda m: 1 / 0 if dist.rank == 1 else response_hidden(m, batch))
            found[f"error_tied{tied}"] = None
        except ZeroDivisionError as exc:
            found[f"error_tied{tied}"] = type(exc).__name__
        found[f"after_error_tied{tied}"] = differences(want, sharded.score(batch, K, query, diag))
    # as the trainer calls it: inside the FSDP student's own forward (a full-vocabulary objective's loss)
    torch.manual_seed(1)
    dist.wrap(tiny_qwen2(V, 1, 32, eos_id=1, pad_id=0))
    h_in, head_in = dist.train_call(lambda _: sharded.hidden_and_head(batch))
    found["inside_student_hidden"] = float((h_want - h_in).abs().max())
    found["inside_student_head"] = float((head_want.weight_VD - head_in.weight_VD).abs().max())
    (out / f"rank{dist.rank}.json").write_text(json.dumps(found))
    shutdown(dist)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
