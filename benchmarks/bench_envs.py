"""Measure the agentic environments: generation, reset and step time, expert length, text size,
and how often a random policy wins; and what opd's caches of the ALFWorld engine's parsing save.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_envs.py --games 12 --random 20
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_envs.py --caches 40

``--caches N`` plays N level-1 ALFWorld games twice each (seeded random commands, 10 turns; the
second pass is what a training run sees: games it has played before), first with textworld as it
ships, then with :mod:`opd.envs._pddl_cache`, checks that both gave the same observations,
rewards and admissible commands, prints the table and writes ``benchmarks/results/engine_caches.json``.

Games are generated into a fresh temporary folder, so generation time is measured too. "chars"
is everything a model reads and writes in an expert episode (system prompt, observations,
actions); divide by about 4 for tokens. The random policy picks uniformly among the admissible
commands each turn, for the level's default turn budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from opd.envs import get_env
from opd.lab.experiments.core import machine_info, source_commit


def expert_episode(env, game):
    t = time.perf_counter()
    session = env.open(game)  # generates the game on first use
    opened = time.perf_counter() - t
    t = time.perf_counter()
    first = session.reset()
    reset = time.perf_counter() - t
    actions = session.expert_actions()
    chars = len(env.system_prompt) + len(first)
    t = time.perf_counter()
    for action in actions:
        result = session.step(action)
        chars += len(action) + len(result.observation)
    step = (time.perf_counter() - t) / len(actions)
    session.close()
    return {"open": opened, "reset": reset, "step": step, "len": len(actions), "chars": chars, "won": result.won}


def random_wins(env, games, episodes, seed=0):
    rng = random.Random(seed)
    wins = 0
    for i in range(episodes):
        session = env.open(games[i % len(games)])
        session.reset()
        for _ in range(env.max_turns):
            result = session.step(rng.choice(session.admissible_commands()))
            if result.done:
                break
        wins += result.won
        session.close()
    return wins


def report(name, level, rows, wins, episodes):
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    lens = [r["len"] for r in rows]
    print(
        f"{name} L{level}: {len(rows)} games, generate+open {med('open'):.2f} s, reset {med('reset') * 1000:.0f} ms,"
        f" step {med('step') * 1000:.0f} ms, expert {min(lens)}-{max(lens)} (mean {statistics.mean(lens):.1f}),"
        f" chars/episode {statistics.mean(r['chars'] for r in rows):.0f}, expert wins {sum(r['won'] for r in rows)}/{len(rows)},"
        f" random wins {wins}/{episodes}"
    )


def play_twice(env, games, seed=0):
    """Every game played twice, 10 turns of seeded random commands (a rejected one 30% of the
    time): the transcripts and the wall time of each pass."""
    rng, out, times = random.Random(seed), [], []
    for _ in range(2):
        t = time.perf_counter()
        for game in games:
            session = env.open(game)
            trace = [session.reset()]
            for _ in range(10):
                admissible = session.admissible_commands()
                r = session.step(rng.choice(admissible) if rng.random() < 0.7 else "take nothing from nowhere")
                trace.append((r.observation, r.reward, r.done, admissible))
                if r.done:
                    break
            session.close()
            out.append(trace)
        times.append(time.perf_counter() - t)
    return out, times


def compare_caches(n_games, out_json):
    from opd.envs import _pddl_cache

    with tempfile.TemporaryDirectory() as tmp:
        env = get_env("alfworld", level=1, num_train=n_games, games_dir=tmp, generated=True)
        games = env.games("train")
        for game in games:
            env.open(game).close()  # generated (and the caches warmed) outside the timings
        _pddl_cache.uninstall()
        plain, plain_s = play_twice(env, games)
        _pddl_cache.install()
        _pddl_cache.clear()
        cached, cached_s = play_twice(env, games)
    same = plain == cached
    print(f"ALFWorld level 1, {n_games} games played twice (10 turns of random commands), one process:")
    print("| engine | first pass s | second pass s |")
    print("|---|---:|---:|")
    print(f"| textworld as shipped | {plain_s[0]:.1f} | {plain_s[1]:.1f} |")
    print(f"| with opd's caches | {cached_s[0]:.1f} | {cached_s[1]:.1f} |")
    print(f"| ratio | {plain_s[0] / cached_s[0]:.2f}x | {plain_s[1] / cached_s[1]:.2f}x |")
    print(f"identical observations, rewards and admissible commands: {same}")
    result = {
        "games": n_games,
        "plain_s": plain_s,
        "cached_s": cached_s,
        "identical": same,
        "commit": source_commit(),
        "machine": {**machine_info(), "load1_end": os.getloadavg()[0]},
    }
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", type=int, default=0, help="compare the engine caches on N games (only that)")
    parser.add_argument("--json", default="benchmarks/results/engine_caches.json")
    parser.add_argument("--games", type=int, default=12)
    parser.add_argument("--random", type=int, default=20, help="random-policy episodes per level")
    parser.add_argument("--alfworld-levels", default="1,2,3")
    parser.add_argument("--textworld-levels", default="1,2")
    parser.add_argument("--textworld-games", type=int, default=4)
    args = parser.parse_args()
    if args.caches:
        return compare_caches(args.caches, args.json)
    for name, levels, n in (
        ("alfworld", args.alfworld_levels, args.games),
        ("textworld", args.textworld_levels, args.textworld_games),
    ):
        for level in (int(x) for x in levels.split(",") if x):
            with tempfile.TemporaryDirectory() as tmp:
                kw = {"generated": True} if name == "alfworld" else {}
                env = get_env(name, level=level, num_train=n, games_dir=tmp, **kw)
                games = env.games("train")
                rows = [expert_episode(env, g) for g in games]
                episodes = args.random if name == "alfworld" else min(args.random, len(games) * 5)
                report(name, level, rows, random_wins(env, games, episodes), episodes)


if __name__ == "__main__":
    main()
