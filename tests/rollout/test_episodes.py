"""Multi-turn episodes: the toy game, the episode format and its masks (checked against the chat
template's own rendering), KV-cache continuation against re-encoding, batch invariance, limits,
EnvError, teacher scoring (in-process and served) and the losses at environment positions.

The student is the packaged demo student (trained on arithmetic, so it ends turns with EOS often
enough for both kinds of turn end to occur); references re-derive everything from the rendered
chat text and plain forward passes, not from the code under test.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

import opd
from opd.envs import EnvError, Environment, GameSession, StepResult, get_env
from opd.envs.toy import TEST_SEED_OFFSET, ToyEnv
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.episodes import ChatFormat, EpisodeRollout
from opd.rollout.sampling import RolloutBatch

DEMO = pathlib.Path(opd.__file__).parent / "assets" / "demo"
PLAY = dict(max_new_tokens=360, max_action_tokens=24, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def student():
    return load_model(DEMO / "student", "student").eval(), load_tokenizer(DEMO / "student", "student")


@pytest.fixture(scope="module")
def played(student):
    """Six toy episodes, sampled, with the default limits of these tests."""
    model, tok = student
    env = get_env("toy", rooms=3, max_turns=6)
    eps = EpisodeRollout(model, tok).play(env, env.games("train")[:6], list(range(6)), **PLAY)
    return env, eps


# ---------------------------------------------------------------- the toy game


def test_toy_env_implements_the_protocol_and_the_expert_wins():
    env = get_env("toy", n_train=20, n_test=5)
    assert isinstance(env, Environment) and isinstance(env, ToyEnv)
    train, test = env.games("train"), env.games("test")
    assert len(train) == 20 and len(test) == 5
    assert not {g.info["seed"] for g in train} & {g.info["seed"] for g in test}
    assert min(g.info["seed"] for g in test) >= TEST_SEED_OFFSET
    assert [g.id for g in get_env("toy", n_train=20).games("train")] == [g.id for g in train]  # a fixed order
    for game in train + test:
        session = env.open(game)
        assert isinstance(session, GameSession)
        first = session.reset()
        assert first.startswith(f"Goal: {game.goal}.")
        assert session.step("dance") == StepResult("Nothing happens.", 0.0, False, False)
        session.reset()
        expert = session.expert_actions()
        assert len(expert) <= env.max_turns
        for n, action in enumerate(expert):
            assert action in session.admissible_commands()
            result = session.step(action)
            assert result.done == (n == len(expert) - 1) and result.reward == float(result.done)
        assert result.won
        assert env.open(game).reset() == first  # deterministic: a game's layout is its seed's


# ---------------------------------------------------------------- format and masks


def rendered_episode(tok, env, record, ids: list[int], eos_id: int) -> str:
    """The chat template's text of the episode, cut where its tokens end."""
    messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": record.observations[0]}]
    for n, (start, end) in enumerate(record.spans):
        content = ids[start:end]
        content = content[:-1] if content[-1:] == [eos_id] else content
        messages.append({"role": "assistant", "content": tok.decode(content)})
        if n + 1 < len(record.spans):
            messages.append({"role": "user", "content": record.observations[n + 1]})
    text = tok.apply_chat_template(messages, tokenize=False)
    closing = "<|im_end|>\n"
    assert text.endswith(closing)
    last = ids[record.spans[-1][0] : record.spans[-1][1]]
    return text[: -len(closing) + (len("<|im_end|>") if last[-1:] == [eos_id] else 0)]


def test_masks_cover_exactly_the_sampled_tokens_and_the_rendered_replies(student, played):
    model, tok = student
    env, eps = played
    b = eps.batch
    eos = tok.eos_token_id
    kinds = set()
    for n, record in enumerate(eps.records):
        length = int(b.response_mask_NT[n].sum())
        assert b.response_mask_NT[n].tolist() == [t < length for t in range(b.response_mask_NT.shape[1])]
        ids = b.response_ids_NT[n, :length].tolist()
        spans = record.spans
        assert record.turns == len(spans) >= 1 and spans[0][0] == 0 and spans[-1][1] == length
        in_span = [any(s <= t < e for s, e in spans) for t in range(length)]
        assert b.action_mask_NT[n, :length].tolist() == in_span
        assert not b.action_mask_NT[n, length:].any() and (b.logprobs_NT[n][~b.action_mask_NT[n]] == 0).all()
        for i, (s, e) in enumerate(spans):
            assert e - s <= PLAY["max_action_tokens"]
            ended = ids[e - 1] == eos
            assert eos not in ids[s : e - 1]  # a turn ends at its first EOS
            kinds.add(ended)
            assert record.actions[i] == tok.decode(ids[s:e], skip_special_tokens=True).strip()
            if i + 1 < len(spans):  # the gap is the template's reply to this action, encoded
                closing = "" if ended else "<|im_end|>"
                reply = f"{closing}\n<|im_start|>user\n{record.observations[i + 1]}<|im_end|>\n<|im_start|>assistant\n"
                assert ids[e : spans[i + 1][0]] == tok(reply, add_special_tokens=False)["input_ids"]
        prompt = b.input_ids_NL[n, : b.prompt_len][b.attention_mask_NL[n, : b.prompt_len].bool()].tolist()
        assert tok.decode(prompt + ids) == rendered_episode(tok, env, record, ids, eos)
    assert kinds == {True, False}, "the test needs turns ended by EOS and turns cut at max_action_tokens"


@torch.no_grad()
def reencoded_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """Log-probs of every response token from one plain forward over the final sequences."""
    mask = batch.attention_mask_NL
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids_NL, attention_mask=mask, position_ids=pos).logits.double()
    P, T = batch.prompt_len, batch.response_ids_NT.shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : P - 1 + T], -1)
    return lp.gather(-1, batch.response_ids_NT.unsqueeze(-1)).squeeze(-1)


def test_kv_cache_continuation_gives_the_log_probs_of_reencoding(student, played):
    model, _ = student
    b = played[1].batch
    want = reencoded_logprobs(model, b)
    a = b.action_mask_NT
    assert int(a.sum()) > 100
    torch.testing.assert_close(b.logprobs_NT[a].double(), want[a], atol=2e-5, rtol=0)


def test_an_episode_plays_the_same_alone_as_in_any_batch(student, played):
    model, tok = student
    env, eps = played
    games = env.games("train")[:6]
    engine = EpisodeRollout(model, tok)
    for order in ([4], [3, 5, 4], [4, 0, 2, 1]):
        other = engine.play(env, [games[i] for i in order], order, **PLAY)
        for row, i in enumerate(order):
            n = int(eps.batch.response_mask_NT[i].sum())
            assert int(other.batch.response_mask_NT[row].sum()) == n
            assert other.batch.response_ids_NT[row, :n].tolist() == eps.batch.response_ids_NT[i, :n].tolist()
            torch.testing.assert_close(
                other.batch.logprobs_NT[row, :n], eps.batch.logprobs_NT[i, :n], atol=2e-5, rtol=0
            )
            assert dataclasses.asdict(other.records[row]) == dataclasses.asdict(eps.records[i])


def test_a_cache_that_keeps_ended_rows_plays_the_same(student, played, monkeypatch):
    """Hybrid models' caches cannot drop rows: ended episodes then stay in the batch, masked."""
    import opd.rollout.sampling

    model, tok = student
    env, eps = played
    monkeypatch.setattr(opd.rollout.sampling, "_can_drop_rows", lambda cache: False)
    kept = EpisodeRollout(model, tok).play(env, env.games("train")[:6], list(range(6)), **PLAY)
    assert torch.equal(kept.batch.response_ids_NT, eps.batch.response_ids_NT)
    assert torch.equal(kept.batch.action_mask_NT, eps.batch.action_mask_NT)
    torch.testing.assert_close(kept.batch.logprobs_NT, eps.batch.logprobs_NT, atol=2e-5, rtol=0)


def test_greedy_episodes_are_reproducible_and_records_add_up(student, played):
    model, tok = student
    env, _ = played
    games = env.games("test")[:3]
    a = EpisodeRollout(model, tok).play(env, games, [0, 1, 2], greedy=True, max_new_tokens=200, max_action_tokens=20)
    b = EpisodeRollout(model, tok).play(env, games, [7, 8, 9], greedy=True, max_new_tokens=200, max_action_tokens=20)
    assert torch.equal(a.batch.response_ids_NT, b.batch.response_ids_NT)  # seeds do not matter when greedy
    for r in a.records:
        assert r.end in ("won", "lost", "max_turns", "budget")
        assert len(r.rewards) == r.turns and len(r.observations) in (r.turns, r.turns + 1)
        assert r.invalid_actions is not None and 0 <= r.invalid_actions <= r.turns
        assert r.truncated == (r.end in ("max_turns", "budget")) and r.won == (r.end == "won")


# ---------------------------------------------------------------- limits


def test_turn_token_limit_and_episode_budget(student):
    model, tok = student
    env = get_env("toy", max_turns=50)
    games = env.games("train")[:4]
    eps = EpisodeRollout(model, tok).play(env, games, [0, 1, 2, 3], max_new_tokens=120, max_action_tokens=3)
    for n, r in enumerate(eps.records):
        ids = eps.batch.response_ids_NT[n][eps.batch.response_mask_NT[n]].tolist()
        assert len(ids) <= 120 and r.end == "budget" and r.truncated and not eps.batch.finished_N[n]
        assert all(e - s <= 3 for s, e in r.spans) and r.spans[-1][1] == len(ids)
        if len(r.observations) == r.turns:  # the last action was cut by the budget itself
            assert len(ids) == 120 and ids[-1] != tok.eos_token_id
            continue
        # the last action was played, and its reply plus one action token did not fit
        closing = "" if ids[-1] == tok.eos_token_id else "<|im_end|>"
        reply = f"{closing}\n<|im_start|>user\n{r.observations[-1]}<|im_end|>\n<|im_start|>assistant\n"
        assert len(ids) + len(tok(reply, add_special_tokens=False)["input_ids"]) + 1 > 120
    # a budget that ends inside an action: that action is never played
    eps = EpisodeRollout(model, tok).play(env, games[:1], [0], max_new_tokens=5, max_action_tokens=8)
    r = eps.records[0]
    assert r.end == "budget" and r.spans == [(0, 5)] and r.observations == r.observations[:1] and r.rewards == [0.0]


def test_max_turns_ends_the_episode(student):
    model, tok = student
    env = get_env("toy", max_turns=50)
    eps = EpisodeRollout(model, tok).play(
        env, env.games("train")[:3], [0, 1, 2], max_turns=2, max_new_tokens=300, max_action_tokens=6
    )
    for r in eps.records:
        assert r.turns <= 2 and (r.end == "max_turns") == (r.turns == 2 and not r.done)


def test_prompt_plus_budget_beyond_the_context_is_a_user_error(student):
    model, tok = student
    env = get_env("toy")
    with pytest.raises(UserError, match=r"plus max_new_tokens=600 exceeds the model's context of 512"):
        EpisodeRollout(model, tok).play(env, env.games("train")[:2], [0, 1], max_new_tokens=600)


# ---------------------------------------------------------------- EnvError


@dataclasses.dataclass
class Crashing:
    """A toy session whose engine dies at its ``crash_at``-th step (0: on reset)."""

    inner: GameSession
    crash_at: int
    steps: int = 0

    def reset(self):
        if self.crash_at == 0:
            raise EnvError("game file failed to load")
        return self.inner.reset()

    def step(self, action):
        self.steps += 1
        if self.steps == self.crash_at:
            raise EnvError("engine crashed")
        return self.inner.step(action)

    def admissible_commands(self):
        return self.inner.admissible_commands()

    def expert_actions(self):
        return self.inner.expert_actions()

    def close(self):
        pass


class CrashingToy(ToyEnv):
    def __init__(self, crash: dict[str, int], **kw):
        super().__init__(**kw)
        self.crash = crash

    def open(self, game):
        session = super().open(game)
        return Crashing(session, self.crash[game.id]) if game.id in self.crash else session


def test_env_error_ends_only_its_episode(student, played):
    model, tok = student
    env, eps = played
    games = env.games("train")[:6]
    crashing = CrashingToy({games[1].id: 2, games[3].id: 0}, rooms=3, max_turns=6)
    got = EpisodeRollout(model, tok).play(crashing, games, list(range(6)), **PLAY)
    for n in (0, 2, 4, 5):  # the others play as they did without the crashes
        assert dataclasses.asdict(got.records[n]) == dataclasses.asdict(eps.records[n])
        assert torch.equal(
            got.batch.response_ids_NT[n], eps.batch.response_ids_NT[n, : got.batch.response_ids_NT.shape[1]]
        )
    assert eps.records[1].turns > 2, "the test needs game 1 to reach its crash"
    r1, r3 = got.records[1], got.records[3]
    assert r1.end == "error" and r1.error == "engine crashed" and r1.turns == 2 and len(r1.observations) == 2
    assert int(got.batch.response_mask_NT[1].sum()) == r1.spans[-1][1]  # nothing after the crashed action
    assert r3.end == "error" and r3.error == "game file failed to load" and r3.turns == 0
    assert not got.batch.response_mask_NT[3].any() and not got.batch.action_mask_NT[3].any()


# ---------------------------------------------------------------- teacher and losses


def alone(batch: RolloutBatch, n: int) -> RolloutBatch:
    """Row n as a batch of its own, without any padding."""
    P, L = batch.prompt_len, int(batch.response_mask_NT[n].sum())
    prompt = batch.input_ids_NL[n, :P][batch.attention_mask_NL[n, :P].bool()]
    resp = batch.response_ids_NT[n : n + 1, :L]
    ids = torch.cat([prompt.unsqueeze(0), resp], 1)
    return RolloutBatch(
        ids, torch.ones_like(ids), prompt.numel(), resp, batch.response_mask_NT[n : n + 1, :L],
        batch.logprobs_NT[n : n + 1, :L], batch.finished_N[n : n + 1], batch.action_mask_NT[n : n + 1, :L],
    )  # fmt: skip


@pytest.fixture(scope="module")
def teacher():
    return load_model(DEMO / "teacher", "teacher")


def test_in_process_teacher_scores_each_episode_as_alone(teacher, played):
    from opd.teachers.scoring import HFTeacher

    b = played[1].batch
    scores = HFTeacher(teacher).score(b, 8)
    for n in range(b.num_rollouts):
        one = alone(b, n)
        want = HFTeacher(teacher).score(one, 8)
        a, L = one.action_mask_NT[0], one.response_ids_NT.shape[1]
        assert torch.equal(scores.topk_ids_NTK[n, :L][a], want.topk_ids_NTK[0][a])
        torch.testing.assert_close(scores.topk_logprobs_NTK[n, :L][a], want.topk_logprobs_NTK[0][a], atol=2e-5, rtol=0)
        torch.testing.assert_close(
            scores.sampled_logprobs_NT[n, :L][a], want.sampled_logprobs_NT[0][a], atol=2e-5, rtol=0
        )


def test_served_teacher_scores_a_multi_turn_batch_like_the_in_process_one(teacher, student, played):
    from opd.models.loading import head_weight
    from opd.teachers.client import HTTPTeacher
    from opd.teachers.scoring import HFTeacher
    from opd.teachers.server import Limits, TeacherApp, start_server, stop_server

    _, tok = student
    b = played[1].batch
    server = start_server(
        TeacherApp(teacher, tok, "demo-teacher", Limits(max_k=16, max_prompt_tokens=512)), "127.0.0.1", 0
    )
    try:
        client = HTTPTeacher(f"http://127.0.0.1:{server.server_address[1]}", tok, head_weight(teacher).shape[0])
        got = client.score(b, 8)
    finally:
        stop_server(server)
    want = HFTeacher(teacher).score(b, 8)
    a = b.action_mask_NT
    assert torch.equal(got.topk_ids_NTK[a], want.topk_ids_NTK[a])
    torch.testing.assert_close(got.topk_logprobs_NTK[a], want.topk_logprobs_NTK[a].float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(got.sampled_logprobs_NT[a], want.sampled_logprobs_NT[a].float(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("objective", ["lsm", "sampled"])
@pytest.mark.parametrize("mask_special", [True, False])
def test_losses_are_zero_with_zero_gradient_at_environment_positions(teacher, student, played, objective, mask_special):
    from opd.config import TrainConfig
    from opd.teachers.scoring import HFTeacher
    from opd.training.loss import loss_mask, objective_loss

    model, tok = student
    b = played[1].batch
    specials = [tok.eos_token_id, tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")]
    mask = loss_mask(b, specials, mask_special)
    assert not (mask & ~b.action_mask_NT).any() and mask.any()
    if mask_special:
        assert not mask[b.response_ids_NT == tok.eos_token_id].any()
    else:
        assert torch.equal(mask, b.action_mask_NT)
    cfg = TrainConfig.from_flat(objective=objective, k=8, gamma=0.5)
    scores = HFTeacher(teacher).score(b, 8)
    model.zero_grad()
    loss_NT, h = objective_loss(cfg, model, HFTeacher(teacher), b, scores, mask)
    env_pos = b.response_mask_NT & ~b.action_mask_NT
    assert env_pos.any() and (loss_NT[env_pos] == 0).all() and (loss_NT[~mask] == 0).all()
    (g,) = torch.autograd.grad(loss_NT.sum(), h, retain_graph=True)
    assert (g[~mask] == 0).all() and g[mask].abs().sum() > 0
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_NT[env_pos].sum(), params, allow_unused=True)
    assert all(x is None or (x == 0).all() for x in grads)


# ---------------------------------------------------------------- chat templates


def test_chat_format_follows_other_templates_and_refuses_unstable_ones(student):
    _, tok = student
    tok = load_tokenizer(DEMO / "student", "student")  # a copy whose template the test changes
    tok.chat_template = (  # the generation prompt starts the turn with text a rendered turn lacks
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\nA: ' }}{%- endif %}"
    )
    with pytest.raises(UserError, match="prefix-stable"):  # 'A: ' is in the prompt but not in a rendered turn
        ChatFormat(tok, tok.eos_token_id)
    tok.chat_template = (
        "{%- for m in messages %}{{- '### ' + m['role'] + ':\\n' + m['content'] + '<|im_end|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '### assistant:\\n' }}{%- endif %}"
    )
    fmt = ChatFormat(tok, tok.eos_token_id)
    assert fmt.reply("It opens.") == "### user:\nIt opens.<|im_end|>### assistant:\n"
    assert fmt.reply("It opens.", after_eos=False) == "<|im_end|>### user:\nIt opens.<|im_end|>### assistant:\n"
    tok.chat_template = "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ raise_exception('no system') }}{%- endif %}{%- endfor %}"
    with pytest.raises(UserError, match="cannot render"):
        ChatFormat(tok, tok.eos_token_id)


# ---------------------------------------------------------------- what a step measures


def test_step_metrics_and_records_count_action_tokens_only(teacher, student, played):
    from types import SimpleNamespace

    from opd.models.head import model_head
    from opd.rollout.forward import response_hidden
    from opd.teachers.scoring import HFTeacher
    from opd.training.stepstats import StepUpdate, metric_weights, rollout_records, step_metrics

    model, tok = student
    b = played[1].batch
    scores = HFTeacher(teacher).score(b, 8)
    a, N = b.action_mask_NT, b.num_rollouts
    with torch.no_grad():
        h = response_hidden(model, b)
    upd = StepUpdate(0.0, 0.0, False, 1e-3, torch.zeros(b.response_ids_NT.shape), h[a][:4], h[:2])
    W = model_head(model)
    # the first action's first token as the "format token": the rate counts actions, not episodes
    first = int(b.response_ids_NT[0][a[0]][0])
    m = step_metrics(b, [0.0] * N, scores, upd, a, W, k=8, horizon=PLAY["max_new_tokens"], format_ids=[first])
    assert m["rollout/response_len"] == pytest.approx(float(a.sum()) / N)
    actions = [x for r in played[1].records for x in r.actions]
    assert metric_weights(b, a, 4, PLAY["max_new_tokens"])["rollout/format_token_rate"] == len(actions)
    assert 1 / len(actions) <= m["rollout/format_token_rate"] <= 1.0
    reward = [float(scores.sampled_logprobs_NT[n, t] - b.logprobs_NT[n, t]) for n, t in a.nonzero().tolist()]
    assert m["diag/reward_mean"] == pytest.approx(sum(reward) / len(reward), rel=1e-5)
    assert metric_weights(b, a, 4, PLAY["max_new_tokens"])["diag/"] == int(a.sum())
    examples = [SimpleNamespace(prompt="p", answer="a")] * 2
    records = rollout_records(tok, W, 0, b, examples, ["", ""], [0.0, 0.0], scores, upd, a)
    for n, rec in enumerate(records):
        assert rec["token_ids"] == b.response_ids_NT[n][a[n]].tolist()
        assert len(rec["teacher_topk_ids"]) == len(rec["loss_mask"]) == int(a[n].sum())


def test_single_turn_rollouts_have_equal_masks(student):
    from opd.rollout.sampling import HFRollout

    model, tok = student
    prompts = [tok("<|im_start|>user\nAdd 3 and 4.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]] * 3
    b = HFRollout(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, [0, 1, 2], max_new_tokens=12)
    assert torch.equal(b.action_mask_NT, b.response_mask_NT)
    assert torch.equal(b.select(slice(1, 3)).action_mask_NT, b.response_mask_NT[1:3])


QWEN25_LIKE = (  # Qwen2.5's template without its tool branches: a default system turn when none is given
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3_LIKE = (  # Qwen3's habit: the last assistant turn gets an empty think block that later turns lose
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_qwen_like_templates(student):
    tok = load_tokenizer(DEMO / "student", "student")
    opd_reply = ChatFormat(tok, tok.eos_token_id).reply("You see a key.")
    tok.chat_template = QWEN25_LIKE
    assert ChatFormat(tok, tok.eos_token_id).reply("You see a key.") == opd_reply
    tok.chat_template = QWEN3_LIKE
    with pytest.raises(UserError, match="prefix-stable"):
        ChatFormat(tok, tok.eos_token_id)
