"""The self-contained HTML page of the report: markup, inline CSS and JS, and the data as JSON.

Nothing is fetched when the page opens (no CDN, fonts or images): ``report.css`` and
``report.js`` (next to this file) are inlined, and the charts' specs, the summary rows and the
inspector's rollouts travel in one ``<script type="application/json">`` block the script reads.
"""

from __future__ import annotations

import html
import json
from datetime import UTC, datetime
from pathlib import Path

from opd.report.charts import grading_notes

HERE = Path(__file__).parent

SECTIONS = [
    (
        "training",
        "Training curves",
        "Runs overlaid on the same axes. Thin lines are the per-step values, thick lines "
        "their moving average; hover a chart to read the values at a step.",
    ),
    (
        "diagnostics",
        "Diagnostics of OPD",
        "The papers' diagnostics over steps (full-vocabulary ones at a sample of "
        "response positions): do the student's and the teacher's supports agree, and where does the sampled-token "
        "signal point?",
    ),
    (
        "depth",
        "Signal by depth",
        "Each response is cut into equal-width position buckets (0 = its first tokens); "
        "a column is one step. Red is negative, blue positive; drift with depth shows as colour moving down the rows.",
    ),
    (
        "scatter",
        "The failure mode: sampled tokens, student vs teacher",
        "Each dot is a logged sampled token. Below the "
        "y = x line the student likes its own token more than the teacher does, so its sampled-token reward "
        "log q − log p is negative; most tokens of sampled-token OPD land there.",
    ),
]


def _notices(runs) -> str:
    items = [f"<li><b>{html.escape(r.name)}</b>: {html.escape(note)}</li>" for r in runs for note in r.skipped]
    graded = [f"<li><b>{html.escape(name)}</b>: {html.escape(note)}</li>" for name, note in grading_notes(runs)]
    out = ""
    if graded:
        out += f'<div class="notice" id="grading"><b>Accuracy</b><ul>{"".join(graded)}</ul></div>'
    if items:
        out += f'<div class="notice" id="skipped"><b>Left out of this report</b><ul>{"".join(items)}</ul></div>'
    return out


def render_page(
    runs,
    charts: list[dict],
    summary: list[dict],
    inspectors: list[dict],
    palette: list[str],
    png_dir: str,
    samples: list[list[dict]] | None = None,
) -> str:
    """The page; ``samples``: each run's views of its evaluation records (:func:`opd.report.samples.samples_data`)."""
    samples = samples or [[] for _ in runs]
    data = {
        "palette": palette,
        "charts": charts,
        "summary": summary,
        "runs": [
            {"name": r.name, "path": str(r.path), "inspector": ins, "samples": sam}
            for r, ins, sam in zip(runs, inspectors, samples)
        ],
    }
    # "</" inside the JSON would end the script element early; JSON allows "<\/" for it.
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    chips = "".join(
        f'<span class="chip"><span class="swatch" style="background:{palette[i % len(palette)]}"></span>'
        f'{html.escape(r.name)} <span class="sub">({html.escape(str(r.path))})</span></span>'
        for i, r in enumerate(runs)
    )
    sections = "".join(
        f'<section id="sec-{gid}"><h2>{title}</h2><p class="lead">{lead}</p>'
        f'<div class="grid" id="grid-{gid}"></div></section>'
        for gid, title, lead in SECTIONS
    )
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>opd report: {html.escape(", ".join(r.name for r in runs))}</title>
<style>{(HERE / "report.css").read_text()}</style>
</head><body>
<header><h1>opd run report</h1>
<div class="sub">{len(runs)} run(s), written {when} by <code>opd report</code>; every chart is also a PNG in
<code>{html.escape(png_dir)}/</code>.</div><div class="chips">{chips}</div></header>
<main>
{_notices(runs)}
<section id="sec-summary"><h2>Summary</h2><p class="lead">Accuracy is greedy on the held-out prompts at the last
evaluation (for an agentic run: the success rate, games won); teacher and "before" come from the demo's <code>summary.json</code> when there is one. Gap recovery =
(after − before) / (teacher − before).</p><table class="summary" id="summary"></table></section>
{sections}
<section id="sec-inspector"><h2>Token inspector</h2>
<p class="lead">A logged rollout as text, each token coloured by its sampled-token reward log q − log p (or its
loss). Click a token: the bars compare, at that position, the teacher's top-K (purple) with the student's
probabilities on the same tokens (teal); the shaded rows are the support LSM matches on, ★ is the token the
student sampled, the one token sampled-token OPD learns from. In an episode of an agentic run the turns are
marked, each with the game's reward, and the environment's replies between them (grey italics) are context:
not scored, not trained.</p>
<div class="controls">
<label>run <select id="inspector-run"></select></label>
<label>step <select id="inspector-step"></select></label>
<label>rollout <select id="inspector-rollout"></select></label>
<label>colour by <select id="inspector-color"><option value="reward">reward (log q − log p)</option>
<option value="loss">token loss</option></select></label></div>
<div class="inspector">
<div class="card"><div class="prompt" id="prompt"></div><div class="tokens" id="tokens"></div><div class="scale" id="scale"></div></div>
<div class="card" id="dist"><div class="dist-head" id="dist-head"></div><div class="bars" id="bars"></div></div>
</div></section>
<section id="sec-samples"><h2>Evaluation samples</h2>
<p class="lead">What the model wrote at its last evaluation (<code>eval_samples/</code>; a multi-task run's, per task): each response, the answer read
from it, the reference and the verdict, so that a grader's mistake shows. Filter the wrong or truncated responses, or the
prompts whose verdict (greedy, else the first sample) flipped since the run's previous evaluation or against the first
run's last evaluation.</p>
<div class="controls">
<label>run <select id="samples-run"></select></label>
<label id="samples-task-label">task <select id="samples-task"></select></label>
<label>show <select id="samples-filter"><option value="all">all</option><option value="wrong">wrong</option>
<option value="truncated">truncated</option><option value="since">flipped since the previous evaluation</option>
<option value="first">flipped against the first run</option></select></label>
<span class="sub" id="samples-count"></span></div>
<div class="card"><table class="samples" id="samples"></table></div></section>
</main>
<footer>Made by opd from run directories only (config.json, metrics.jsonl, rollouts.jsonl, eval_samples/); opens offline.</footer>
<div class="tooltip" id="tooltip"></div>
<script type="application/json" id="opd-data">{blob}</script>
<script>{(HERE / "report.js").read_text()}</script>
</body></html>
"""
