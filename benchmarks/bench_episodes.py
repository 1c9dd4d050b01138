#!/usr/bin/env python
"""Multi-turn rollouts: opd's episode engine against re-encoding the history every turn, and the
games in this process against 1, 2 and N worker processes, side by side in one run.

Every row plays the same episodes: the agentic demo's student (``opd/assets/agentic``) on its
ALFWorld level-1 training games (``batch`` of those after the 100 the student cloned, seeds
0..batch-1), with the demo's
limits (prompt 180, episode 320 and turn 16 tokens, the level's 12 turns) and sampling (T 1,
top-p 0.9); the environment is included in every time. Rows:

  kv              opd's episode loop (:class:`opd.rollout.episodes.EpisodeRollout`) on its HF engine's
                  sessions (:class:`opd.rollout.sampling.HFSession`): the game's reply is appended
                  to the KV cache, the games step in this process
  re-encode       the same episodes, but every turn re-runs the model over the whole history
                  (prompt, every action and reply so far) and samples the next action from that
                  fresh cache: what a trainer that calls ``generate`` on the transcript each turn
                  does. Same uniforms, same nucleus: the same transcripts up to float rounding.
  kv, W workers   opd's engine with the games in W worker processes (``--env-workers W``)

How it is timed: rows are interleaved within each round (so load from other work on the machine
falls on all of them), medians over ``--rounds``; a round 0 of every row is played first and not
timed (engines import, games load and opd's ALFWorld caches warm in every process, as they are
in a training run after its first steps; a worker's start is reported apart). The model gets
``--threads`` torch threads (default 1: OpenMP threads collapse when the cores are also running
games). "game s" is the time the kv row spent inside the game's calls (open, reset, step,
admissible commands), measured in this process; "model s" the rest of its wall time. "trainer
CPU s" is the CPU time of the trainer's process (all its threads, not the workers'): what the
games leave on its critical path, whatever the load.

From those per-step costs the script projects the games' share of one OPD step of 128 episodes
on a 16-core GPU host (in this process vs 16 workers), written down as a projection, not a
measurement. The machine may be shared: ``os.getloadavg()`` is recorded before and after each
row and the JSON says so.

Run (from the repository root):
  PYTHONPATH=src python benchmarks/bench_episodes.py --quick    # batch 8, 1 round, workers 1,2 (~2 min)
  PYTHONPATH=src python benchmarks/bench_episodes.py            # batch 16 and 64, 3 rounds, workers 1,2,4
Writes benchmarks/results/episodes.json and .md (episodes_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from opd.envs.workers import EnvWorkers
from opd.lab.demos.agentic import ASSETS, ENV, LEVEL, LIMITS, STUDENT_GAMES, TOP_P, env_args
from opd.lab.experiments.core import machine_info, source_commit
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.episodes import EpisodeRollout
from opd.rollout.game_set import make_env
from opd.rollout.sampling import HFRollout, HFSession, left_pad, prefill

RESULTS = Path(__file__).parent / "results"
PROJECT_EPISODES, PROJECT_CORES = 128, 16
FIRST_GAME = STUDENT_GAMES  # the training games after those the student cloned: what OPD's steps mostly play


class ReencodeSession(HFSession):
    """The comparison mode: after each turn, the model re-reads every playing episode's whole
    history (its prompt, turns and replies) instead of appending the game's reply to its cache."""

    def __init__(self, engine, prompts, seeds, budget, sampling):
        super().__init__(engine, prompts, seeds, budget, sampling)
        self.history = [list(p) for p in prompts]

    def turn(self, caps, written) -> None:
        def kept(done):
            for i, sample in done:
                self.history[i] += sample.ids
            written(done)

        super().turn(caps, kept)

    def extend(self, tokens) -> None:
        for i, ids in tokens.items():
            self.history[i] += ids
        state, dev = self.state, self.state.rows_R.device
        ids, attn = left_pad([self.history[i] for i in state.rows_R.tolist()], self.pad_id)
        out, positions = prefill(self.model, ids.to(dev), attn.to(dev))
        state.cache, state.attn_RL = out.cache, attn.to(dev)
        state.next_pos_R, state.logits_RV = positions[:, -1] + 1, out.logits[:, -1]


class ReencodeEngine(HFRollout):
    """opd's HF engine with :class:`ReencodeSession` episodes."""

    def episodes(self, prompts, seeds, *, budget, sampling):
        return ReencodeSession(self, prompts, seeds, budget, sampling)


class Timed:
    """An environment whose sessions add the time spent in their calls to ``seconds``."""

    def __init__(self, env):
        self.env, self.seconds, self.steps, self.opens = env, 0.0, 0, 0
        self.name, self.system_prompt, self.max_turns = env.name, env.system_prompt, env.max_turns

    def games(self, split):
        return self.env.games(split)

    def open(self, game):
        t = time.perf_counter()
        try:
            return _TimedSession(self.env.open(game), self)
        finally:
            self.seconds += time.perf_counter() - t
            self.opens += 1


class _TimedSession:
    def __init__(self, session, clock: Timed):
        self.session, self.clock = session, clock

    def __getattr__(self, name):
        call = getattr(self.session, name)

        def timed(*args):
            t = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.clock.seconds += time.perf_counter() - t
                self.clock.steps += name == "step"

        return timed


def play(engine, env, games, record: bool = False) -> tuple[float, float, list]:
    """Wall time, this process's CPU time (all its threads, not the workers') and the records."""
    t, cpu = time.perf_counter(), time.process_time()
    eps = engine.play(env, games, list(range(len(games))), top_p=TOP_P, **LIMITS)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    return wall, cpu, [dataclasses.asdict(r) for r in eps.records] if record else eps.records


def run_batch(model, tok, env, batch: int, workers: list[int], rounds: int) -> dict:
    """Every row at one batch size: warm-up round 0, then ``rounds`` interleaved timed rounds."""
    games = env.games("train")[FIRST_GAME : FIRST_GAME + batch]
    for g in games:  # generated (first time on this machine) and their engines' caches warm, outside the timings
        env.open(g).close()
    kv = EpisodeRollout(model, tok)
    reencode = EpisodeRollout(ReencodeEngine(model, tok.eos_token_id, tok.pad_token_id), tok)
    timed = Timed(env)
    pools, started = {}, {}
    for w in workers:
        t = time.perf_counter()
        pools[w] = EnvWorkers(env, w, step_timeout=120)
        started[w] = time.perf_counter() - t
    rows = {"kv": (kv, timed), "re-encode": (reencode, env)}
    rows.update({f"kv, {w} worker{'s' if w > 1 else ''}": (kv, pools[w]) for w in workers})
    walls, cpus = {name: [] for name in rows}, {name: [] for name in rows}
    loads, game_s, steps = {name: [] for name in rows}, [], 0
    reference = play(kv, env, games, record=True)[2]
    same = {}
    for r in range(rounds + 1):
        for name, (engine, where) in rows.items():
            before = os.getloadavg()
            timed.seconds, timed.steps = 0.0, 0
            wall, cpu, records = play(engine, where, games, record=True)
            if r == 0:
                same[name] = sum(a == b for a, b in zip(records, reference, strict=True))
                continue
            walls[name].append(wall)
            cpus[name].append(cpu)
            loads[name].append([before, os.getloadavg()])
            if name == "kv":
                game_s.append(timed.seconds)
                steps = timed.steps
    for pool in pools.values():
        pool.close()
    turns = [len(r["actions"]) for r in reference]
    out = {
        "batch": batch,
        "turns_mean": statistics.mean(turns),
        "turns_max": max(turns),
        "won": sum(r["won"] for r in reference),
        "game_steps": steps,
        "game_s": statistics.median(game_s),
        "worker_start_s": started,
        "rows": {},
    }
    base = statistics.median(walls["kv"])
    for name in rows:
        wall = statistics.median(walls[name])
        out["rows"][name] = {
            "wall_s": wall,
            "walls": walls[name],
            "episodes_per_s": batch / wall,
            "trainer_cpu_s": statistics.median(cpus[name]),
            "vs_kv_in_process": base / wall,
            "same_transcripts": f"{same[name]}/{batch}",
            "loadavg_before_after": loads[name],
        }
    return out


def projection(result: dict) -> dict:
    """The games' share of one OPD step of 128 episodes on a 16-core host, from the kv row's
    per-call costs here (a game call costs the same on a core there; the GPU generates)."""
    big = max(result["batches"], key=lambda b: b["batch"])
    per_episode = big["game_s"] / big["batch"]  # open, reset and every step of one episode
    model_per_episode = (big["rows"]["kv"]["wall_s"] - big["game_s"]) / big["batch"]
    games = per_episode * PROJECT_EPISODES
    return {
        "episodes": PROJECT_EPISODES,
        "cores": PROJECT_CORES,
        "game_s_per_episode": per_episode,
        "model_s_per_episode_here": model_per_episode,
        "games_in_process_s": games,
        "games_16_workers_s": games / PROJECT_CORES,
        "note": (
            "projection, not a measurement: the games' CPU time of 128 episodes measured here at batch "
            f"{big['batch']}, in one process vs spread evenly over 16 workers (one per core; the trainer's process "
            "drives the GPU and needs little CPU). Generation, scoring and the update on the GPU come on top and are "
            "not measured here."
        ),
    }


def markdown(result: dict) -> str:
    lines = [
        "| batch | row | s per batch (median) | episodes/s | vs kv in-process | trainer CPU s | same transcripts | load1 before-after |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for b in result["batches"]:
        for name, row in b["rows"].items():
            load = row["loadavg_before_after"]
            span = f"{min(x[0][0] for x in load):.1f}-{max(x[1][0] for x in load):.1f}"
            lines.append(
                f"| {b['batch']} | {name} | {row['wall_s']:.2f} | {row['episodes_per_s']:.2f} | "
                f"{row['vs_kv_in_process']:.2f}x | {row['trainer_cpu_s']:.2f} | {row['same_transcripts']} | {span} |"
            )
    lines += [
        "",
        "| batch | turns (mean / max) | won | game steps | game s (kv row) | model s (kv row) | worker start s |",
    ]
    lines += ["|---:|---|---:|---:|---:|---:|---|"]
    for b in result["batches"]:
        starts = ", ".join(f"{w}: {s:.1f}" for w, s in b["worker_start_s"].items())
        model = b["rows"]["kv"]["wall_s"] - b["game_s"]
        lines.append(
            f"| {b['batch']} | {b['turns_mean']:.1f} / {b['turns_max']} | {b['won']}/{b['batch']} | {b['game_steps']} | "
            f"{b['game_s']:.2f} | {model:.2f} | {starts} |"
        )
    p = result["projection"]
    lines += [
        "",
        f"Projection ({p['episodes']} episodes, {p['cores']}-core GPU host): the games take "
        f"{p['game_s_per_episode'] * 1000:.0f} ms of CPU per episode here, so {p['games_in_process_s']:.1f} s per OPD "
        f"step in the trainer's process and about {p['games_16_workers_s']:.1f} s with 16 workers. {p['note']}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, 1 round, workers 1,2")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the model's process")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.batches, args.workers, args.rounds = "8", "1,2", 1
    torch.set_num_threads(args.threads)
    model = load_model(ASSETS / "student", "student").eval()
    tok = load_tokenizer(ASSETS / "student")
    env = make_env(ENV, LEVEL, env_args(False))
    load0 = os.getloadavg()
    batches = [
        run_batch(model, tok, env, int(b), [int(w) for w in args.workers.split(",")], args.rounds)
        for b in args.batches.split(",")
    ]
    result = {
        "what": "multi-turn rollouts of the agentic demo's student on ALFWorld level 1, environment included",
        "limits": LIMITS,
        "top_p": TOP_P,
        "threads": args.threads,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_start_end": [load0, os.getloadavg()],
        "shared_machine": "the machine may run other work: compare rows of one batch, and read load1",
        "commit": source_commit(),
        "machine": machine_info(),
        "batches": batches,
    }
    result["projection"] = projection(result)
    out = args.out or RESULTS / ("episodes_quick.json" if args.quick else "episodes.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    out.with_suffix(".md").write_text(
        "# Multi-turn rollout benchmark\n\n"
        f"`python benchmarks/bench_episodes.py{' --quick' if args.quick else ''}`: {os.cpu_count()} CPU cores, "
        f"{args.threads} torch thread(s), {args.rounds} round(s), medians. The machine was shared: 1-minute load "
        f"average {result['loadavg_start_end'][0][0]:.1f} at the start, {result['loadavg_start_end'][1][0]:.1f} at "
        "the end (2 = both cores busy).\n\n" + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
