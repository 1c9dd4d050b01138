#!/usr/bin/env python
"""Run opd's gpu tests (tests/gpu, marked ``gpu``) and write their card: a Markdown page of every test's
outcome and what it recorded, and the JSON (the card's name, the commit, the machine, every test's record).
Both are rewritten after each test, so a run cut short keeps what it has.

The tests, in the order they run (the most important first; each file's docstring says what it checks):
  test_env.py         the machine: torch, CUDA, cuDNN, NCCL, the GPU, the libraries, TF32 settings
  test_losses.py      every loss in float32 and bfloat16 against tests/reference.py's float64 loops
  test_train.py       opd train with each objective and option; resume; torchrun one rank (plain, DDP, FSDP)
  test_speed.py       loss steps at V=151936 (time, memory); opd's sampling loop at a 0.5B shape (tokens/s)
  test_real_shape.py  bfloat16 mixed precision at a 0.36B student / 1.31B teacher: NaNs, replay, step split
  test_decode.py      the static KV cache and its CUDA graph against the dynamic cache
  test_vllm_sleep.py  --vllm-sleep 1 and 2 on a real vLLM server (skipped without vLLM)

Run (repository root):
  python benchmarks/gpu_check.py --card h200 --out benchmarks/results/gpu_check_h200.json   # a GPU, every test
  python benchmarks/gpu_check.py --only env,losses,train --out $OUT/gpu_check.json    # some files (a 10-min slot)
  python benchmarks/gpu_check.py --only train --out $OUT/t.json -- -k "lsm and not lora"   # after --: pytest's
  python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check_cpu.json   # the CPU dry run (small shapes)
The exit status is pytest's (0: every test passed or was skipped). ``pytest -m gpu tests/gpu`` runs the same
tests without a card. Offline GPU machines: benchmarks/gpu_carry.sh downloads the wheels opd needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FILES = ("env", "losses", "train", "speed", "real_shape", "decode", "vllm_sleep")


def value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, list) and len(v) > 6:
        return "[" + ", ".join(value(x) for x in v[:3]) + f", ... ({len(v)})]"
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {value(x)}" for k, x in v.items()) + "}"
    return str(v)


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


class Card:
    """A pytest plugin: each test's outcome, seconds and recorded properties, written out after each."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.tests = out, meta, {}
        self.t0 = time.perf_counter()

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "recorded": {}})
        entry["seconds"] = round(entry["seconds"] + report.duration, 2)
        entry["recorded"].update({k: v for k, v in report.user_properties})
        if report.skipped:
            entry["outcome"] = "skipped"
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            entry["why"] = why.removeprefix("Skipped: ")
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
            entry["error"] = str(report.longrepr)[-3000:]
        if report.when == "teardown":
            self.write()

    def write(self) -> None:
        counts: dict = {}
        for t in self.tests.values():
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        data = {**self.meta, "wall_s": round(time.perf_counter() - self.t0, 1), "counts": counts, "tests": self.tests}
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, self.out)
        self.out.with_suffix(".md").write_text(markdown(data))


def markdown(data: dict) -> str:
    m = data["machine"]
    counts = ", ".join(f"{n} {k}" for k, n in sorted(data["counts"].items()))
    lines = [
        f"# opd GPU check: card {data['card']} ({data['device']}{', dry run' if data['dry_run'] else ''})",
        "",
        f"- opd {data['commit']}, started {data['started']}, {data['wall_s']:.0f} s; {counts}",
        f"- {m.get('gpu') or 'no GPU'}; torch {m.get('torch')}, {m.get('cpu_cores')} CPU cores; "
        f"pytest {' '.join(data['pytest_args'])}",
    ]
    by_file: dict = {}
    for nodeid, t in data["tests"].items():
        by_file.setdefault(nodeid.split("::")[0], []).append((nodeid.split("::", 1)[-1], t))
    for path, tests in by_file.items():
        lines += ["", f"## {path}", "", "| test | outcome | s | recorded |", "|---|---|---:|---|"]
        for name, t in tests:
            rec = "; ".join(f"{k} {value(v)}" for k, v in t["recorded"].items()) or t.get("why", "")
            lines.append(f"| {cell(name)} | {t['outcome']} | {t['seconds']:.1f} | {cell(rec)} |")
    bad = [(n, t) for n, t in data["tests"].items() if t["outcome"] not in ("passed", "skipped")]
    if bad:
        lines += ["", "## Failures"]
        for nodeid, t in bad:
            lines += ["", f"**{nodeid}** {t['outcome']}:", "```", t["error"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry run (small shapes)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    p.add_argument("--card", default=None, help="the card's name (default: --out's stem)")
    p.add_argument("--only", default=",".join(FILES), help=f"comma-separated test files to run, of {','.join(FILES)}")
    a = p.parse_args(ours)
    only = [name.strip() for name in a.only.split(",") if name.strip()]
    if not only or set(only) - set(FILES):
        p.error(f"--only {a.only!r}: choose from {', '.join(FILES)}")
    # the checkout's opd in this process and in every subprocess a test starts (torchrun's ranks), installed or not
    sys.path.insert(0, str(ROOT / "src"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    if a.device == "cpu":
        os.environ["OPD_GPU_DRY_RUN"] = "1"
    import pytest

    from opd.lab.experiments.core import machine_info
    from opd.runs.provenance import source_commit

    a.out = a.out.resolve()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    files = [str(ROOT / "tests" / "gpu" / f"test_{name}.py") for name in FILES if name in only]
    args = ["-m", "gpu", "-p", "no:cacheprovider", "-q", "-rfEs", *files, *extra]
    meta = {
        "card": a.card or a.out.stem,
        "tool": "benchmarks/gpu_check.py",
        "commit": source_commit(),
        "machine": machine_info(),
        "device": a.device,
        "dry_run": a.device == "cpu",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "pytest_args": ["-m", "gpu", *extra],
        "files": only,
    }
    card = Card(a.out, meta)
    card.write()
    code = int(pytest.main(args, plugins=[card]))
    card.write()
    print(f"gpu_check: pytest exited {code}; wrote {a.out} and {a.out.with_suffix('.md')}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
