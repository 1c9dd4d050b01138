"""Issue 45 probes: the multi-task demo's two-task run with its game recipe changed, the game
evaluated on generated validation games (never the 50 test games the demo reports).

Each probe is the demo's run (:func:`opd.lab.demos.multitask.opd_config`: its models, seeds, batches,
math lr) with the knobs a recipe is chosen by: the objective, the game steps' lr, the math:game
step shares, the number of steps and the math batch. Greedy game success on the validation games
(``test_split=valid``) every ``--eval-every`` steps; math greedy on its usual test prompts (math is
not what a probe chooses). One run per call; its run directory is an ordinary opd run.

    python benchmarks/probe_multitask_game.py --out runs/probes/lsm-tail-g2e-4 --tail --game-lr 2e-4

``--summary DIR...`` instead prints one line per run directory (validation success at each
evaluation, math accuracy, the game's format-token rate at the end, wall time); ``--export DIR...``
prints their records as JSON (what docs/results/probes/multitask-game.json holds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from opd.lab.demos import multitask as M
from opd.training.loop import train

NUM_VALID = 50


def probe_config(a: argparse.Namespace):
    change = {"objective": a.objective, "tail": a.tail}
    cfg = M.opd_config(M.ASSETS, Path(a.out), a.steps, False, a.seed, game_lr=a.game_lr, **change)
    tasks = []
    for t in cfg.multitask.tasks:
        t = dict(t)
        if t["name"] == M.MATH:
            t.update(share=a.math_share, batch_size=a.math_batch, eval_samples=0)
        else:
            t.update(env_args=[*t["env_args"], "test_split=valid", f"num_valid={NUM_VALID}"], eval_samples=0)
        tasks.append(t)
    return cfg.replace(tasks=tasks, eval_every=a.eval_every, ckpt_every=a.steps)


def record(run: Path) -> dict:
    """What a probe's run directory measured: its arguments, greedy validation success and math
    accuracy at each evaluation (by step), and per game step the sampled success and format-token rate."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    probe = json.loads((run / "probe.json").read_text()) if (run / "probe.json").is_file() else {}

    def series(key: str) -> list:
        return [round(r[key], 4) for r in records if key in r]

    return {
        "args": {k: v for k, v in probe.get("args", {}).items() if k not in ("out", "summary", "export")},
        "wall_s": probe.get("wall_s"),
        "valid_greedy_success": {r["step"]: r[k] for r in records if (k := f"eval/{M.GAME}/success_rate") in r},
        "math_test_greedy": {r["step"]: round(r[k], 4) for r in records if (k := f"eval/{M.MATH}/accuracy") in r},
        "game_sampled_success": series(f"{M.GAME}/rollout/accuracy"),
        "game_format_token_rate": series(f"{M.GAME}/rollout/format_token_rate"),
    }


def summary(run: Path) -> str:
    r = record(run)
    games = " ".join(f"{s}:{100 * v:.0f}%" for s, v in r["valid_greedy_success"].items())
    maths = list(r["math_test_greedy"].values())
    late = r["game_format_token_rate"][-8:]
    math = f"{100 * maths[-1]:.1f}%" if maths else "-"
    wall = r["wall_s"] or float("nan")
    return f"{run.name:32s} valid games {games:30s} math {math:7s} format(end) {100 * sum(late) / max(len(late), 1):4.1f}%  wall {wall:.0f}s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--summary", nargs="*", default=None, help="run directories: one line each")
    p.add_argument("--export", nargs="*", default=None, help="run directories: their records as JSON, by name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--objective", default="lsm")
    p.add_argument("--tail", action="store_true")
    p.add_argument("--game-lr", type=float, default=M.GAME_LR)
    p.add_argument("--math-share", type=float, default=1)
    p.add_argument("--math-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--eval-every", type=int, default=80)
    a = p.parse_args()
    if a.export is not None:
        print(json.dumps({Path(run).name: record(Path(run)) for run in a.export}, indent=1))
        return
    if a.summary is not None:
        for run in a.summary:
            print(summary(Path(run)))
        return
    cfg = probe_config(a)
    t0 = time.time()
    train(cfg, show_progress=True)
    Path(a.out, "probe.json").write_text(json.dumps({"args": vars(a), "wall_s": round(time.time() - t0, 1)}) + "\n")


if __name__ == "__main__":
    main()
