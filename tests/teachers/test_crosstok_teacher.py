"""Cross-tokenizer OPD in the trainer: the scorer in the student's frame, `opd train`, refusals, bad input.

The student is the session's tiny model (opd's byte-level BPE, ``<|im_end|>``, ChatML template);
the teacher has a clearly different tokenizer: a SentencePiece-style BPE trained on the same task
(``▁`` spellings, ``<0xNN>`` byte fallback, another vocabulary size, ``<s>``/``</s>``, a
``[USER]``/``[ASSISTANT]`` template), saved apart from the teacher model (``--teacher-tokenizer``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from crosstok_tokenizers import make_teacher_tok
from helpers import SMALL as MULTI_PROCESS_SMALL
from helpers import first_rollout, read_metrics, run_options, step_records
from typer.testing import CliRunner

from opd import crosstok
from opd.cli import app
from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer, tiny_qwen2
from opd.models.tokenizer import format_prompt
from opd.report.charts import build_charts
from opd.report.load import load_runs
from opd.rollout.sampling import RolloutBatch
from opd.teachers.crosstok import CrossTokenizerTeacher
from opd.teachers.factory import make_teacher
from opd.teachers.scoring import HFTeacher, TeacherScores
from opd.training import loop as train_mod
from opd.training.loss import loss_mask, objective_loss, scored_loss_mask

SMALL = {**MULTI_PROCESS_SMALL, "steps": 2, "batch_size": 4, "ckpt_every": 0}
CROSS_KEYS = ("cross/one_to_one", "cross/mapped_mass", "cross/dropped")


@pytest.fixture(scope="module")
def cross_models(tiny_models, tmp_path_factory):
    """(student_dir, teacher_dir, teacher_tokenizer_dir): the teacher directory holds no tokenizer."""
    from opd.tasks import ArithmeticTask

    root = tmp_path_factory.mktemp("cross")
    ex = ArithmeticTask(n_train=1500, n_test=50).examples("train")
    tok = make_teacher_tok(texts=[e.prompt for e in ex] + [e.solution for e in ex], vocab_size=500)
    tok.save_pretrained(root / "teacher_tok")
    torch.manual_seed(3)
    tiny_qwen2(len(tok), 1, 48, eos_id=tok.eos_token_id, pad_id=tok.unk_token_id).save_pretrained(root / "teacher")
    return tiny_models[0], root / "teacher", root / "teacher_tok"


def cfg_for(student, teacher, tmp_path, **kw) -> TrainConfig:
    return TrainConfig.from_flat(
        student=str(student), teacher=str(teacher), out=str(tmp_path / "run"), **{**SMALL, **kw}
    )


# ---------------------------------------------------------------- identical tokenizers: ordinary OPD exactly


def test_identical_tokenizers_score_and_lsm_loss_equal_ordinary(tiny_models, tmp_path):
    run = train_mod.setup(cfg_for(*tiny_models, tmp_path, cross_tokenizer="on", k=8))
    assert isinstance(run.tasks[0].teacher, CrossTokenizerTeacher) and run.tasks[0].teacher.same_vocab
    batch, _, _ = first_rollout(run)
    cross = run.tasks[0].teacher.score(batch, 8)
    plain = run.tasks[0].teacher.inner.score(batch, 8)
    action = batch.action_mask_NT.bool()
    assert torch.equal(cross.position_mask_NT, action)  # every position pairs, EOS with EOS
    assert torch.equal(cross.topk_ids_NTK[action], plain.topk_ids_NTK[action])
    assert torch.equal(cross.topk_logprobs_NTK[action], plain.topk_logprobs_NTK[action])
    # teacher minus student is the span reward, here the token reward: equal up to one rounding
    torch.testing.assert_close(cross.sampled_logprobs_NT[action], plain.sampled_logprobs_NT[action])
    assert cross.metrics == {"cross/one_to_one": 1.0, "cross/mapped_mass": 1.0}
    mask = loss_mask(batch, run.special_ids, run.cfg.objective.mask_special)
    kept, metrics = scored_loss_mask(mask, cross)
    assert torch.equal(kept, mask) and metrics == {"cross/dropped": 0.0}
    loss_cross, _ = objective_loss(run.cfg, run.student, run.tasks[0].teacher, batch, cross, kept)
    loss_plain, _ = objective_loss(run.cfg, run.student, run.tasks[0].teacher, batch, plain, mask)
    assert torch.equal(loss_cross, loss_plain)


def test_identical_tokenizers_train_the_ordinary_lsm_trajectory(tiny_models, tmp_path):
    runs = {}
    for mode in ("on", "auto"):  # auto: same vocabulary, so the ordinary teacher
        cfg = cfg_for(*tiny_models, tmp_path / mode, cross_tokenizer=mode, steps=3)
        train_mod.train(cfg, show_progress=False)
        runs[mode] = step_records(tmp_path / mode / "run")
    for on, plain in zip(runs["on"], runs["auto"], strict=True):
        assert on["train/loss"] == plain["train/loss"] and on["train/grad_norm"] == plain["train/grad_norm"]
        assert on["cross/one_to_one"] == 1.0 and on["cross/dropped"] == 0.0
        assert not any(k.startswith("cross/") for k in plain)


# ---------------------------------------------------------------- a different tokenizer, end to end


@pytest.mark.parametrize("objective", ["lsm", "sampled"])
def test_different_tokenizer_trains_through_the_cli(cross_models, tmp_path, objective):
    student, teacher, teacher_tok = cross_models
    out = tmp_path / "run"
    args = ["train", "--student", str(student), "--teacher", str(teacher), "--teacher-tokenizer", str(teacher_tok)]
    args += ["--out", str(out), "--objective", objective, "--max-new-tokens", "12", "--steps", "3"]
    if objective == "lsm":
        args += ["--cross-unmapped", "prefix"]
    for key, value in SMALL.items():
        if key not in ("steps", "max_new_tokens"):
            args += [f"--{key.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "teacher tokenizer differs from the student's:" in result.output
    assert f"cross-tokenizer {'LSM' if objective == 'lsm' else 'sampled-token OPD'}" in result.output
    if objective == "lsm":  # the teacher's tokens without a same-bytes student token count for their first one
        assert "more to the student token they begin with" in result.output
        assert "use --cross-unmapped prefix --cross-pairing within_group --cross-joinable drop" in result.output
        assert run_options(out)["cross_unmapped"] == "prefix"
    records = step_records(out)
    assert len(records) == 3
    for r in records:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        assert all(0.0 <= r[k] <= 1.0 for k in CROSS_KEYS)
        assert "diag/overlap" not in r  # the full-vocabulary diagnostics need the teacher's logits in our vocabulary
    assert sum(r["train/loss_tokens"] for r in records) > 0
    assert (out / "final").is_dir() and any(r.get("eval/accuracy") is not None for r in read_metrics(out))
    # The report charts the alignment from the run directory, one series per logged key.
    charts = {c["id"]: c for c in build_charts(load_runs([out]))}
    for cid, keys in (("cross-alignment", CROSS_KEYS[::2]), ("cross-mapped-mass", CROSS_KEYS[1:2])):
        assert [s["y"] for s in charts[cid]["series"]] == [[r[k] for r in records] for k in keys]


# ---------------------------------------------------------------- the scorer against a hand computation


class _FixedTeacher:
    """A teacher-frame scorer with chosen outputs: the same top-K at every position, log q(u) = -0.1 (u + 1)."""

    def __init__(self, ids_K: list[int], logprobs_K: list[float]):
        self.ids_K, self.logprobs_K = torch.tensor(ids_K), torch.tensor(logprobs_K)
        self.seen: RolloutBatch | None = None

    def score(self, batch, k, query_ids_NTQ=None, diag_index_M=None):
        self.seen = batch
        N, U = batch.response_ids_NT.shape
        sampled = -0.1 * (torch.arange(U, dtype=torch.float32) + 1).expand(N, U)
        return TeacherScores(self.ids_K.expand(N, U, -1), self.logprobs_K.expand(N, U, -1), sampled.clone())


def _student_batch(tok, prompt: str, responses: list[str | list[int]]) -> RolloutBatch:
    """A rollout batch of the given responses (texts, or token ids as sampled), each ended by EOS."""
    p = tok(format_prompt(tok, prompt), add_special_tokens=False)["input_ids"]
    ids = [tok.encode(r, add_special_tokens=False) if isinstance(r, str) else r for r in responses]
    rows = [r + [tok.eos_token_id] for r in ids]
    T = max(map(len, rows))
    resp = torch.full((len(rows), T), tok.pad_token_id)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for n, r in enumerate(rows):
        resp[n, : len(r)], mask[n, : len(r)] = torch.tensor(r), True
    prompt_NP = torch.tensor(p).expand(len(rows), -1)
    logp = torch.where(mask, -0.05 * (torch.arange(T, dtype=torch.float32) + 1), torch.zeros(()))
    return RolloutBatch(
        torch.cat([prompt_NP, resp], 1),
        torch.cat([torch.ones_like(prompt_NP), mask.long()], 1),
        len(p),
        resp,
        mask,
        logp,
        torch.ones(len(rows), dtype=torch.bool),
    )


@pytest.mark.parametrize(
    "objective, pairing", [("lsm", "group_start"), ("lsm", "one_to_one"), ("sampled", "group_start")]
)
def test_scorer_by_hand(cross_models, objective, pairing):
    student, _, teacher_dir = cross_models
    s_tok, t_tok = load_tokenizer(student, "student"), load_tokenizer(teacher_dir, "teacher")
    s_vb, t_vb = crosstok.VocabBytes.from_tokenizer(s_tok), crosstok.VocabBytes.from_tokenizer(t_tok)
    s_by_bytes = {b: i for i, b in enumerate(s_vb.token_bytes) if b is not None}
    unmapped = next(v for v, b in enumerate(t_vb.token_bytes) if b is not None and b not in s_by_bytes)
    top = [t_tok.convert_tokens_to_ids(t) for t in ("▁The", "9", "<0x0A>")] + [unmapped]
    fixed = _FixedTeacher(top, [-0.5, -1.5, -2.0, -3.0])
    scorer = CrossTokenizerTeacher(fixed, s_tok, t_tok, objective=objective, pairing=pairing)
    responses = ["<think>3 + 4 = 7.</think> The answer is \\boxed{7}", "The answer is 12"]
    batch = _student_batch(s_tok, "Compute 3 + 4.", responses)
    scores = scorer.score(batch, 4)
    # the teacher read its own template and tokenization, ending with its own EOS
    seen = fixed.seen
    assert t_tok.decode(seen.input_ids_NL[0, : seen.prompt_len]).startswith("<s>[USER] Compute 3 + 4.\n[ASSISTANT]")
    for n, text in enumerate(responses):
        t_ids = seen.response_ids_NT[n, : int(seen.response_mask_NT[n].sum())].tolist()
        assert t_ids[-1] == t_tok.eos_token_id and t_tok.decode(t_ids, skip_special_tokens=True) == text
    for n in range(2):
        s_ids = batch.response_ids_NT[n, : int(batch.response_mask_NT[n].sum())].tolist()
        t_ids = seen.response_ids_NT[n, : int(seen.response_mask_NT[n].sum())].tolist()
        al = crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, special_pairs={s_tok.eos_token_id: t_tok.eos_token_id})
        assert al.mismatch_at is None and any(not g.one_to_one for g in al.groups)
        reward, paired = [0.0] * len(s_ids), {}
        for g in al.groups:  # the span reward on the group's last student token
            t_sum = sum(-0.1 * (j + 1) for j in g.teacher)
            reward[g.student[-1]] = t_sum - sum(-0.05 * (i + 1) for i in g.student)
            if pairing == "group_start" or g.one_to_one:
                paired[g.student[0]] = g.byte_start == 0 < g.byte_end
        got = scores.sampled_logprobs_NT[n, : len(s_ids)] - batch.logprobs_NT[n, : len(s_ids)]
        torch.testing.assert_close(got, torch.tensor(reward), rtol=0, atol=2e-6)
        for i in range(len(s_ids)):
            expect_ids, expect_lp = [], []
            if i in paired:  # the group's first student token: the mapped part of the teacher's top-K
                for v, lp in zip(top, fixed.logprobs_K.tolist()):
                    b = t_vb.start_bytes_of(v) if paired[i] else t_vb.bytes_of(v)
                    if b in s_by_bytes:
                        expect_ids.append(s_by_bytes[b])
                        expect_lp.append(lp)
            valid = torch.isfinite(scores.topk_logprobs_NTK[n, i])
            assert scores.topk_ids_NTK[n, i][valid].tolist() == expect_ids
            assert scores.topk_logprobs_NTK[n, i][valid].tolist() == expect_lp
            lsm_kept = bool(expect_ids)
            assert bool(scores.position_mask_NT[n, i]) == (lsm_kept if objective == "lsm" else True)
    assert scores.metrics["cross/mapped_mass"] < 1.0  # the unmapped token's mass is lost
    assert 0.0 < scores.metrics["cross/one_to_one"] < 1.0


def test_a_sequence_longer_than_the_teachers_context_in_its_own_tokens_is_refused(cross_models):
    student, _, teacher_dir = cross_models
    s_tok, t_tok = load_tokenizer(student, "student"), load_tokenizer(teacher_dir, "teacher")
    batch = _student_batch(s_tok, "Compute 3 + 4.", ["3 + 4 = 7. The answer is 7"])
    fixed = _FixedTeacher([0, 1], [-0.5, -1.5])
    CrossTokenizerTeacher(fixed, s_tok, t_tok, teacher_context=None).score(batch, 2)
    t_len = fixed.seen.input_ids_NL.shape[1]  # one row: its prompt and response in the teacher's tokens
    CrossTokenizerTeacher(fixed, s_tok, t_tok, teacher_context=t_len).score(batch, 2)
    with pytest.raises(UserError, match=f"{t_len} tokens long, more than the teacher model's context of {t_len - 1}"):
        CrossTokenizerTeacher(fixed, s_tok, t_tok, teacher_context=t_len - 1).score(batch, 2)


@pytest.mark.parametrize("objective", ["lsm", "sampled"])
def test_scorer_keeps_the_response_after_an_invalid_byte_token(cross_models, objective):
    student, _, teacher_dir = cross_models
    s_tok, t_tok = load_tokenizer(student, "student"), load_tokenizer(teacher_dir, "teacher")
    enc = lambda text: s_tok.encode(text, add_special_tokens=False)
    bad = [i for i in range(len(s_tok)) if s_tok.convert_ids_to_tokens(i) == "ð"]  # byte 0xF0 alone: not UTF-8
    assert bad
    response = enc("<think>3 + 4 = 7.") + bad + enc("</think> The answer is \\boxed{7}")
    top = [t_tok.convert_tokens_to_ids(t) for t in ("▁The", "9")]
    scorer = CrossTokenizerTeacher(_FixedTeacher(top, [-0.5, -1.5]), s_tok, t_tok, objective=objective)
    batch = _student_batch(s_tok, "Compute 3 + 4.", [response, "The answer is 7"])
    with pytest.warns(UserWarning, match="1 of 2 responses read differently"):
        scores = scorer.score(batch, 2)
    kept = scores.position_mask_NT[0, : len(response) + 1].tolist()
    at = len(enc("<think>3 + 4 = 7."))
    assert kept[at] is False  # the byte token itself has no teacher counterpart
    after = kept[at + 1 :]  # before the fix, every one of these was dropped
    # sampled: every aligned position keeps its reward; lsm: the group starts with a mapped top-K token
    assert (all(after) if objective == "sampled" else sum(after) >= len(after) // 2) and after[-1]  # the EOS pair
    assert sum(kept[:at]) > 0


# ---------------------------------------------------------------- refusals and bad input


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(objective="full_kl"), "objective=full_kl needs the teacher's distribution"),
        (dict(support="student_topk"), "support=student_topk needs teacher log-probs of student-chosen tokens"),
        (dict(support="teacher_topk_plus_sampled"), "support=teacher_topk_plus_sampled needs"),
        (dict(env="toy"), "multi-turn episodes with a teacher of another tokenizer"),
    ],
)
def test_what_a_cross_tokenizer_teacher_cannot_score_is_refused(cross_models, tmp_path, kw, match):
    student, teacher, teacher_tok = cross_models
    with pytest.raises(ConfigError, match=match):  # forced on: at once
        cfg_for(student, teacher, tmp_path, teacher_tokenizer=str(teacher_tok), cross_tokenizer="on", **kw)
    if "env" in kw:
        return
    cfg = cfg_for(student, teacher, tmp_path, teacher_tokenizer=str(teacher_tok), **kw)
    with pytest.raises(ConfigError, match=match):  # auto: when the different tokenizer is found
        train_mod.setup(cfg)


def test_off_keeps_the_one_vocabulary_error(cross_models, tmp_path):
    student, teacher, teacher_tok = cross_models
    cfg = cfg_for(student, teacher, tmp_path, teacher_tokenizer=str(teacher_tok), cross_tokenizer="off")
    with pytest.raises(UserError, match="tokenizers differ .* --cross-tokenizer is off"):
        train_mod.setup(cfg)


def test_bad_options_and_special_map(cross_models, tmp_path):
    student, teacher, teacher_tok = cross_models
    with pytest.raises(ConfigError, match="cross_tokenizer='yes': choose one of auto, on, off"):
        cfg_for(student, teacher, tmp_path, cross_tokenizer="yes")
    with pytest.raises(ConfigError, match="cross_unmapped='first': choose one of drop, prefix"):
        cfg_for(student, teacher, tmp_path, cross_unmapped="first")
    with pytest.raises(ConfigError, match="teacher_special_map item '<|im_end|>' is not STUDENT=TEACHER"):
        cfg_for(student, teacher, tmp_path, teacher_special_map=["<|im_end|>"])
    cfg = cfg_for(
        student, teacher, tmp_path, teacher_tokenizer=str(teacher_tok), teacher_special_map=["<|im_end|>=<eot>"]
    )
    with pytest.raises(UserError, match="'<eot>', which is not a special token of the teacher"):
        train_mod.setup(cfg)
    # an explicit pair replaces the EOS default: the teacher's </s> stands for the student's EOS
    s_tok, t_tok = load_tokenizer(student), load_tokenizer(teacher_tok, "teacher")
    scorer = CrossTokenizerTeacher(_FixedTeacher([0], [0.0]), s_tok, t_tok, special_map={"<|im_end|>": "</s>"})
    assert scorer.end_token == "</s>" and scorer.vmap.special_pairs[s_tok.eos_token_id] == t_tok.eos_token_id


def test_teacher_without_chat_template_or_fast_tokenizer_fails_before_training(cross_models):
    student, _, teacher_dir = cross_models
    s_tok, t_tok = load_tokenizer(student), load_tokenizer(teacher_dir, "teacher")
    t_tok.chat_template = None
    with pytest.raises(UserError, match="has no chat template"):
        CrossTokenizerTeacher(_FixedTeacher([0], [0.0]), s_tok, t_tok)

    class SlowTokenizer:  # what a slow (Python) tokenizer lacks: the tokenizers backend with its decoder
        name_or_path = "slow-teacher"

    with pytest.raises(UserError, match="has no `tokenizers` backend.*load the tokenizer with AutoTokenizer"):
        CrossTokenizerTeacher(_FixedTeacher([0], [0.0]), s_tok, SlowTokenizer())


def test_messages_from_prompt_inverts_the_students_template(cross_models):
    tok = load_tokenizer(cross_models[0])
    for system in (None, "Be brief.\nReally."):
        text = format_prompt(tok, "Compute 3 + 4.\n\nThen stop.", system)
        want = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "Compute 3 + 4.\n\nThen stop."}
        ]
        assert crosstok.messages_from_prompt(tok, text) == want
    with pytest.raises(UserError, match="not a user turn .* of the student's chat template"):
        crosstok.messages_from_prompt(tok, "Compute 3 + 4.")


def test_served_teacher_with_its_own_tokenizer(cross_models, tmp_path):
    from opd.teachers.server import Limits, TeacherApp, start_server, stop_server

    student, teacher, teacher_dir = cross_models
    model, t_tok = load_model(teacher, "teacher"), load_tokenizer(teacher_dir, "teacher")
    server = start_server(TeacherApp(model, t_tok, "cross-teacher", Limits(max_k=16)), "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        cfg = TrainConfig.from_flat(student=str(student), teacher_url=url, teacher_tokenizer=str(teacher_dir), **SMALL)
        s_model, s_tok = load_model(student), load_tokenizer(student)
        served = make_teacher(cfg, s_model, s_tok)
        assert isinstance(served, CrossTokenizerTeacher) and served.inner.vocab_rows == len(t_tok)
        local = CrossTokenizerTeacher(HFTeacher(model), s_tok, t_tok)
        batch = _student_batch(s_tok, "Compute 3 + 4.", ["The answer is 7", "<think>3 + 4 = 7.</think>"])
        a, b = served.score(batch, 8), local.score(batch, 8)
        for x, y in zip(dataclasses.astuple(a)[:3], dataclasses.astuple(b)[:3]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.position_mask_NT, b.position_mask_NT)
    finally:
        stop_server(server)


def test_a_teacher_that_joins_digits_scores_every_digit_of_the_students_numbers():
    """--cross-unmapped prefix, --cross-pairing within_group and --cross-joinable drop, against a
    computation by hand: a student that writes each digit alone, a teacher that writes "15" as one token."""
    from opd.models.tokenizer import train_bytelevel_tokenizer, train_tokenizer

    texts = [f"{a} + {b} = {a + b}." for a in range(40) for b in range(40)]
    s_tok, t_tok = train_tokenizer(texts, vocab_size=600), train_bytelevel_tokenizer(texts, vocab_size=600)
    s_vb, t_vb = crosstok.VocabBytes.from_tokenizer(s_tok), crosstok.VocabBytes.from_tokenizer(t_tok)
    s_by_bytes = {b: i for i, b in enumerate(s_vb.token_bytes) if b is not None}
    teacher_bytes = [b for b in t_vb.token_bytes if b]
    top = [t_tok.convert_tokens_to_ids(t) for t in ("15", "1", "12", "Ġ+", "Ġ")]
    probs = [0.4, 0.1, 0.2, 0.15, 0.05]
    fixed = _FixedTeacher(top, [math.log(p) for p in probs])
    responses = ["15 + 1 = 16.", "1 + 12 = 13."]
    batch = _student_batch(s_tok, "Compute 15 + 1.", responses)

    def first_student_token(b: bytes) -> int:  # the longest student token the bytes begin with
        return s_by_bytes[max((p for p in s_by_bytes if b.startswith(p)), key=len)]

    for pairing, joinable in (("within_group", "drop"), ("group_start", "keep")):
        joined = 0
        scorer = CrossTokenizerTeacher(fixed, s_tok, t_tok, pairing=pairing, unmapped="prefix", joinable=joinable)
        scores = scorer.score(batch, len(top))
        seen = fixed.seen
        for n in range(len(responses)):
            s_ids = batch.response_ids_NT[n, : int(batch.response_mask_NT[n].sum())].tolist()
            t_ids = seen.response_ids_NT[n, : int(seen.response_mask_NT[n].sum())].tolist()
            t_prompt = seen.input_ids_NL[n, : seen.prompt_len][seen.attention_mask_NL[n, : seen.prompt_len].bool()]
            al = crosstok.align_ids(s_ids, t_ids, s_vb, t_vb, special_pairs={s_tok.eos_token_id: t_tok.eos_token_id})
            assert any(len(g.student) == 2 and len(g.teacher) == 1 for g in al.groups)  # a two-digit number
            want: dict[int, dict[int, float]] = {}
            for g in al.groups:
                if not g.student or not g.teacher or s_vb.bytes_of(s_ids[g.student[0]]) is None:
                    continue  # the EOS pair: no text
                u = g.teacher[0]
                before = t_vb.bytes_of(t_ids[u - 1] if u else int(t_prompt[-1]))
                start: dict[int, float] = {}
                for v, p in zip(top, probs):
                    sid = first_student_token(t_vb.bytes_of(v))
                    if joinable == "drop" and any(tb.startswith(before + s_vb.bytes_of(sid)) for tb in teacher_bytes):
                        joined += 1
                        continue  # the teacher would have joined it to its token before
                    start[sid] = start.get(sid, 0.0) + p
                want[g.student[0]] = start
                done = b""
                for i, j in zip(g.student, g.student[1:]):
                    done += s_vb.bytes_of(s_ids[i])
                    if pairing != "within_group" or len(g.teacher) != 1:
                        continue
                    inside: dict[int, float] = {}
                    for v, p in zip(top, probs):
                        b = t_vb.bytes_of(v)
                        if b.startswith(done) and len(b) > len(done):
                            sid = first_student_token(b[len(done) :])
                            inside[sid] = inside.get(sid, 0.0) + p
                    want[j] = inside
            for i in range(len(s_ids) - 1):  # the EOS is not text
                valid = torch.isfinite(scores.topk_logprobs_NTK[n, i])
                got = dict(
                    zip(scores.topk_ids_NTK[n, i][valid].tolist(), scores.topk_logprobs_NTK[n, i][valid].exp().tolist())
                )
                expect = want.get(i, {})
                assert got.keys() == expect.keys(), (pairing, n, i, s_tok.convert_ids_to_tokens(s_ids[i]))
                assert all(abs(got[k] - expect[k]) < 1e-5 for k in got)
                assert bool(scores.position_mask_NT[n, i]) == bool(expect)
        assert (joined > 0) == (joinable == "drop")  # "1" after the teacher's "1" of "1 + 12": it writes "11"
        if pairing == "within_group":  # the second digit of "15" and "12" has a target: the teacher's "15" and "12"
            five, two = s_tok.convert_tokens_to_ids("5"), s_tok.convert_tokens_to_ids("2")
            second = 1  # "15 + 1 = 16.": student "1" "5" ...
            got = dict(zip(scores.topk_ids_NTK[0, second].tolist(), scores.topk_logprobs_NTK[0, second].exp().tolist()))
            assert abs(got[five] - 0.4) < 1e-6 and abs(got[two] - 0.2) < 1e-6
    with pytest.raises(UserError, match="cross_joinable='maybe': choose one of keep, drop"):
        CrossTokenizerTeacher(fixed, s_tok, t_tok, joinable="maybe")
    with pytest.raises(UserError, match="cross_pairing='inside': choose one of group_start, one_to_one, within_group"):
        CrossTokenizerTeacher(fixed, s_tok, t_tok, pairing="inside")
