"""TRL's GOLD (``trl.experimental.gold``) as a peer in the experiments: one on-policy run on opd's task.

:func:`run_gold` is a python run step (``fn(params, run_dir) -> dict``): it trains the student with
``GOLDTrainer`` from local directories on CPU and writes the final model to ``run_dir/final`` with
opd's :func:`opd.runs.rundir.save_final_model`, so ``opd eval`` scores it exactly as it scores opd's runs.
The settings follow opd's runs unless a run sets GOLD's own knobs (``lmbda``, ``beta``,
``temperature``, ``extended``): fully on-policy (``lmbda=1``), the same prompts (the task's
training split; GOLD draws them in its own shuffled order), steps, batch, opd's own optimizer and
schedule (:mod:`opd.training.optim`: AdamW, warm-up then a constant rate), clipping 1.0, temperature 1,
top-p and no top-k, the same maximum response length. GOLD's loss: ULD (sorted-probability L1) or its hybrid
(JSD on tokens spelled the same in both vocabularies, ULD on the rest), with no cross-entropy term.

What GOLD itself does, not changed here (see the experiment's notes): the teacher reads the
*student's* chat-template text re-tokenized (its own template is never used), and its extended
byte-offset alignment refuses a teacher tokenizer that is not byte-level BPE, so with a
SentencePiece-style teacher GOLD runs ULD's positional alignment (``use_extended_uld=False``:
both sequences truncated to the shorter one), as TRL's documentation says to.
:func:`probe_extended_uld` records TRL's own answer to the extended alignment.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from opd.errors import UserError


def _require_trl():
    try:
        from trl.experimental.gold import GOLDConfig, GOLDTrainer
    except ImportError as err:  # TRL is an optional peer, not a dependency of opd
        raise UserError(
            f"the GOLD runs need TRL >= 1.16 with trl.experimental.gold ({err}); pip install 'trl>=1.16'"
        ) from err
    return GOLDConfig, GOLDTrainer


def _dataset(p: dict):
    """The task's training prompts as chat messages (the solution only serves GOLD's off-policy path, unused at lmbda=1)."""
    from datasets import Dataset

    from opd.rollout.prompt_set import load_task

    examples = load_task("arithmetic", p["task_level"], 0).examples("train")[: p["prompts"]]
    rows = [
        {"messages": [{"role": "user", "content": e.prompt}, {"role": "assistant", "content": e.solution}]}
        for e in examples
    ]
    return Dataset.from_list(rows)


def _trainer(p: dict, run_dir: Path, extended: bool, steps: int):
    GOLDConfig, GOLDTrainer = _require_trl()
    from opd.models.loading import load_model, load_tokenizer
    from opd.training.optim import make_optimizer, make_scheduler

    args = GOLDConfig(
        output_dir=str(run_dir / "trl"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=p["seed"],
        max_steps=steps,
        per_device_train_batch_size=p["batch_size"],
        gradient_accumulation_steps=1,
        learning_rate=p["lr"],
        max_grad_norm=1.0,
        lmbda=p.get("lmbda", 1.0),  # 1: every batch sampled by the student (on-policy, as opd)
        beta=p.get("beta", 0.5),
        temperature=p.get("temperature", 1.0),
        top_p=p["top_p"],
        top_k=0,
        max_completion_length=p["max_new_tokens"],
        max_length=p["max_new_tokens"] + 256,
        teacher_model_name_or_path=p["teacher"],
        teacher_tokenizer_name_or_path=p["teacher_tokenizer"],
        use_uld_loss=p.get("uld", True),  # False: GKD's JSD (same tokenizer only)
        uld_use_hybrid_loss=p["hybrid"],
        use_extended_uld=extended,
        dataloader_num_workers=0,
    )
    student_tok = load_tokenizer(p["student"], "student")  # left padding, as GOLD's generation needs
    student = load_model(p["student"], "student")
    opt = make_optimizer(student, p["lr"])
    trainer = GOLDTrainer(
        model=student,
        teacher_model=p["teacher"],
        args=args,
        train_dataset=_dataset(p),
        processing_class=student_tok,
        optimizers=(opt, make_scheduler(opt, p["warmup_steps"], steps, "constant")),
    )
    return trainer, student_tok


def run_gold(p: dict, run_dir: Path) -> dict:
    """Train with GOLD (``p``: student, teacher, teacher_tokenizer, hybrid, steps, batch_size, lr,
    warmup_steps, top_p, max_new_tokens, seed, task_level, prompts; optional GOLD knobs ``extended``
    (its byte-offset alignment; default off), ``lmbda``, ``beta``, ``temperature`` (defaults 1, 0.5,
    1) and ``uld`` (default on; off: GKD's JSD, for a teacher with the student's tokenizer)); the
    model goes to ``run_dir/final``."""
    from opd.runs.rundir import save_final_model

    trainer, student_tok = _trainer(p, run_dir, extended=p.get("extended", False), steps=p["steps"])
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    save_final_model(run_dir / "final", trainer.model, student_tok)
    log = [r for r in trainer.state.log_history if "loss" in r]
    (run_dir / "gold_log.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
    return {
        "train_wall_s": round(wall, 1),
        "s_per_step": round(wall / max(p["steps"], 1), 3),
        "loss_first": log[0]["loss"] if log else None,
        "loss_last": log[-1]["loss"] if log else None,
    }


def probe_extended_uld(p: dict, run_dir: Path) -> dict:
    """One step of GOLD's default extended (byte-offset) alignment with this teacher tokenizer: the
    error TRL raises, recorded verbatim, or ``None`` when it runs."""
    trainer, _ = _trainer(dict(p, steps=1), run_dir, extended=True, steps=1)
    try:
        trainer.train()
    except (NotImplementedError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}
