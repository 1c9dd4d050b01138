"""The lab (demos, experiments) stays apart from the library: ``import opd``, the CLI and ``opd train``
load none of it; ``opd demo`` and ``opd experiment`` do, when they run."""

from __future__ import annotations

import subprocess
import sys

# Runs the CLI in this process's interpreter, then reports which opd.lab modules were imported.
PROBE = """
import sys
{before}
print("LAB:" + ",".join(sorted(m for m in sys.modules if m == "opd.lab" or m.startswith("opd.lab."))))
"""


def _lab_modules(before: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [s for s in done.stdout.splitlines() if s.startswith("LAB:")][-1]
    return [m for m in line[4:].split(",") if m]


def test_importing_opd_and_its_cli_loads_no_lab_module():
    assert _lab_modules("import opd, opd.cli, opd.losses, opd.training.loop, opd.teachers.server") == []


def test_opd_train_loads_no_lab_module(tiny_models, tmp_path):
    student, teacher = tiny_models
    args = ["train", "--student", str(student), "--teacher", str(teacher), "--out", str(tmp_path / "run")]
    args += ["--steps", "1", "--batch-size", "2", "--max-new-tokens", "4", "--k", "4", "--eval-every", "0"]
    args += ["--eval-size", "2", "--eval-samples", "0", "--device", "cpu"]
    before = f"from opd.cli import app\napp({args!r}, standalone_mode=False)"
    assert _lab_modules(before) == []
    assert (tmp_path / "run" / "final" / "config.json").is_file()  # the run really trained and saved


def test_the_lab_commands_load_the_lab(tmp_path):
    # The probe can see the lab: a wrong experiment name is answered from opd.lab.experiments.
    before = "from opd.cli import app\ntry:\n    app(['experiment', 'no-such'], standalone_mode=False)\nexcept Exception as e:\n    print(e)"
    assert "opd.lab.experiments" in _lab_modules(before)
