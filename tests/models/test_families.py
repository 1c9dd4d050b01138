"""The family matrix: for every causal-LM family the installed transformers has among the ones people
distill, opd's log-probs equal the model's own forward, and every objective trains.

Each family gets a tiny random student (2 layers) and teacher (3 layers) on the demo tokenizer, built
once for the module, with the output head multiplied by 50 and a phi bias drawn from N(0, 1), so
that a bias, a scale or a soft-cap that opd dropped would move the log-probs by nats (the test
checks that it would). Compared with ``log_softmax(model(...).logits)``: the teacher's top-K
log-probs and its log-probs of the sampled tokens (``HFTeacher.score``), the student's training
log-probs (``policy_logprobs``, the sampled objective's kernel), and the LSM and full-KL losses from
hidden states against the same losses on the model's logits.

The tolerance is derived, not tuned: the hidden states of both paths are the same computation (no
padding in the probe batch), so they differ only in the head. A float32 dot product of length D
is off by at most D eps sum_d |h_d W_vd| (the standard bound), the bias add and the scale and cap
(1-Lipschitz: |c tanh(a/c) - c tanh(b/c)| <= |a - b|) each add eps |z|; a log-softmax moves by at
most twice the largest logit error, plus its own rounding of a few eps times the largest |z|.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers as T
from helpers import SMALL, assert_close_weights, assert_same_trajectory, cli_args, launch, step_records

from opd import losses as L
from opd.models.head import model_head
from opd.models.loading import check_head, load_model, load_tokenizer
from opd.rollout.engine import RolloutBatch
from opd.rollout.forward import response_hidden
from opd.teachers.scoring import HFTeacher
from opd.training.loss import policy_logprobs

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "src" / "opd" / "assets" / "demo" / "tokenizer"
EPS32 = torch.finfo(torch.float32).eps
HEAD_GAIN = 50.0

# family -> (config class, model class, what the family's config needs on top of the shared fields)
FAMILIES = {
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3-tied": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.0625}),
}
INSTALLED = [f for f, (c, m, _) in FAMILIES.items() if hasattr(T, c) and hasattr(T, m)]
# the families whose logits are not hidden @ W.T: a plain head must be visibly wrong there
TRANSFORMED = {"gemma2", "phi", "granite", "cohere"}


def build(family: str, tok, layers: int, width: int, seed: int):
    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(T, cfg_name)(
        vocab_size=len(tok),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(T, model_name)(cfg)
    with torch.no_grad():
        out = model.get_output_embeddings()
        out.weight.mul_(HEAD_GAIN)
        if getattr(out, "bias", None) is not None:
            out.bias.normal_()
    return model


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (student_dir, teacher_dir), each saved with the demo tokenizer."""
    tok = load_tokenizer(DEMO_TOKENIZER, "tokenizer")
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for family in INSTALLED:
        for role, layers, width, seed in (("student", 2, 32, 1), ("teacher", 3, 64, 2)):
            path = root / f"{family}-{role}"
            build(family, tok, layers, width, seed).save_pretrained(path)
            tok.save_pretrained(path)
            dirs.setdefault(family, []).append(path)
    return dirs


def probe_batch(V: int, N: int = 3, P: int = 4, T_: int = 6) -> RolloutBatch:
    """Random prompts and responses with no padding, so both paths run the decoder on the same input."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (N, P + T_), generator=g)
    ones = torch.ones(N, T_, dtype=torch.bool)
    return RolloutBatch(
        ids, torch.ones_like(ids), P, ids[:, P:], ones, torch.zeros(N, T_), torch.ones(N, dtype=torch.bool)
    )


@torch.no_grad()
def own_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """log_softmax of the model's own forward at the response positions (N, T, V)."""
    logits = model(input_ids=batch.input_ids_NL, attention_mask=batch.attention_mask_NL).logits
    return torch.log_softmax(logits[:, batch.prompt_len - 1 : -1].double(), dim=-1)


@torch.no_grad()
def tolerance(model, batch: RolloutBatch) -> float:
    """The derived bound of the module docstring on a log-prob's float32 error in opd's head."""
    head = model_head(model)
    h = response_hidden(model, batch).double().abs()
    dots = h @ head.weight_VD.double().abs().T
    D = h.shape[-1]
    z = head.logits(response_hidden(model, batch)).double().abs().max()
    bias = 0.0 if head.bias_V is None else float(head.bias_V.abs().max())
    logit_err = abs(head.scale) * (D * EPS32 * float(dots.max()) + EPS32 * bias) + 2 * EPS32 * float(z)
    return 2 * logit_err + 4 * EPS32 * float(z + math.log(head.vocab))


@pytest.mark.parametrize("family", INSTALLED)
def test_logprobs_equal_the_models_own_forward(pairs, family):
    student_dir, teacher_dir = pairs[family]
    student, teacher = load_model(student_dir, "student"), load_model(teacher_dir, "teacher")
    batch = probe_batch(model_head(student).vocab)
    t_ref, s_ref = own_logprobs(teacher, batch), own_logprobs(student, batch)
    t_tol, s_tol = tolerance(teacher, batch), tolerance(student, batch)
    k = 8

    scores = HFTeacher(teacher).score(batch, k)
    ref_top = t_ref.topk(k, dim=-1)
    assert torch.equal(scores.topk_ids_NTK, ref_top.indices), "teacher top-K ids differ from the model's"
    assert (scores.topk_logprobs_NTK.double() - ref_top.values).abs().max() <= t_tol
    sampled_ref = t_ref.gather(-1, batch.response_ids_NT[..., None])[..., 0]
    assert (scores.sampled_logprobs_NT.double() - sampled_ref).abs().max() <= t_tol

    train_lp = policy_logprobs(student, batch)
    s_sampled = s_ref.gather(-1, batch.response_ids_NT[..., None])[..., 0]
    assert (train_lp.double() - s_sampled).abs().max() <= s_tol

    if family in TRANSFORMED:  # the check can fail: the plain head is off by far more than the tolerance
        plain = L.token_logprobs_from_hidden(
            response_hidden(student, batch), model_head(student).weight_VD, batch.response_ids_NT
        )
        assert (plain.double() - s_sampled).abs().max() > 100 * s_tol, "the head's transformation does not matter here"


@pytest.mark.parametrize("family", INSTALLED)
def test_losses_from_hidden_equal_the_losses_of_the_models_logits(pairs, family):
    """LSM and full-vocabulary KL from hidden states (the trainer's path) against the same losses on
    the models' own logits, values and the gradient reaching the student's head."""
    student_dir, teacher_dir = pairs[family]
    student, teacher = load_model(student_dir, "student"), load_model(teacher_dir, "teacher")
    batch = probe_batch(model_head(student).vocab)
    scores = HFTeacher(teacher).score(batch, 8)
    mask = batch.action_mask_NT
    head = model_head(student)
    P = batch.prompt_len

    def own_logits():
        return student(input_ids=batch.input_ids_NL, attention_mask=batch.attention_mask_NL).logits[:, P - 1 : -1]

    t_logits = own_logprobs(teacher, batch).float()
    for name, ours, theirs in (
        (
            "lsm",
            lambda: L.local_support_kl_from_hidden(
                response_hidden(student, batch), head, scores.topk_ids_NTK, scores.topk_logprobs_NTK, mask
            ),
            lambda: L.local_support_kl(own_logits(), scores.topk_ids_NTK, scores.topk_logprobs_NTK, mask),
        ),
        (
            "full_kl",
            lambda: L.full_vocab_kl_from_hidden(
                response_hidden(student, batch), head, response_hidden(teacher, batch), model_head(teacher), mask
            ),
            lambda: L.full_vocab_kl(own_logits(), t_logits, mask),
        ),
    ):
        values = []
        for fn in (ours, theirs):
            student.zero_grad()
            loss = fn()
            loss.sum().backward()
            trained = [head.weight_VD] + ([] if head.bias_V is None else [head.bias_V])
            values.append([loss.detach().double()] + [p.grad.detach().double().clone() for p in trained])
        # Two float32 computations of the same sums: their logits differ by the bound of the module
        # docstring (about 1e-5 here), so 1e-4 relative separates rounding from a wrong head by far.
        for what, a, b in zip(("loss", "head weight gradient", "head bias gradient"), *values):
            assert (a - b).abs().max() <= 1e-4 * (1.0 + float(b.abs().max())), f"{family} {name}: {what} differs"


class Doubled(T.LlamaForCausalLM):
    """A family whose forward does something to its logits that its config does not say."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_a_forward_opd_cannot_reproduce_is_refused_at_load(tmp_path):
    from opd.errors import UserError

    tok = load_tokenizer(DEMO_TOKENIZER, "tokenizer")
    model = build("llama", tok, 1, 32, 0)
    odd = Doubled(model.config)
    odd.load_state_dict(model.state_dict())
    with pytest.raises(UserError, match=r"Doubled's logits differ from opd's head .* use a family"):
        check_head(odd, tmp_path)
    assert check_head(model, tmp_path).bias_V is None  # the family itself passes


def test_remote_code_is_refused_without_running_it(pairs, tmp_path):
    """A model directory whose config points at its own modeling code: a one-line error naming the
    class, no prompt and no import of that code (it would raise here)."""
    import json
    import shutil

    from opd.errors import UserError

    d = tmp_path / "remote"
    shutil.copytree(pairs["llama"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mine", architectures=["MineForCausalLM"])
    cfg["auto_map"] = {"AutoConfig": "configuration_mine.MineConfig", "AutoModelForCausalLM": "modeling_mine.Mine"}
    (d / "config.json").write_text(json.dumps(cfg))
    for name in ("configuration_mine.py", "modeling_mine.py"):
        (d / name).write_text("raise RuntimeError('remote code ran')\n")
    with pytest.raises(UserError, match="MineForCausalLM is remote code"):
        load_model(d, "student")


OBJECTIVES = ("lsm", "full_kl", "sampled")


# Every objective on the families whose head is more than hidden @ W.T (a bias, scale or cap) or is tied to
# the embedding: there the objective's path through the head differs. A plain untied head's path does not
# depend on the family (its log-probs, losses and head gradients are checked per family above), so each of
# the others trains one objective, in turn, every objective on several of them.
def tied(family: str) -> bool:
    cfg_name, _, extra = FAMILIES[family]
    return extra.get("tie_word_embeddings", getattr(T, cfg_name)().tie_word_embeddings)


FULL_HEAD_PATHS = {f for f in INSTALLED if f in TRANSFORMED or tied(f)}
PLAIN = [f for f in INSTALLED if f not in FULL_HEAD_PATHS]
TRAIN_CASES = (
    [(f, o, "float32") for f in INSTALLED if f in FULL_HEAD_PATHS for o in OBJECTIVES]
    + [(f, OBJECTIVES[i % len(OBJECTIVES)], "float32") for i, f in enumerate(PLAIN)]
    + [(f, "lsm", "bfloat16") for f in ("gemma2", "phi") if f in INSTALLED]
    + [(f, o, "lora") for f in ("gemma2", "phi") if f in INSTALLED for o in ("lsm", "full_kl")]
)


@pytest.mark.parametrize("family,objective,dtype", TRAIN_CASES)
def test_every_objective_trains(pairs, family, objective, dtype, tmp_path):
    """Two steps of ``opd train`` (in process); bfloat16 runs also checkpoint layers and split
    micro-batches; "lora" trains a LoRA adapter in float32, the head (and phi's bias) frozen."""
    from opd.config import TrainConfig
    from opd.training import loop

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Compute {i} + {i + 3}.", "answer": "{2 * i + 3}"}}\n' for i in range(8)))
    student_dir, teacher_dir = pairs[family]
    low = dtype == "bfloat16"
    cfg = TrainConfig.from_flat(
        student=str(student_dir),
        teacher=str(teacher_dir),
        out=str(tmp_path / "run"),
        objective=objective,
        task=str(prompts),
        split="0.25",
        steps=2,
        batch_size=2,
        max_new_tokens=6,
        eval_samples=0,
        eval_every=0,
        ckpt_every=0,
        k=8,
        device="cpu",
        log_rollouts=1,
        diag_positions=4,
        warmup_steps=0,
        dtype="float32" if dtype == "lora" else dtype,
        gradient_checkpointing=low,
        **({"micro_batch_tokens": 128} if low else {}),
        **({"lora_r": 4} if dtype == "lora" else {}),
    )
    loop.train(cfg, show_progress=False)
    steps = step_records(tmp_path / "run")
    assert len(steps) == 2
    for rec in steps:
        assert math.isfinite(rec["train/loss"]) and rec["train/grad_norm"] > 0, rec


@pytest.mark.slow
def test_fsdp_shards_a_biased_head_like_one_process(pairs, tmp_path):
    """Two FSDP ranks (gloo) of phi, whose head has a bias: the root unit holds the head and its bias,
    gathered in the loss's forward; the trajectory and the final weights (bias included) equal one
    process's."""
    from opd.config import TrainConfig
    from opd.training import loop

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Compute {i} + {i + 3}.", "answer": "{2 * i + 3}"}}\n' for i in range(8)))
    models = pairs["phi"]
    run = dict(steps=2, task=str(prompts), split="0.25", eval_size=2, objective="lsm")
    one = tmp_path / "one"
    cfg = {**SMALL, **run, "batch_size": 4}
    loop.train(
        TrainConfig.from_flat(student=str(models[0]), teacher=str(models[1]), out=str(one), **cfg), show_progress=False
    )
    two = tmp_path / "fsdp"
    launch("torchrun", cli_args(models, two, batch_size=2, fsdp=True, **run))
    assert_same_trajectory(step_records(two), step_records(one))
    from safetensors.torch import load_file

    got, want = (load_file(str(d / "final" / "model.safetensors")) for d in (two, one))
    assert "lm_head.bias" in want and not torch.equal(want["lm_head.bias"], build_bias(models[0]))
    assert_close_weights(got, want)


def build_bias(model_dir):
    """The student's head bias as saved before training."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))["lm_head.bias"]
