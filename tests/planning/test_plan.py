"""`opd plan`: the planner's arithmetic on a case computed by hand, the activation formula against the tensors
autograd keeps, the models' shapes from configs alone, exit codes, the committed measurement and the plans
docs/scale-out.md prints."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers import run_opd

from opd.config import TrainConfig
from opd.planning.advice import parse_memory
from opd.planning.memory import GiB, Layout, layer_activation_bytes, plan_memory
from opd.planning.shapes import ModelShape, model_shape

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "benchmarks" / "data" / "qwen3"
# Qwen3-1.7B from Qwen3-8B's scores, 8k-token responses, 8 GPUs of 80 GiB: the run
BIG = (
    f"plan --student {QWEN3 / 'Qwen3-1.7B'} --teacher {QWEN3 / 'Qwen3-8B'} --dtype bfloat16 --batch-size 16 "
    "--max-new-tokens 8192 --max-prompt-tokens 1024 --world-size 8 --gpu-memory 80GiB"
).split()


def shape(**kw) -> ModelShape:
    base = dict(name="s", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=100, tied=True)
    return ModelShape(**{**base, "params": 1000, "layer_params": 300, **kw})


def test_plan_by_hand():
    """Every part of a tiny float32 run, each computed here from the options (comments: the arithmetic)."""
    cfg = TrainConfig.from_flat(
        student="s", teacher="t", batch_size=2, max_new_tokens=10, max_prompt_tokens=6, k=4, diag_positions=3
    )
    teacher = shape(name="t", hidden=16, params=3000, vocab=100)
    plan = plan_memory(cfg, shape(), teacher, Layout(world=1, gpu_bytes=10**6, device="cuda"))
    got = {p.name: p.bytes for p in plan.parts}
    rows, seq, T = 2, 16, 10  # sequence: 6 prompt + 10 response tokens
    per_layer = 4 * (7 * 8 + 4 * 8 + 4 * 16 + seq) + 4 * (2 + 2)  # d 8, q 2 x 4, f 16, 2 heads; 688 B a token
    want = {
        "student weights": 1000 * 4,
        "gradients": 1000 * 4,
        "AdamW state": 2 * 1000 * 4,
        "AdamW's temporaries": 1000 * 4,  # on a GPU, foreach: the sqrt of every second moment at once
        "teacher": 3000 * 4,
        "teacher's forward": rows * seq * (3 * 16 + seq) * 4,  # its 8-row chunk holds both rows; MLP 16 wide
        "teacher's hidden states": 2 * rows * T * 16 * 4,
        "teacher's top-K chunks": 2 * 128 * 100 * 4,  # a float32 head: no cast blocks
        "teacher's logits at the diagnostic positions": 3 * 100 * 4,
        "KV cache": 2 * 2 * 4 * rows * seq * 4,  # 2 (K, V) x layers x kv width x rows x seq x 4 B
        "sampler's vocabulary rows": rows * 100 * 32,
        "evaluation's KV cache": 2 * 2 * 4 * 262144 * 4,
        "activations": rows * seq * 2 * per_layer,
        "backward's working set": rows * seq * (3 * 16 * 4 + 2 * 8 * 4),  # MLP gradients in flight
        "final hidden states": 3 * rows * seq * 8 * 4,
        "loss buffers": rows * T * 4 * 41 + 128 * 4 * 8 * 4,
        "hidden states kept for the step's logs": rows * T * 8 * 4,
        "head gradient buffer": 100 * 8 * 4,
        "teacher's top-K for the step": rows * T * (4 * 12 + 4),
        "diagnostics": 3 * 100 * 4 * 4,
    }
    assert got == want
    run = 4000 + 8000 + 12000  # weights, AdamW's moments, the teacher: one micro-batch, so no gradients yet
    step_data = want["hidden states kept for the step's logs"] + want["teacher's top-K for the step"]
    step_data += want["teacher's logits at the diagnostic positions"]
    update = sum(want[n] for n in ("activations", "backward's working set", "final hidden states", "loss buffers"))
    assert plan.held("update") == run + update + want["head gradient buffer"] + step_data
    assert plan.held("optimizer") == run + 4000 + 4000 + step_data  # every gradient, AdamW's temporaries
    assert plan.held("rollout") == run + 4000 + want["KV cache"] + want["sampler's vocabulary rows"]
    assert plan.stage_peak("update") == max(plan.held("update"), plan.held("optimizer"))
    assert plan.peak == max(plan.held(p) for p in ("rollout", "score", "update", "optimizer", "log", "eval"))
    assert plan.usable == int(10**6 * 0.9 - GiB)  # a megabyte is less than the fixed reserve
    assert plan.fits is False


def test_when_gradients_are_held_by_hand():
    """Set to None as each update starts, gradients are absent where its first backward starts, unless DDP's
    buckets or an earlier micro-batch keep them; AdamW's step on a CPU adds two of the largest tensor."""
    cfg = TrainConfig.from_flat(
        student="s", teacher_url="http://t:1", batch_size=4, max_new_tokens=10, max_prompt_tokens=6
    )
    phases = lambda c, layout: next(
        p.phases for p in plan_memory(c, shape(), None, layout).parts if p.name == "gradients"
    )
    assert phases(cfg, Layout(1)) == ("rollout", "score", "optimizer", "log", "eval")
    assert phases(cfg, Layout(2)) == ("run",)  # DDP: the gradients are views of its buckets, never freed
    assert phases(TrainConfig.from_flat(**{**cfg.flat(), "fsdp": True}), Layout(2)) == (
        "rollout",
        "score",
        "optimizer",
        "log",
        "eval",
    )
    assert phases(TrainConfig.from_flat(**{**cfg.flat(), "grad_accum": 2}), Layout(1)) == ("run",)
    assert phases(TrainConfig.from_flat(**{**cfg.flat(), "micro_batch_tokens": 16 * 3}), Layout(1)) == (
        "run",
    )  # 3 rows of 4
    assert phases(TrainConfig.from_flat(**{**cfg.flat(), "micro_batch_tokens": 16 * 4}), Layout(1)) != ("run",)
    cpu = {p.name: p for p in plan_memory(cfg, shape(), None, Layout(1, device="cpu")).parts}
    assert cpu["AdamW's temporaries"].bytes == 2 * 100 * 8 * 4  # the (tied) embedding, 100 x 8, twice
    lora = shape(lora_dims=(("q_proj", 8, 8), ("down_proj", 16, 8)))
    lcfg = TrainConfig.from_flat(**{**cfg.flat(), "lora_r": 2, "lora_targets": ["all-linear"]})
    got = {p.name: p.bytes for p in plan_memory(lcfg, lora, None, Layout(1, device="cpu")).parts}
    assert got["AdamW's temporaries"] == 2 * 2 * 16 * 4  # down_proj's A, r 2 x 16 in-features
    got = {p.name: p.bytes for p in plan_memory(lcfg, lora, None, Layout(1)).parts}
    assert got["AdamW's temporaries"] == 2 * (8 + 8 + 16 + 8) * 4  # every adapter tensor's sqrt at once


def test_sharding_lora_and_checkpointing_by_hand():
    """FSDP divides the training state by the ranks; LoRA trains only the adapter (the base in --dtype);
    checkpointing keeps each layer's input and recomputes one layer."""
    lora = ((("q_proj", 8, 8),) * 2) + ((("down_proj", 16, 8),) * 2)  # two layers
    s = shape(lora_dims=lora)
    cfg = TrainConfig.from_flat(
        student="s", teacher_url="http://t:1", batch_size=2, max_new_tokens=10, max_prompt_tokens=6
    )
    fsdp = {
        p.name: p.bytes
        for p in plan_memory(TrainConfig.from_flat(**{**cfg.flat(), "fsdp": True}), s, None, Layout(4)).parts
    }
    assert (fsdp["student weights"], fsdp["gradients"], fsdp["AdamW state"]) == (1000, 1000, 2000)
    assert fsdp["teacher"] == 0
    lcfg = TrainConfig.from_flat(**{**cfg.flat(), "lora_r": 2, "lora_targets": ["q_proj"], "dtype": "bfloat16"})
    got = {p.name: p.bytes for p in plan_memory(lcfg, s, None, Layout(1)).parts}
    adapter = 2 * 2 * (8 + 8)  # 2 layers' q_proj, r (in + out)
    assert got["student weights"] == 1000 * 2 + adapter * 4
    assert (got["gradients"], got["AdamW state"]) == (adapter * 4, 2 * adapter * 4)
    assert "head gradient buffer" not in got  # the head is frozen
    ccfg = TrainConfig.from_flat(**{**cfg.flat(), "gradient_checkpointing": True})
    got = {p.name: p.bytes for p in plan_memory(ccfg, s, None, Layout(1)).parts}
    tokens, per_layer = 2 * 16, 4 * (7 * 8 + 4 * 8 + 4 * 16 + 16) + 4 * (2 + 2)
    assert got["activations"] == tokens * (2 * 8 * 4 + per_layer) + tokens * 16 * 4  # inputs, one layer, the mask


def _saved_bytes(model_cls, config_cls, dtype: str) -> tuple[float, ModelShape]:
    """Bytes a random tiny model's decoder layers keep for the backward per token and layer, counted with
    autograd's saved-tensor hooks (each storage once, parameters and their bfloat16 casts left out)."""
    d, layers, heads, kv, hd, f, V, N, S = 64, 2, 4, 2, 24, 160, 300, 3, 40
    cfg = config_cls(vocab_size=V, hidden_size=d, intermediate_size=f, num_hidden_layers=layers)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = heads, kv, hd
    torch.manual_seed(0)
    model = model_cls(cfg).train()
    ids, mask = torch.randint(0, V, (N, S)), torch.ones(N, S, dtype=torch.long)
    mask[0, :5] = 0  # a padded row: sdpa gets the batch's mask, as in opd's forward
    seen: dict[int, tuple[int, tuple]] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), tuple(t.shape)))
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            model.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    kept = sum(n for ptr, (n, s) in seen.items() if ptr not in params and s not in weight_shapes)
    q_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
    m = ModelShape("m", layers, d, heads, kv, hd, f, V, True, 0, 0, qk_norm=q_norm)
    return kept / (N * S * layers), m


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_formula_matches_saved_tensors(arch, dtype):
    """The per-layer activation formula is what transformers' layers keep, but for what the model keeps once
    for all its layers (the rotary tables, the ids and positions)."""
    import transformers

    names = {"qwen2": ("Qwen2ForCausalLM", "Qwen2Config"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Config")}[arch]
    measured, m = _saved_bytes(getattr(transformers, names[0]), getattr(transformers, names[1]), dtype)
    planned = layer_activation_bytes(m, 40, dtype)
    once = (2 * m.head_dim * 4 + 16) / m.layers  # the rotary tables, the ids and positions: once for every layer
    assert planned <= measured <= planned + once, (measured, planned)


def test_shape_from_config_alone(tmp_path):
    """A config.json only (no weights): the parameters counted as written out here by hand."""
    d, L, H, KV, hd, f, V = 64, 2, 4, 2, 16, 96, 500
    config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=d, num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=KV, head_dim=hd, intermediate_size=f, vocab_size=V,
        tie_word_embeddings=True,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    s = model_shape(str(tmp_path))
    q, kv = H * hd, KV * hd
    layer = d * q + 2 * d * kv + q * d + 2 * hd + 2 * d + 3 * d * f  # q k v o, q/k norms, 2 norms, MLP
    assert (s.params, s.layer_params, s.qk_norm, s.tied) == (V * d + L * layer + d, layer, True, True)
    assert s.lora_params(4, ["q_proj"]) == L * 4 * (d + q)
    assert s.lora_params(4, ["all-linear"]) == L * 4 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))


def test_exit_codes_and_the_change_that_fits(monkeypatch, capsys):
    """Does not fit: exit 1 with a change that fits, which, applied, plans to exit 0; bad input: exit 2."""
    code, out, _ = run_opd(monkeypatch, capsys, [*BIG, "--json"])
    plan = json.loads(out)
    assert code == 1 and plan["fits"] is False and plan["peak"] > plan["usable"]
    change = plan["change"]
    assert change["peak"] <= plan["usable"]
    fixed = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
        for k, v in change["options"].items()
    ]
    code, out, _ = run_opd(monkeypatch, capsys, [*BIG, *fixed, "--json"])
    assert code == 0 and json.loads(out)["peak"] == change["peak"]
    code, out, err = run_opd(monkeypatch, capsys, [*BIG, "--gpu-memory", "lots"])
    assert code == 2 and err.startswith("error: --gpu-memory 'lots': give a size such as 80GiB")
    code, out, _ = run_opd(monkeypatch, capsys, [*BIG, "--gpu-memory", "1GiB"])  # nothing fits 1 GiB
    assert code == 1 and "no change opd knows of fits" in out


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * GiB
    assert parse_memory("141 GB") == 141 * 10**9
    assert parse_memory("512") == 512


MEASURED = json.loads((ROOT / "benchmarks" / "results" / "plan.json").read_text())["cells"]


@pytest.mark.parametrize("cell", MEASURED, ids=lambda c: c["name"][0])
def test_measured_peaks_within_the_derived_tolerance(cell):
    """benchmarks/bench_plan.py's committed measurement: each stage's measured peak lies within the plan's
    tolerance (recomputed here from the numbers, not read from its verdict)."""
    assert len(MEASURED) == 3 and len(cell["stages"]) == 3
    for r in cell["stages"]:
        assert r["planned"] * 0.9 <= r["measured"] <= r["planned"] + r["tolerance"], r


SCALE_OUT = ROOT / "docs" / "scale-out.md"


def docs_layouts() -> tuple[list[str], list[dict]]:
    """docs/scale-out.md's plans: the options in common, and per layout of its table its options, the peak and
    verdict quoted, and the printout under its name (empty if none)."""
    text = SCALE_OUT.read_text()
    common = re.search(r"```bash\n(opd plan .*?) \.\.\.\n```", text, re.S)
    assert common, "docs/scale-out.md: the plans' common options (```bash opd plan ... ```) not found"
    rows = re.findall(r"^\| ([^|]+) \| `([^`]+)` \| ([0-9.]+) GiB \((\w+)\) \| (.+) \|$", text, re.M)
    blocks = dict(re.findall(r"<details><summary>(.*?)</summary>\n\n```text\n(.*?)```", text, re.S))
    layouts = [
        dict(name=n, options=shlex.split(o), peak=float(p), phase=ph, verdict=v, printout=blocks.get(n, ""))
        for n, o, p, ph, v in rows
    ]
    return shlex.split(common.group(1).replace("\\\n", " "))[2:], layouts


@pytest.mark.parametrize("layout", docs_layouts()[1], ids=lambda lay: lay["name"][:24])
def test_the_docs_plans_are_what_opd_plan_prints(layout, monkeypatch, capsys):
    """Each layout docs/scale-out.md plans: its peak, phase and verdict (and the change that fits, with its peak)
    as the table quotes them, and its printout's phases and parts, are what the planner gives now (the models'
    configs from benchmarks/data/qwen3, as the docs say)."""
    common, _ = docs_layouts()
    monkeypatch.chdir(QWEN3)
    args = [a.removeprefix("Qwen/") for a in ["plan", *common, *layout["options"]]]
    code, out, _ = run_opd(monkeypatch, capsys, [*args, "--json"])
    plan = json.loads(out)
    assert (round(plan["peak"] / GiB, 2), plan["peak_phase"]) == (layout["peak"], layout["phase"])
    if plan["fits"]:
        assert code == 0 and layout["verdict"] == "fits"
    else:
        change = plan["change"]
        assert (
            code == 1
            and layout["verdict"] == f"does not fit; fits with `{change['flags']}` ({change['peak'] / GiB:.2f} GiB)"
        )
    if layout["printout"]:
        printed = layout["printout"]
        phases = " ".join(f"{ph} {v / GiB:.2f} GiB" for ph, v in plan["phases"].items())
        assert f"held in each phase: {phases} peak: " in re.sub(r"\s+", " ", printed)  # the line may wrap
        rows = re.findall(r"^│ (\S.*?) +│ (\S.*?) +│ +([0-9.]+) │", printed, re.M)  # a row's first line
        want = [(p["name"], ", ".join(p["phases"]), f"{p['bytes'] / GiB:.2f}") for p in plan["parts"]]
        assert [b for *_, b in rows] == [b for *_, b in want]
        assert all(wn.startswith(n) and ww.startswith(w) for (n, w, _), (wn, ww, _) in zip(rows, want, strict=True))
