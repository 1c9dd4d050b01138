"""``opd train`` keeps transformers' progress bars and deprecation notices out of the terminal.

Its loads and saves (models, checkpoints, the final model) each printed a "Loading weights" or
"Writing model shards" bar, and a deprecated keyword printed a FutureWarning at every rollout.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from opd.models.loading import load_model
from opd.runs.quiet import quiet_transformers

NOISE = ("Loading weights", "Writing model shards", "it/s]", "FutureWarning", "DeprecationWarning")


def test_the_noise_looked_for_is_what_transformers_prints(tiny_models, tmp_path, capfd):
    model = load_model(tiny_models[0])
    model.save_pretrained(tmp_path / "loud")
    assert "Writing model shards" in capfd.readouterr().err
    with quiet_transformers():
        model.save_pretrained(tmp_path / "quiet")
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize(
    "source", [[], ["--env", "toy", "--max-turns", "3", "--max-action-tokens", "8"]], ids=["prompts", "toy-env"]
)
def test_opd_train_prints_no_transformers_bars_or_deprecations(tiny_models, tmp_path, source):
    student, teacher = tiny_models
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_DISABLE", "TRANSFORMERS_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="default")  # every warning shown once, as a user sees them
    args = ["train", "--student", str(student), "--teacher", str(teacher), "--out", str(tmp_path / "run")]
    args += [
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--k",
        "8",
        "--ckpt-every",
        "1",
        "--eval-every",
        "0",
        "--device",
        "cpu",
    ]
    done = subprocess.run([sys.executable, "-m", "opd", *args, *source], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "config.json").is_file()  # a load and saves really happened
    printed = done.stdout + done.stderr
    assert [n for n in NOISE if n in printed] == [], printed[-3000:]
