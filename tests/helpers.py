"""Helpers shared by the test modules: run-directory readers, quick training configs, a batch of rollouts
to score, 2-rank launches (torchrun, accelerate), stand-in HTTP servers' JSON answers and the vLLM skip."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opd.errors import UserError
from opd.training.stepstats import FULL_VOCAB_KEYS


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_options(run_dir, cls=None) -> dict:
    """A run's config.json as flat options (opd writes it nested by section), read as ``cls`` (default
    TrainConfig; SFTConfig for an ``opd sft`` run) reads it."""

    from opd.config import TrainConfig, read_run_config

    return read_run_config(Path(run_dir) / "config.json", cls or TrainConfig)


def step_records(run_dir) -> list[dict]:
    """The training-step records of a run's metrics.jsonl (eval records left out)."""
    return [r for r in read_metrics(run_dir) if "train/loss" in r]


def rollout_texts(run_dir) -> list[tuple]:
    """The logged sample rollouts of a run: (step, prompt, response) each."""
    lines = (run_dir / "rollouts.jsonl").read_text().splitlines()
    return [(r["step"], r["prompt"], r["response"]) for r in map(json.loads, lines)]


# the size of the multi-process runs (and the single-process runs they are compared with)
SMALL = dict(
    device="cpu",
    steps=8,
    max_new_tokens=8,
    eval_size=4,
    eval_samples=0,
    k=8,
    warmup_steps=1,
    log_rollouts=2,
    diag_positions=16,
    eval_every=0,
    ckpt_every=1,
    lr=3e-3,
)
REL = 1e-4

# the size of a quick single-process run (2 steps; the training-loop tests and those built on them)
QUICK_RUN = dict(
    device="cpu",
    steps=2,
    batch_size=4,
    max_new_tokens=8,
    eval_size=4,
    eval_samples=2,
    k=8,
    warmup_steps=1,
    log_rollouts=2,
    diag_positions=16,
    eval_every=0,
    ckpt_every=0,
)


def cfg_for(models, tmp_path, **kw):
    """A ``TrainConfig`` of ``QUICK_RUN`` (``kw`` overriding it) for ``models``, writing to ``tmp_path/run``."""
    from opd.config import TrainConfig

    student, teacher = models
    return TrainConfig.from_flat(
        student=str(student), teacher=str(teacher), out=str(tmp_path / "run"), **{**QUICK_RUN, **kw}
    )


def cli_args(models, out, **kw) -> list[str]:
    student, teacher = models
    args = ["train", "--student", str(student), "--teacher", str(teacher), "--out", str(out)]
    for key, value in {**SMALL, **kw}.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send_json(handler, status: int, payload) -> None:
    """Answer a stand-in server's request (an ``http.server`` handler's) with ``payload`` as JSON; a
    handler class takes it as its method: ``_send = send_json``."""
    body = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def needs_vllm() -> None:
    """Skip without vLLM's environment (fail under OPD_REQUIRE_VLLM=1, as in CI)."""
    from opd.rollout.vllm_server import vllm_python

    try:
        vllm_python()
    except UserError as exc:
        if os.environ.get("OPD_REQUIRE_VLLM") == "1":
            pytest.fail(f"OPD_REQUIRE_VLLM=1 but {exc}")
        pytest.skip(str(exc))


def files_holding(run_dir, secret: str) -> tuple[list, list[str]]:
    """Every file under ``run_dir``, and those whose bytes hold ``secret`` (an API key must be in none)."""

    files = [p for p in Path(run_dir).rglob("*") if p.is_file()]
    return files, [str(p) for p in files if secret.encode() in p.read_bytes()]


def launch_command(launcher: str, args: list[str]) -> list[str]:
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:  # accelerate: --multi_gpu is what starts 2 ranks on a machine without a GPU (--cpu starts one)
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
        ]
    return cmd + ["-m", "opd"] + args


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "_TYPER_STANDARD_TRACEBACK": "1"}


def two_rank_script(script: Path, out: Path, timeout: int) -> list[dict]:
    """Run ``script OUT`` as ranks 0 and 1 of a gloo group (WORLD_SIZE/RANK/MASTER_* set, no launcher); each
    rank writes ``OUT/rank{r}.json``, returned in rank order. A hang past ``timeout`` kills both ranks."""
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(out)], env={**env, "RANK": str(r)}, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in ranks]
    finally:  # a hang must not leave the ranks running into the next tests
        for p in ranks:
            p.kill()
    assert all(p.returncode == 0 for p in ranks), errs
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]


def run_opd(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    """``opd ARGS`` in this process: its exit code, stdout and stderr."""
    from opd.cli import main

    monkeypatch.setattr(sys, "argv", ["opd", *map(str, args)])
    with pytest.raises(SystemExit) as stopped:
        main()
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def launch(launcher: str, args: list[str], timeout: int = 300, env: dict | None = None) -> str:
    """Run a 2-rank launch of ``opd ARGS`` to its end (``env``: more environment variables); its stderr."""
    return run_launch(launch_command(launcher, args), timeout, env)


def run_launch(cmd: list[str], timeout: int = 300, env: dict | None = None) -> str:
    """Run a launcher's command (``cmd``) to its end, or kill it and its ranks after ``timeout``; its stderr."""
    # its own process group, so a launch that hangs is killed with its ranks (killing only the
    # launcher would leave the ranks running into the next tests)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, **(env or {})},
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import psutil

        # The ranks may sit in sessions of their own (torchelastic starts them so): kill every
        # descendant, not only the launcher's group, or one that holds the output pipes keeps the
        # communicate below waiting for ever.
        ranks = psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):  # it may have ended at the last moment
            os.killpg(proc.pid, signal.SIGKILL)
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"{' '.join(cmd[:3])} did not finish within {timeout} s; its ranks were killed: {err[-2000:]}")
    assert proc.returncode == 0, err[-4000:]
    return err


def kill_a_rank_after_first_checkpoint(args: list[str], out) -> None:
    """Start a 2-rank run and SIGKILL rank 1's process once the first checkpoint exists; torchrun
    then tears the group down, as after a crash or a lost machine."""
    import psutil

    proc = subprocess.Popen(
        launch_command("torchrun", args), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "latest").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        # rank 1's process, not one it started (a --max-staleness rollout worker inherits its RANK)
        ranks = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if p.environ().get("RANK") == "1" and p.parent().environ().get("RANK") != "1"
        ]
        assert ranks, "the run ended before a rank could be killed"
        os.kill(ranks[0].pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:  # a failed assertion must not leave the launcher and its ranks running
        for p in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            p.kill()
        proc.kill()
        proc.wait()
    assert not (out / "final").exists()


def assert_same_trajectory(got: list[dict], want: list[dict], rel: float = REL, abs_other: float = 1e-5) -> None:
    assert want, "no training steps were logged"
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in w:
            if key.startswith("time/") or key in FULL_VOCAB_KEYS:
                continue
            tol = 1e-9 if key in ("train/loss", "train/grad_norm") else abs_other
            assert g[key] == pytest.approx(w[key], rel=rel, abs=tol), (w["step"], key)


def final_weights(run_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_close_weights(a: dict, b: dict) -> None:
    """Equal up to Adam's amplification of rounding noise: where a gradient is zero in one run and a
    rounding residue (~1e-10) in the other, Adam's g / (|g| + eps) turns it into a few percent of
    one step (observed: 2.5% of lr after 3 steps). Saving the wrong weights (the initial ones, or a
    shard) would be off by whole steps (each up to lr), so 10% of one step still tells them apart."""
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert worst < 0.1 * SMALL["lr"], worst


def train_killed_at(cfg, step: int, monkeypatch) -> None:
    """Run ``opd train`` with ``cfg`` and kill it (KeyboardInterrupt) as ``step`` starts, as a
    user's Ctrl-C or a lost machine would: what it wrote before stays, nothing after."""
    import opd.training.loop as train_mod
    from opd.training.producer import Ahead, OnPolicy

    def dying(real):
        def dies(self, s):
            if s == step:
                raise KeyboardInterrupt("simulated kill")
            return real(self, s)

        return dies

    producers = (OnPolicy, Ahead)  # made here, or taken from the worker (--max-staleness)
    real = {p: p.take for p in producers}
    for p in producers:
        monkeypatch.setattr(p, "take", dying(real[p]))
    try:
        with pytest.raises(KeyboardInterrupt):
            train_mod.train(cfg, show_progress=False)
    finally:
        for p in producers:
            monkeypatch.setattr(p, "take", real[p])


def first_rollout(run, step: int = 0):
    """``rollout_stage`` of the step's first task (the one task of a single-task run)."""
    from opd.training import producer

    return producer.rollout_stage(run, step, producer.step_tasks(run, step)[0])


def rollouts(tok, student_dir, n=6, new_tokens=10):
    """``n`` rollouts of the student in ``student_dir`` (temperature 1.5, seeded by index), for a teacher to score."""
    from opd.models.loading import load_model
    from opd.rollout.sampling import HFRollout

    student = load_model(student_dir, "student")
    prompts = [tok(f"Compute {i} + {3 * i + 1} * {i % 4 + 2}." + " x" * i)["input_ids"] for i in range(n)]
    return HFRollout(student, tok.eos_token_id, tok.pad_token_id).generate(
        prompts, list(range(n)), max_new_tokens=new_tokens, temperature=1.5, top_p=1.0
    )
