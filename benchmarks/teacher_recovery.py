"""Is a game teacher a guide in the states a student's mistakes reach? (the agentic demo's models)

Two measurements per teacher, printed as a table and written as JSON:

* the student plays games (temperature 1, the demo's top-p; held-out games by default, as a
  teacher trained on the student's states (``--dagger-from``) has seen its training games) and,
  before each of its turns after the first, the teacher's greedy next command is checked against
  the game's admissible commands and against the search expert's command from that state
  (``expert_next()``): after a command the game rejected ("Nothing happens.") and after one it
  accepted;
* on held-out games the expert plays, with one rejected command (``opd.training.cloning.mistake_command``)
  injected before its middle command; the teacher's greedy command is compared with the expert's,
  right after the mistake and at every other turn.

    python benchmarks/teacher_recovery.py --teachers A B --student S --out benchmarks/results/teacher_recovery.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from opd.envs import normal_command
from opd.lab.demos.agentic import ASSETS, LIMITS, TOP_P, environment
from opd.lab.experiments.core import machine_info, source_commit
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.episodes import ChatFormat, EpisodeRollout
from opd.training.cloning import mistake_command


def greedy_command(model, tok, ids: list[int]) -> str:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=LIMITS["max_action_tokens"],
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    return tok.decode(out[0, x.shape[1] :], skip_special_tokens=True).strip()


def on_student_states(env, tok, student, teachers: dict, n_games: int, split: str) -> dict:
    """Per teacher: [valid, the expert's, asked] after the student's rejected and accepted commands."""
    games = env.games(split)[:n_games]
    eps = EpisodeRollout(student, tok).play(env, games, list(range(n_games)), top_p=TOP_P, **LIMITS)
    b = eps.batch
    counts = {t: {"after_rejected": [0, 0, 0], "after_accepted": [0, 0, 0]} for t in teachers}
    for n, (game, rec) in enumerate(zip(games, eps.records, strict=True)):
        prompt = b.input_ids_NL[n, : b.prompt_len][b.attention_mask_NL[n, : b.prompt_len].bool()].tolist()
        session = env.open(game)
        session.reset()
        for j, action in enumerate(rec.actions[: len(rec.observations) - 1]):  # the turns the game answered
            if j > 0:
                kind = "after_rejected" if rec.observations[j] == "Nothing happens." else "after_accepted"
                valid = {normal_command(c) for c in session.admissible_commands()}
                expert = normal_command(session.expert_next() or "")
                ids = prompt + b.response_ids_NT[n, : rec.spans[j][0]].tolist()
                for name, model in teachers.items():
                    command = normal_command(greedy_command(model, tok, ids))
                    counts[name][kind][0] += command in valid
                    counts[name][kind][1] += command == expert
                    counts[name][kind][2] += 1
            session.step(action)
        session.close()
    rejected = sum(r.invalid_actions or 0 for r in eps.records)
    played = sum(len(r.actions) for r in eps.records)
    return {"teachers": counts, "student_rejected_share": rejected / max(1, played)}


def after_one_mistake(env, tok, teachers: dict, n_games: int) -> dict:
    """Per teacher: [agrees with the expert, turns] right after one injected mistake and elsewhere."""
    fmt, eos = ChatFormat(tok, tok.eos_token_id), tok.eos_token_id
    counts = {t: {"after_mistake": [0, 0], "elsewhere": [0, 0]} for t in teachers}
    for game in env.games("test")[:n_games]:
        session = env.open(game)
        ids = fmt.encode(fmt.prompt(env.system_prompt, session.reset()))
        actions, rng = session.expert_actions(), random.Random(game.id)
        for i, action in enumerate(actions):
            kind = "after_mistake" if i == len(actions) // 2 else "elsewhere"
            wrong = mistake_command(session.admissible_commands(), action, rng) if kind == "after_mistake" else None
            if wrong is not None:
                reply = session.step(wrong).observation
                ids += fmt.encode(wrong) + [eos] + fmt.encode(fmt.reply(reply))
            for name, model in teachers.items():
                counts[name][kind][0] += normal_command(greedy_command(model, tok, ids)) == normal_command(action)
                counts[name][kind][1] += 1
            result = session.step(action)
            if result.done:
                break
            ids += fmt.encode(action) + [eos] + fmt.encode(fmt.reply(result.observation))
        session.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teachers", nargs="+", default=[str(ASSETS / "teacher")])
    ap.add_argument("--student", default=str(ASSETS / "student"))
    ap.add_argument("--games", type=int, default=48, help="Games the student plays.")
    ap.add_argument("--split", default="test", choices=("train", "test"), help="Which games the student plays.")
    ap.add_argument("--test-games", type=int, default=40, help="Held-out games the expert plays with a mistake.")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/teacher_recovery.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    env, tok = environment(), load_tokenizer(ASSETS / "tokenizer")
    teachers = {t: load_model(t, "teacher").eval() for t in args.teachers}
    student_model = load_model(args.student, "student").eval()
    student = on_student_states(env, tok, student_model, teachers, args.games, args.split)
    expert = after_one_mistake(env, tok, teachers, args.test_games)
    pct = lambda hit, n: f"{hit}/{n} ({100 * hit / max(1, n):.0f}%)"
    print(f"student {args.student}: {100 * student['student_rejected_share']:.0f}% of its commands rejected")
    print(
        "| teacher | after the student's rejected command: valid | the expert's | after an accepted one: valid "
        "| the expert's | expert's after one injected mistake | elsewhere |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t in teachers:
        s, e = student["teachers"][t], expert[t]
        rej, acc = s["after_rejected"], s["after_accepted"]
        row = [pct(rej[0], rej[2]), pct(rej[1], rej[2]), pct(acc[0], acc[2]), pct(acc[1], acc[2])]
        row += [pct(*e["after_mistake"]), pct(*e["elsewhere"])]
        print(f"| {t} | " + " | ".join(row) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {**vars(args), "out": str(args.out)},
                "commit": source_commit(),
                "machine": machine_info(),
                "student": student,
                "expert": expert,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
