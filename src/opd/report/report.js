// opd run report: draws the chart specs of opd/report/charts.py as inline SVG, and the token
// inspector. No libraries and no network: everything it needs is in the page's JSON block.
"use strict";
const DATA = JSON.parse(document.getElementById("opd-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const PALETTE = DATA.palette;
const tooltip = document.getElementById("tooltip");

function el(tag, attrs, parent, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}
const color = (i) => PALETTE[i % PALETTE.length];
const fmt = (v) => (v === undefined || v === null || Number.isNaN(v)) ? "–"
  : (Math.abs(v) >= 1000 || (Math.abs(v) < 0.001 && v !== 0)) ? v.toExponential(2) : (+v.toPrecision(4)).toString();

function niceTicks(lo, hi, n) {
  const span = hi - lo, raw = span / Math.max(n, 1), mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || 10 * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toFixed(10));
  return out;
}

function showTip(evt, lines) {
  tooltip.textContent = "";
  lines.forEach((l) => el("div", {}, tooltip, l));
  tooltip.style.display = "block";
  tooltip.style.left = Math.min(evt.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8) + "px";
  tooltip.style.top = evt.clientY + 14 + "px";
}
const hideTip = () => { tooltip.style.display = "none"; };

// A frame with axes and ticks; returns scales from data to SVG coordinates.
function frame(svg, W, H, m, xd, yd, spec) {
  const sx = (x) => m.l + (x - xd[0]) / (xd[1] - xd[0] || 1) * (W - m.l - m.r);
  const sy = (y) => H - m.b - (y - yd[0]) / (yd[1] - yd[0] || 1) * (H - m.t - m.b);
  for (const t of niceTicks(yd[0], yd[1], 5)) {
    el("svg:line", {class: "gridline", x1: m.l, x2: W - m.r, y1: sy(t), y2: sy(t)}, svg);
    el("svg:text", {x: m.l - 5, y: sy(t) + 4, "text-anchor": "end"}, svg, fmt(t));
  }
  for (const t of niceTicks(xd[0], xd[1], 6)) el("svg:text", {x: sx(t), y: H - m.b + 15, "text-anchor": "middle"}, svg, fmt(t));
  el("svg:line", {class: "axis", x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b}, svg);
  el("svg:line", {class: "axis", x1: m.l, x2: m.l, y1: m.t, y2: H - m.b}, svg);
  el("svg:text", {x: (m.l + W - m.r) / 2, y: H - 3, "text-anchor": "middle"}, svg, spec.xlabel);
  el("svg:text", {x: 11, y: (m.t + H - m.b) / 2, "text-anchor": "middle", transform: `rotate(-90 11 ${(m.t + H - m.b) / 2})`}, svg, spec.ylabel);
  return {sx, sy};
}

function extent(values, pad) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (lo === hi) { lo -= Math.abs(lo) * 0.1 || 1; hi += Math.abs(hi) * 0.1 || 1; }
  return [lo - (hi - lo) * pad, hi + (hi - lo) * pad];
}

// A share's axis from 0 (spec.ymin), and 0..1 where it was 0 throughout (spec.ymax; charts.share_axis).
function shareAxis(yd, spec) {
  const lo = spec.ymin === undefined ? yd[0] : spec.ymin;
  const hi = spec.ymax === undefined ? yd[1] : Math.max(yd[1], spec.ymax);
  return [lo, hi > lo ? hi : lo + 1];
}

// The eval chart when every run was evaluated once: a bar per series with its value (avg@k hatched).
function barChart(card, spec) {
  const W = 460, H = 250, m = {l: 54, r: 14, t: 16, b: 34};
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`}, card);
  const hatch = el("svg:pattern", {id: "hatch-" + spec.id, width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)"}, el("svg:defs", {}, svg));
  el("svg:line", {x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#fff", "stroke-width": 3}, hatch);
  const top = Math.max(1, ...spec.bars.map((b) => b.value), ...spec.hlines.map((h) => h.y));
  const sy = (y) => H - m.b - y / top * (H - m.t - m.b), slot = (W - m.l - m.r) / spec.bars.length;
  for (const t of niceTicks(0, top, 5)) {
    el("svg:line", {class: "gridline", x1: m.l, x2: W - m.r, y1: sy(t), y2: sy(t)}, svg);
    el("svg:text", {x: m.l - 5, y: sy(t) + 4, "text-anchor": "end"}, svg, fmt(t));
  }
  el("svg:line", {class: "axis", x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b}, svg);
  el("svg:line", {class: "axis", x1: m.l, x2: m.l, y1: m.t, y2: H - m.b}, svg);
  el("svg:text", {x: (m.l + W - m.r) / 2, y: H - 3, "text-anchor": "middle"}, svg, spec.xlabel);
  el("svg:text", {x: 11, y: (m.t + H - m.b) / 2, "text-anchor": "middle", transform: `rotate(-90 11 ${(m.t + H - m.b) / 2})`}, svg, spec.ylabel);
  spec.bars.forEach((b, i) => {
    const x = m.l + i * slot + slot * 0.2, w = slot * 0.6, y = sy(b.value);
    const bar = el("svg:rect", {class: "bar", x, y, width: w, height: H - m.b - y, fill: color(b.color), "data-run": b.run}, svg);
    if (b.dashed) el("svg:rect", {x, y, width: w, height: H - m.b - y, fill: `url(#hatch-${spec.id})`, "pointer-events": "none"}, svg);
    el("svg:text", {class: "value", x: x + w / 2, y: y - 4, "text-anchor": "middle"}, svg, fmt(b.value));
    bar.addEventListener("mousemove", (evt) => showTip(evt, [`${b.label}: ${fmt(b.value)}`, `step ${b.step}`]));
    bar.addEventListener("mouseleave", hideTip);
  });
  for (const h of spec.hlines) {
    el("svg:line", {x1: m.l, x2: W - m.r, y1: sy(h.y), y2: sy(h.y), stroke: "#888", "stroke-dasharray": "2 3"}, svg);
    el("svg:text", {x: W - m.r - 2, y: sy(h.y) - 3, "text-anchor": "end"}, svg, h.label);
  }
  const legend = el("div", {class: "legend"}, card);
  for (const b of spec.bars) {
    const chip = el("span", {class: "chip"}, legend);
    el("span", {class: "swatch" + (b.dashed ? " dashed" : ""), style: `background:${color(b.color)};border-color:${color(b.color)}`}, chip);
    el("span", {}, chip, `${b.label}: ${fmt(b.value)}`);
  }
}

function lineChart(card, spec) {
  const W = 460, H = 250, m = {l: 54, r: 14, t: 10, b: 34};
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`}, card);
  const xs = spec.series.flatMap((s) => s.x), ys = spec.series.flatMap((s) => s.y.concat(s.smooth || []));
  const {sx, sy} = frame(svg, W, H, m, extent(xs, 0), shareAxis(extent(ys.concat(spec.hlines.map((h) => h.y)), 0.05), spec), spec);
  if (spec.none) el("svg:text", {class: "none", x: (m.l + W - m.r) / 2, y: (m.t + H - m.b) / 2, "text-anchor": "middle"}, svg, spec.none);
  for (const h of spec.hlines) {
    el("svg:line", {x1: m.l, x2: W - m.r, y1: sy(h.y), y2: sy(h.y), stroke: "#888", "stroke-dasharray": "2 3"}, svg);
    el("svg:text", {x: W - m.r - 2, y: sy(h.y) - 3, "text-anchor": "end"}, svg, h.label);
  }
  const path = (x, y) => x.map((v, i) => (i ? "L" : "M") + sx(v).toFixed(1) + " " + sy(y[i]).toFixed(1)).join("");
  for (const s of spec.series) {
    const dash = s.dashed ? {"stroke-dasharray": "5 3"} : {};
    const base = {fill: "none", stroke: color(s.color), "data-run": s.run, ...dash};
    el("svg:path", {...base, class: "series", d: path(s.x, s.y), "stroke-width": s.smooth ? 1 : 1.8, "stroke-opacity": s.smooth ? 0.3 : 1}, svg);
    if (s.smooth) el("svg:path", {...base, class: "smooth", d: path(s.x, s.smooth), "stroke-width": 2}, svg);
    if (s.x.length < 20) s.x.forEach((x, i) => el("svg:circle", {cx: sx(x), cy: sy(s.y[i]), r: 2.6, fill: color(s.color)}, svg));
    if (s.marks && s.marks.length) {
      const at = new Map(s.x.map((x, i) => [x, s.y[i]]));
      const d = s.marks.map((x) => { const X = sx(x), Y = sy(at.get(x)); return `M${X - 2.5} ${Y - 2.5}l5 5M${X - 2.5} ${Y + 2.5}l5 -5`; }).join("");
      el("svg:path", {class: "marks", d, stroke: color(s.color), "stroke-width": 1.1, "stroke-opacity": 0.8}, svg);
    }
  }
  const cursor = el("svg:line", {y1: m.t, y2: H - m.b, stroke: "#1d2330", "stroke-opacity": 0.3, visibility: "hidden"}, svg);
  const hit = el("svg:rect", {x: m.l, y: m.t, width: W - m.l - m.r, height: H - m.t - m.b, fill: "transparent"}, svg);
  const allX = [...new Set(xs)].sort((a, b) => a - b);
  hit.addEventListener("mousemove", (evt) => {
    const box = svg.getBoundingClientRect(), px = (evt.clientX - box.left) * W / box.width;
    const x = allX.reduce((best, v) => Math.abs(sx(v) - px) < Math.abs(sx(best) - px) ? v : best, allX[0]);
    cursor.setAttribute("x1", sx(x)); cursor.setAttribute("x2", sx(x)); cursor.setAttribute("visibility", "visible");
    const lines = [`step ${x}`];
    for (const s of spec.series) { const i = s.x.indexOf(x); if (i >= 0) lines.push(`${s.label}: ${fmt(s.y[i])}` + (s.marks && s.marks.includes(x) ? " (clipped)" : "")); }
    showTip(evt, lines);
  });
  hit.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); hideTip(); });
  const legend = el("div", {class: "legend"}, card);
  for (const s of spec.series) {
    const chip = el("span", {class: "chip"}, legend);
    el("span", {class: "swatch" + (s.dashed ? " dashed" : ""), style: `background:${color(s.color)};border-color:${color(s.color)}`}, chip);
    el("span", {}, chip, s.label);
  }
  if (spec.series.some((s) => s.marks && s.marks.length)) el("span", {}, legend, "× clipped step");
}

// Diverging colour: red below zero, blue above, white at zero; t in [-1, 1].
function diverging(t) {
  t = Math.max(-1, Math.min(1, t));
  const end = t < 0 ? [178, 24, 43] : [33, 102, 172], a = Math.abs(t);
  return `rgb(${end.map((c) => Math.round(255 + (c - 255) * a)).join(",")})`;
}

function colorbar(svg, x, y, h, bound, sign, label) {
  const n = 24;  // top to bottom: +bound to -bound, in the chart's colours
  for (let i = 0; i < n; i++) el("svg:rect", {x, y: y + i * h / n, width: 10, height: h / n + 0.5, fill: diverging(sign * (1 - 2 * (i + 0.5) / n))}, svg);
  el("svg:text", {x: x + 13, y: y + 8}, svg, "+" + fmt(bound));
  el("svg:text", {x: x + 13, y: y + h / 2 + 4}, svg, "0");
  el("svg:text", {x: x + 13, y: y + h}, svg, "−" + fmt(bound));
  el("svg:text", {x: x + 48, y: y + h / 2, "text-anchor": "middle", transform: `rotate(90 ${x + 48} ${y + h / 2})`}, svg, label);
}

function heatmap(card, spec) {
  const W = 460, H = 230, m = {l: 54, r: 74, t: 10, b: 34};
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`}, card);
  const n = spec.x.length, B = spec.buckets, cw = (W - m.l - m.r) / n, ch = (H - m.t - m.b) / B;
  spec.z.forEach((col, i) => col.forEach((v, b) => {
    el("svg:rect", {class: "cell", x: m.l + i * cw, y: m.t + b * ch, width: cw + 0.4, height: ch + 0.4, fill: diverging(spec.sign * v / spec.bound),
      "data-step": spec.x[i], "data-bucket": b, "data-value": v}, svg);
  }));
  svg.addEventListener("mousemove", (evt) => {
    const c = evt.target;
    if (c.classList && c.classList.contains("cell")) showTip(evt, [`step ${c.dataset.step}, bucket ${c.dataset.bucket}`, `${spec.zlabel}: ${fmt(+c.dataset.value)}`]);
    else hideTip();
  });
  svg.addEventListener("mouseleave", hideTip);
  for (let b = 0; b < B; b++) el("svg:text", {x: m.l - 5, y: m.t + (b + 0.5) * ch + 4, "text-anchor": "end"}, svg, b);
  const sx = (x) => m.l + (spec.x.indexOf(x) + 0.5) * cw;
  const ticks = n <= 8 ? spec.x : niceTicks(spec.x[0], spec.x[n - 1], 6).filter((t) => spec.x.includes(t));
  for (const t of ticks) el("svg:text", {x: sx(t), y: H - m.b + 15, "text-anchor": "middle"}, svg, t);
  el("svg:text", {x: (m.l + W - m.r) / 2, y: H - 3, "text-anchor": "middle"}, svg, spec.xlabel);
  el("svg:text", {x: 11, y: (m.t + H - m.b) / 2, "text-anchor": "middle", transform: `rotate(-90 11 ${(m.t + H - m.b) / 2})`}, svg, "depth bucket");
  colorbar(svg, W - m.r + 10, m.t, H - m.t - m.b, spec.bound, spec.sign, spec.zlabel.split(" (")[0]);
}

function scatter(card, spec) {
  const W = 400, H = 380, m = {l: 50, r: 14, t: 10, b: 38};
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, style: "max-width:430px"}, card);
  const {sx, sy} = frame(svg, W, H, m, [0, 1.02], [0, 1.02], spec);
  el("svg:line", {x1: sx(0), y1: sy(0), x2: sx(1), y2: sy(1), stroke: "#444", "stroke-dasharray": "5 4"}, svg);
  el("svg:text", {x: sx(0.5) + 8, y: sy(0.5) + 4}, svg, "y = x");
  for (const [pts, fill, cls] of [[spec.negative, "var(--neg)", "neg"], [spec.positive, "var(--pos)", "pos"]]) {
    for (const [p, q] of pts) el("svg:circle", {class: "pt " + cls, cx: sx(p).toFixed(1), cy: sy(q).toFixed(1), r: 2.2, fill, "fill-opacity": 0.45}, svg);
  }
  const legend = el("div", {class: "legend"}, card);
  el("span", {class: "key"}, legend).innerHTML = `<i style="background:var(--neg)"></i>negative reward, student &gt; teacher: ${spec.negative.length}`;
  el("span", {class: "key"}, legend).innerHTML = `<i style="background:var(--pos)"></i>positive reward, teacher &gt; student: ${spec.positive.length}`;
  if (spec.stride > 1) el("span", {}, legend, `(one in ${spec.stride} of ${spec.tokens} logged tokens shown)`);
}

function renderCharts() {
  for (const spec of DATA.charts) {
    const grid = document.getElementById("grid-" + spec.group);
    const card = el("div", {class: "card chart", "data-id": spec.id, "data-kind": spec.kind}, grid);
    el("h3", {}, card, spec.title);
    el("div", {class: "note"}, card, spec.note || (spec.kind === "heatmap" ? `${spec.zlabel}; hover a cell for its value.` : ""));
    ({line: lineChart, bar: barChart, heatmap, scatter})[spec.kind](card, spec);
  }
  for (const g of document.querySelectorAll(".grid")) {
    if (!g.children.length) el("div", {class: "card"}, g, "").appendChild(el("div", {class: "empty"}, null, "No data logged for these charts."));
  }
}

function renderSummary() {
  const table = document.getElementById("summary");
  const cols = [["run", "run"], ["objective", "objective"], ["settings", "key settings"], ["steps", "steps"], ["wall", "wall time"],
    ["teacher", "teacher acc"], ["before", "student before"], ["after", "student after"], ["avg_at_k", "avg@k"], ["gap_recovery", "gap recovery"]];
  const head = el("tr", {}, el("thead", {}, table));
  cols.forEach(([, label], j) => el("th", {class: j >= 3 ? "num" : ""}, head, label));
  const body = el("tbody", {}, table);
  DATA.summary.forEach((row, i) => {
    const tr = el("tr", {}, body);
    cols.forEach(([key], j) => {
      const td = el("td", {class: j >= 3 ? "num" : ""}, tr);  // steps onwards: figures, right-aligned
      if (key === "run") el("span", {class: "swatch", style: `background:${color(i)};margin-right:6px;height:10px;width:10px`}, td);
      el("span", {}, td, row[key]);
    });
  });
}

// ---------------------------------------------------------------- token inspector
const INS = {run: 0, step: null, rollout: 0, by: "reward", pos: null};
const $ = (id) => document.getElementById(id);

function tokenText(ins, id) {
  const s = ins.vocab[String(id)];
  return s === undefined ? `#${id}` : s === "" ? "�" : s;
}
// In a bar label a space or newline would be invisible: show them as ␣ and ⏎.
const barLabel = (ins, id) => tokenText(ins, id).replace(/ /g, "␣").replace(/\n/g, "⏎");
// An environment token (an episode's observation or chat-template text between turns) has no score.
const isEnv = (r, i) => !!(r.env && r.env[i]);
function tokenValue(r, i, by) { return isEnv(r, i) ? null : by === "reward" ? r.t[i] - r.s[i] : r.loss[i]; }

function currentRollout() {
  const ins = DATA.runs[INS.run].inspector;
  return ins && ins.steps.length ? ins.rollouts[String(INS.step)][INS.rollout] : null;
}

function fillSelect(sel, options, value) {
  sel.textContent = "";
  options.forEach(([v, label]) => el("option", {value: v}, sel, label));
  sel.value = String(value);
}

function setRun(i) {
  INS.run = i;
  const ins = DATA.runs[i].inspector;
  const steps = ins ? ins.steps : [];
  const prev = INS.step === null ? steps[steps.length - 1] : INS.step;
  INS.step = steps.length ? steps.reduce((b, s) => Math.abs(s - prev) < Math.abs(b - prev) ? s : b, steps[0]) : null;
  fillSelect($("inspector-step"), steps.map((s) => [s, `step ${s}`]), INS.step);
  setStep(INS.step);
}

function setStep(step) {
  INS.step = step;
  const ins = DATA.runs[INS.run].inspector;
  const rs = step === null ? [] : ins.rollouts[String(step)];
  const mark = (r) => r.correct === null ? "·" : r.correct ? "✓" : "✗";  // null: no reference answer
  fillSelect($("inspector-rollout"), rs.map((r, j) => [j, `#${j + 1} ${mark(r)} ${r.prompt.slice(0, 40)}`]), 0);
  setRollout(0);
}

function setRollout(j) {
  INS.rollout = j;
  const r = currentRollout();
  INS.pos = null;
  if (r) {  // open on the token the signal cares most about: the largest |value| the loss sees
    let best = -1;
    r.ids.forEach((_, i) => { const v = Math.abs(tokenValue(r, i, INS.by)); if (r.mask[i] && v > best) { best = v; INS.pos = i; } });
    if (INS.pos === null) INS.pos = r.ids.findIndex((_, i) => !isEnv(r, i));
    if (INS.pos < 0) INS.pos = null;
  }
  renderTokens();
}

const ENDS = {max_turns: "turn limit reached", budget: "token budget spent", error: "environment error"};
function episodeOutcome(o) {
  const turns = `${o.turns} turn${o.turns === 1 ? "" : "s"}`;
  return o.won ? `✓ won in ${turns}` : o.end === "lost" ? `✗ lost after ${turns}`
    : `✗ not won: ${ENDS[o.end] || o.end || "?"} after ${turns}`;
}

function renderHeader(r) {
  const p = $("prompt");
  p.textContent = "";
  el("b", {}, p, r.outcome ? "Goal: " : "Prompt: ");
  el("span", {}, p, r.prompt);
  el("span", {class: "outcome", style: "margin-left:12px;color:var(--muted)"}, p,
    r.outcome ? episodeOutcome(r.outcome) : r.correct === null ? "no reference answer: not graded"
      : `answer ${r.answer} · ${r.correct ? "✓ correct" : "✗ wrong"}`);
}

// Turn boundaries of an episode: a label where each turn starts, its reward where it ends.
function turnMarks(r) {
  const starts = new Map(), ends = new Map();
  (r.turns || []).forEach((t, j) => { starts.set(t.start, j); ends.set(t.end, t); });
  return {starts, ends};
}

function turnReward(box, t) {
  const span = el("span", {class: "turn-reward"}, box, `reward ${fmt(t.reward)}`);
  span.title = `action “${t.action}” · reward ${fmt(t.reward)}` + (t.observation ? ` · the game: ${t.observation}` : "");
}

function renderToken(box, ins, r, i, vals, bound) {
  let text = tokenText(ins, r.ids[i]);
  const nl = text.includes("\n");
  if (nl) text = text.replace(/\n/g, "⏎");
  if (isEnv(r, i)) {  // context, not the model's: no colour, no position to click, no statistics
    if (!isEnv(r, i - 1)) el("span", {class: "env-label"}, box, "environment — not scored");
    el("span", {class: "tok env", title: "environment — not scored"}, box, text);
  } else {
    // Red always means "bad for the student": a negative reward, or a high loss.
    const t = (INS.by === "reward" ? 1 : -1) * vals[i] / bound;  // white text where the colour hides black
    const span = el("span", {class: "tok" + (r.mask[i] ? "" : " masked") + (i === INS.pos ? " selected" : ""), "data-pos": i,
      style: `background:${diverging(t)}` + (Math.abs(t) > 0.55 ? ";color:#fff" : "")}, box, text);
    span.title = `${INS.by === "reward" ? "log q − log p" : "token loss"} = ${fmt(vals[i])}` + (r.mask[i] ? "" : " (masked from the loss)");
  }
  if (nl) el("br", {}, box);
}

function renderTokens() {
  const box = $("tokens"), ins = DATA.runs[INS.run].inspector, r = currentRollout();
  box.textContent = "";
  $("prompt").textContent = "";
  if (!r) { box.textContent = "No rollouts logged for this run (rollouts.jsonl missing or empty)."; renderDist(); return; }
  renderHeader(r);
  const vals = r.ids.map((_, i) => tokenValue(r, i, INS.by));
  const bound = Math.max(1e-6, ...vals.filter((_, i) => r.mask[i] && !isEnv(r, i)).map(Math.abs));
  const {starts, ends} = turnMarks(r);
  r.ids.forEach((_, i) => {
    if (ends.has(i)) turnReward(box, ends.get(i));
    if (starts.has(i)) el("span", {class: "turn-mark"}, box, `turn ${starts.get(i) + 1}`);
    renderToken(box, ins, r, i, vals, bound);
  });
  if (ends.has(r.ids.length)) turnReward(box, ends.get(r.ids.length));
  $("scale").innerHTML = "";
  const sc = $("scale");
  el("span", {}, sc, INS.by === "reward" ? `reward log q − log p: −${fmt(bound)}` : `loss: +${fmt(bound)}`);
  el("span", {class: "bar", style: `background:linear-gradient(90deg, ${diverging(-1)}, #fff, ${diverging(1)})`}, sc);
  el("span", {}, sc, INS.by === "reward" ? `+${fmt(bound)}` : `−${fmt(bound)}`);
  el("span", {class: "tok masked", style: "margin-left:14px;padding:0 6px"}, sc, "masked");
  el("span", {}, sc, "special token left out of the loss");
  if (r.env) {
    el("span", {class: "tok env", style: "margin-left:14px;padding:0 6px"}, sc, "environment");
    el("span", {}, sc, "the game's reply and the chat template between turns: context, not scored or trained");
  }
  renderDist();
}

function barRow(parent, cls, label, t, s, scale) {
  const row = el("div", {class: "bar-row " + cls}, parent);
  el("span", {class: "lbl", title: label}, row, label);
  const pair = el("span", {class: "pair"}, row);
  el("span", {class: "b t", style: `width:${(100 * t / scale).toFixed(1)}%`}, pair);
  el("span", {class: "b s", style: `width:${(100 * s / scale).toFixed(1)}%`}, pair);
  const val = el("span", {class: "val"}, row);
  el("div", {}, val, fmt(t)); el("div", {}, val, fmt(s));
  return row;
}

function renderDist() {
  const head = $("dist-head"), bars = $("bars"), r = currentRollout(), ins = DATA.runs[INS.run].inspector;
  head.textContent = ""; bars.textContent = "";
  if (!r || INS.pos === null || isEnv(r, INS.pos)) { head.textContent = "Click a token to see the teacher's top-K there."; return; }
  for (const span of document.querySelectorAll(".tok.selected")) span.classList.remove("selected");
  const sel = document.querySelector(`.tok[data-pos="${INS.pos}"]`);
  if (sel) sel.classList.add("selected");
  const i = INS.pos, id = r.ids[i], sc = ins.prob_scale;
  const tp = r.tp[i].map((v) => v / sc), sp = r.sp[i].map((v) => v / sc);
  const pS = Math.exp(r.s[i]), pT = Math.exp(r.t[i]), inTop = r.topk[i].indexOf(id);
  const title = el("div", {id: "dist-title", "data-pos": i}, head);
  el("span", {class: "big"}, title, `position ${i}: sampled “${tokenText(ins, id)}”`);
  el("div", {}, head, `student p = ${fmt(pS)}, teacher q = ${fmt(pT)}, reward log q − log p = ${fmt(r.t[i] - r.s[i])}, token loss = ${fmt(r.loss[i])}` +
    (r.mask[i] ? "" : " · masked from the loss"));
  const sum = (a) => a.reduce((x, y) => x + y, 0);
  el("div", {}, head, `top-${tp.length} mass: teacher ${fmt(sum(tp))}, student ${fmt(sum(sp))}` +
    (inTop < 0 ? " · the sampled token is outside the teacher's top-K" : ` · sampled token is the teacher's #${inTop + 1}`));
  const keys = el("div", {style: "margin-top:4px"}, head);
  keys.innerHTML = '<span class="key"><i style="background:var(--teacher)"></i>teacher q</span><span class="key"><i style="background:var(--student)"></i>student p (same tokens)</span>' +
    '<span class="key"><i style="background:#f3effa;border:1px solid #d9cdef"></i>support: teacher top-K</span><span class="key"><i style="background:#fff6d6;border:1px solid #1d2330"></i>sampled</span>';
  const scale = Math.max(1e-9, ...tp, ...sp, inTop < 0 ? Math.max(pS, pT) : 0);
  r.topk[i].forEach((tid, j) => {
    const row = barRow(bars, "support" + (tid === id ? " sampled" : ""), (tid === id ? "★" : "") + barLabel(ins, tid), tp[j], sp[j], scale);
    row.dataset.kind = "support";
  });
  if (inTop < 0) barRow(bars, "sampled outside", "★" + barLabel(ins, id), pT, pS, scale).dataset.kind = "sampled";
}

function renderInspector() {
  fillSelect($("inspector-run"), DATA.runs.map((r, i) => [i, r.name]), 0);
  $("inspector-run").addEventListener("change", (e) => setRun(+e.target.value));
  $("inspector-step").addEventListener("change", (e) => setStep(+e.target.value));
  $("inspector-rollout").addEventListener("change", (e) => setRollout(+e.target.value));
  $("inspector-color").addEventListener("change", (e) => { INS.by = e.target.value; renderTokens(); });
  $("tokens").addEventListener("click", (e) => {
    const pos = e.target.dataset && e.target.dataset.pos;
    if (pos !== undefined) { INS.pos = +pos; renderDist(); }
  });
  setRun(0);
}

// ---------------------------------------------------------------- evaluation samples

function sampleView() {
  const views = DATA.runs[+$("samples-run").value].samples || [];
  return views[+$("samples-task").value] || {};
}

function renderSampleRows() {
  const sam = sampleView(), how = $("samples-filter").value;
  const flipped = new Set(how === "since" ? sam.flipped_since || [] : how === "first" ? sam.flipped_vs_first || [] : []);
  const keep = (r) => how === "all" || (how === "wrong" && !r.correct) || (how === "truncated" && r.truncated)
    || ((how === "since" || how === "first") && flipped.has(r.item));
  const rows = (sam.records || []).filter(keep), table = $("samples");
  table.textContent = "";
  const head = el("tr", {}, el("thead", {}, table));
  ["#", "sample", "verdict", "tokens", "answer", "reference", "prompt and response"].forEach((h) => el("th", {}, head, h));
  const body = el("tbody", {}, table);
  for (const r of rows) {
    const tr = el("tr", {class: r.correct ? "right" : "wrong"}, body);
    el("td", {class: "num"}, tr, String(r.item));
    el("td", {class: "num"}, tr, r.sample < 0 ? "greedy" : String(r.sample));
    el("td", {}, tr, (r.correct ? "right" : "wrong") + (r.truncated ? ", truncated" : ""));
    el("td", {class: "num"}, tr, String(r.tokens));
    el("td", {}, tr, r.answer == null ? "(none)" : String(r.answer));
    el("td", {}, tr, r.reference == null ? "" : String(r.reference));
    const det = el("details", {}, el("td", {}, tr));
    el("summary", {}, det, String(r.prompt).slice(0, 80));
    el("pre", {class: "response"}, det, `${r.prompt}\n\n${r.response}`);
  }
  const step = sam.steps && sam.steps.length ? sam.steps[sam.steps.length - 1] : null;
  const where = (sam.task ? ` of task ${sam.task}` : "") + (step == null ? "" : ` at step ${step}`);
  $("samples-count").textContent = sam.records ? `${rows.length} of ${sam.total} responses${where}` : "no evaluation records";
}

function setSampleRun() {
  // a multi-task run's tasks each have their records: the task select lists them (hidden for a run's own)
  const views = DATA.runs[+$("samples-run").value].samples || [];
  fillSelect($("samples-task"), views.map((v, i) => [i, v.task || "(the run)"]), 0);
  $("samples-task-label").hidden = !views.some((v) => v.task);
  renderSampleRows();
}

function renderSamples() {
  fillSelect($("samples-run"), DATA.runs.map((r, i) => [i, r.name]), 0);
  $("samples-run").addEventListener("change", setSampleRun);
  $("samples-task").addEventListener("change", renderSampleRows);
  $("samples-filter").addEventListener("change", renderSampleRows);
  setSampleRun();
}

renderSummary();
renderCharts();
renderInspector();
renderSamples();
document.body.dataset.rendered = "yes";
