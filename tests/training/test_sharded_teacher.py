"""The in-process teacher sharded by FSDP under ``--fsdp`` (opd.teachers.sharded): 2 gloo ranks score their
own batches (of 11 and 3 rows, so their forwards differ in number) with the sharded teacher and with the
whole one, untied and tied (the head shared with the embedding). Exact equality is expected: the gathered
weights are the whole teacher's, bit for bit, and the computation on them is the same."""

from __future__ import annotations

from pathlib import Path

from helpers import two_rank_script

from opd.config import TrainConfig
from opd.teachers import factory


def test_sharded_teacher_scores_equal_the_whole_teachers(tmp_path):
    script = str(Path(__file__).with_name("sharded_teacher.py"))
    found = two_rank_script(script, tmp_path, timeout=300)
    assert [f["rows"] for f in found] == [11, 3]  # 2 forwards of 8-row chunks on rank 0, 1 on rank 1
    exact = {"ids": 0, "topk_logprobs_NTK": 0.0, "sampled_logprobs_NT": 0.0, "query_logprobs_NTQ": 0.0}
    exact["diag_logits_MV"] = 0.0
    for rank, f in enumerate(found):
        for tied in (False, True):
            assert 0.49 < f[f"local_share_tied{tied}"] < 0.51  # each rank holds half of the teacher
            assert f[f"score_tied{tied}"] == exact, (rank, tied)
            # the full-vocabulary objectives' hidden states and head, the head read after the call returned
            assert f[f"hidden_tied{tied}"] == 0.0 and f[f"head_tied{tied}"] == 0.0, (rank, tied)
            assert f[f"head_shape_tied{tied}"] == [97, 64]
            # rank 1's computation failed at once: rank 0's forwards completed, and the next score is exact
            assert f[f"error_tied{tied}"] == (None if rank == 0 else "ZeroDivisionError")
            assert f[f"after_error_tied{tied}"] == exact, (rank, tied)
        # called inside the FSDP student's forward, as the trainer's loss calls it
        assert f["inside_student_hidden"] == 0.0 and f["inside_student_head"] == 0.0


def test_make_teacher_shards_under_fsdp_only(tiny_models, monkeypatch):
    """--fsdp gives the trainer the sharded teacher, and a run without it the whole one."""
    made = []
    monkeypatch.setattr(factory, "ShardedTeacher", lambda model: made.append(model) or "sharded")
    from opd.models.loading import load_model, load_tokenizer

    student = load_model(str(tiny_models[0]), "student", "float32", "cpu")
    tok = load_tokenizer(str(tiny_models[0]), "student")
    plain = factory.make_teacher(TrainConfig.from_flat(teacher=str(tiny_models[1])), student, tok)
    assert isinstance(plain, factory.HFTeacher) and not made
    # a TrainConfig with --fsdp as a launch gives it (its checks need no process group)
    cfg = TrainConfig.from_flat(teacher=str(tiny_models[1]), fsdp=True)
    assert factory.make_teacher(cfg, student, tok) == "sharded" and len(made) == 1
