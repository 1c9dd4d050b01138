"""Golden trajectories and learning: opd's LSM on the packaged demo models, step by step.

* The first steps of an LSM run match recorded losses, gradient norms and response lengths (the
  torchtune habit): any change to sampling, scoring, the loss or the optimizer that moves the
  numbers shows up here, even when every unit test still passes. The figures were recorded with
  the torch version stored beside them; under another version the test is skipped, since kernels
  may round differently. The CPU capability torch used (its kernels' instruction set, AVX2 or
  AVX512, ``torch.backends.cpu.get_cpu_capability()``) is stored too and shown beside the result
  (in the test's id): another capability rounds differently (3 steps stay within the tolerance;
  the demo's 200 steps part visibly), and ``ATEN_CPU_CAPABILITY=avx2`` reproduces an AVX2
  recording on a CPU that has AVX-512. A change that moves them on purpose re-records them, and
  says why:

      python tests/test_golden.py --record

* A short LSM run raises the demo student's greedy accuracy on held-out prompts (fixed seed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from opd.config import TrainConfig
from opd.lab.demos.demo import ASSETS
from opd.training import loop as train_mod

GOLDEN = Path(__file__).parent / "golden" / "lsm_demo_steps.json"
KEYS = ("train/loss", "train/grad_norm", "rollout/response_len", "train/loss_tokens")
HERE = torch.backends.cpu.get_cpu_capability()
RECORDED = json.loads(GOLDEN.read_text()).get("cpu_capability", "not recorded")
# beside the result: the capability here, and the recording's where it differs
CPU = f"cpu {HERE}" + ("" if RECORDED == HERE else f", recorded under {RECORDED}")


def golden_config(out: Path, **changes) -> TrainConfig:
    """The recorded run's configuration (``changes`` for the longer accuracy run beside it)."""
    fields = dict(
        student=str(ASSETS / "student"),
        teacher=str(ASSETS / "teacher"),
        device="cpu",
        seed=0,
        objective="lsm",
        k=32,
        steps=3,
        batch_size=8,
        max_new_tokens=24,
        lr=5e-4,
        warmup_steps=1,
        eval_every=0,
        eval_size=4,
        eval_samples=0,
        ckpt_every=0,
        log_rollouts=0,
        diag_positions=16,
        out=str(out),
    )
    return TrainConfig.from_flat(**{**fields, **changes})


def run_steps(out: Path) -> list[dict]:
    train_mod.train(golden_config(out), show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in records if "train/loss" in r]


@pytest.mark.parametrize("cpu", [CPU])
def test_lsm_steps_match_the_recorded_trajectory(tmp_path, cpu):
    golden = json.loads(GOLDEN.read_text())
    if golden["torch"] != torch.__version__:
        pytest.skip(
            f"golden steps were recorded with torch {golden['torch']}, this is {torch.__version__}; "
            "re-record with python tests/test_golden.py --record"
        )
    got = run_steps(tmp_path / "run")
    assert [r["step"] for r in got] == [r["step"] for r in golden["steps"]]
    for want, have in zip(golden["steps"], got, strict=True):
        assert have["train/loss_tokens"] == want["train/loss_tokens"], want["step"]
        assert have["rollout/response_len"] == pytest.approx(want["rollout/response_len"], abs=1e-9), want["step"]
        # Thread counts reorder float sums; anything beyond that is a change in behaviour.
        for key in ("train/loss", "train/grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=1e-4), (want["step"], key, cpu)


@pytest.mark.slow
def test_a_short_lsm_run_raises_the_students_accuracy(tmp_path):
    from opd.evaluation.model_eval import evaluate_model
    from opd.models.loading import load_model, load_tokenizer
    from opd.rollout.prompt_set import PromptSet, load_task

    cfg = golden_config(tmp_path / "run", steps=40, batch_size=32, max_new_tokens=48, warmup_steps=2, eval_size=100)
    tok = load_tokenizer(cfg.model.student)
    task = load_task(cfg.data.task, cfg.data.task_level, cfg.run.seed)
    prompts = PromptSet.build(
        task.examples("test")[: cfg.eval.eval_size], tok, cfg.data.max_prompt_tokens, "test prompts"
    )
    before = evaluate_model(
        load_model(cfg.model.student, device=torch.device("cpu")),
        tok,
        prompts,
        task,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )["accuracy"]
    after = train_mod.train(cfg, show_progress=False)["eval/accuracy"]  # the same 100 prompts, greedy
    assert after >= before + 0.10, (before, after)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_golden.py --record")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        steps = run_steps(Path(tmp) / "run")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "cpu_capability": HERE,
                "config": "tests/test_golden.py:golden_config",
                "steps": steps,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"recorded {len(steps)} steps into {GOLDEN} (torch {torch.__version__}, CPU capability {HERE})")
