"""The report page in a real browser: headless Chromium driven over the DevTools protocol.

Checks what a person would see: the page loads offline with no console errors and no network
requests, every chart draws its data, clicking a token opens its distribution with one bar per
teacher top-K token (plus the sampled token when it lies outside), and switching run, step or
rollout updates the inspector, and the evaluation samples' filters (wrong, truncated, flipped; a multi-task
run's tasks) show the rows they name. Needs Debian's ``chromium`` (``apt-get install chromium``; ``.ci/run``
installs it) or ``OPD_CHROMIUM=/path/to/chrome``; without one the tests are skipped, saying so.
The DevTools client is small: a websocket (``websockets``, in the dev extra) and a few commands.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time

import pytest
from report_runs import LOG_ROLLOUTS, eval_record, make_agentic_run, make_report_runs, records_run

from opd.report import write_report
from opd.report.inspector import display_token

CHROMIUM = os.environ.get("OPD_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium found: install Debian's chromium (apt-get install chromium) or set "
        "OPD_CHROMIUM=/path/to/chrome to run the report's browser tests",
    ),
    # one worker builds the module's runs and pages once (on both, each was built twice)
    pytest.mark.xdist_group("report-browser"),
]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-extensions",
    "--mute-audio",
    "--window-size=1400,1000",
    "--remote-debugging-port=0",
]


class Browser:
    """One headless Chromium and one page, driven with DevTools commands; records console errors and requests."""

    def __init__(self, profile_dir):
        ws_sync = pytest.importorskip("websockets.sync.client", reason="pip install websockets (in opd's dev extra)")
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile_dir}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            url = self._devtools_url(timeout=60)
            # __enter__ gives the plain connection on every websockets version (>= 17 warns on a bare connect()).
            self.ws = ws_sync.connect(url, max_size=None, proxy=None, open_timeout=30).__enter__()
            self.next_id, self.events = 0, []
            target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Network", "Page"):
                self.send(f"{domain}.enable", session=True)
        except BaseException:  # no Chromium left behind when the connection fails
            self.proc.kill()
            self.proc.wait()
            raise

    def _devtools_url(self, timeout: float) -> str:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stderr], daemon=True).start()
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if m := re.search(r"DevTools listening on (ws://\S+)", line):
                return m.group(1)
        self.proc.kill()
        raise RuntimeError(f"{CHROMIUM} did not start its DevTools server within {timeout} s")

    def send(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 60) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.time() + timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time())))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == method:
                    return self.events.pop(i)
            self.events.append(json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time()))))

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, session=True)
        self.wait_event("Page.loadEventFired")

    def js(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def drain(self) -> None:
        """Read events already sent (console messages after a click arrive asynchronously)."""
        self.js("1")

    def errors(self) -> list:
        bad = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                bad.append(p["exceptionDetails"])
            elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                bad.append(p)
            elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
                bad.append(p["entry"])
        return bad

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def page(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("report_browser")
    runs = make_report_runs(tiny_models, root)
    live = root / "live"  # a run still going, with a line cut short: its report must still render
    shutil.copytree(runs[1], live, ignore=shutil.ignore_patterns("final"))
    with open(live / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/lo')
    started = root / "started"  # only config.json so far: no metrics, no rollouts
    started.mkdir()
    shutil.copy(runs[0] / "config.json", started / "config.json")
    path = write_report([*runs, live, started], root / "report", show_progress=False)
    browser = Browser(root / "profile")
    browser.open(path.as_uri())
    yield browser, path, [*runs, live, started]
    browser.close()


def rollouts(run_dir):
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def test_page_loads_offline_without_errors(page):
    browser, path, _ = page
    assert browser.js("document.body.dataset.rendered") == "yes"
    browser.js("document.querySelector('.card.chart svg').dispatchEvent(new MouseEvent('mousemove', {bubbles: true}))")
    browser.drain()
    assert browser.errors() == []
    assert set(browser.requests()) == {path.as_uri()}
    notice = browser.js("document.getElementById('skipped').textContent")
    assert "live" in notice and "1 malformed line(s)" in notice and "run in progress" in notice
    assert "started: metrics.jsonl is missing" in notice.replace("\n", " ").replace("  ", " ")
    assert browser.js("document.querySelectorAll('#summary tbody tr').length") == 4


def test_every_chart_renders_its_data(page):
    browser, _, _ = page
    charts = browser.js("""Array.from(document.querySelectorAll('.card.chart')).map(c => {
        const box = c.querySelector('svg').getBoundingClientRect();
        return {id: c.dataset.id, kind: c.dataset.kind, w: box.width, h: box.height,
                paths: Array.from(c.querySelectorAll('path.series')).map(p => (p.getAttribute('d').match(/L/g) || []).length),
                cells: c.querySelectorAll('rect.cell').length, points: c.querySelectorAll('circle.pt').length,
                bars: c.querySelectorAll('rect.bar').length};
    })""")
    specs = {c["id"]: c for c in browser.js("DATA.charts")}
    assert [c["id"] for c in charts] == list(specs) and len(charts) == 15 + 3 * 2 + 3
    for c in charts:
        spec = specs[c["id"]]
        assert c["w"] > 200 and c["h"] > 150, c
        if c["kind"] == "line":  # one path per series, through every logged point
            assert c["paths"] == [len(s["x"]) - 1 for s in spec["series"]] and all(n >= 1 for n in c["paths"]), c
        elif c["kind"] == "bar":
            assert c["bars"] == len(spec["bars"]) > 0, c
        elif c["kind"] == "heatmap":
            assert c["cells"] == len(spec["x"]) * spec["buckets"] > 0, c
        else:
            assert c["points"] == len(spec["positive"]) + len(spec["negative"]) > 0, c


@pytest.fixture(scope="module")
def once_page(tmp_path_factory):
    """A run evaluated once, at its end, whose rollouts never repeat (written by hand: no training needed)."""
    root = tmp_path_factory.mktemp("report_once")
    run = root / "once"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"steps": 3, "objective": "lsm"}))
    records = [{"step": i, "train/loss": 1 - i / 10, "rollout/repetition_rate": 0.0} for i in range(3)]
    records.append({"step": 2, "eval/accuracy": 0.62, "eval/avg_at_k": 0.55})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    path = write_report([run], root / "report", show_progress=False)
    browser = Browser(root / "profile")
    browser.open(path.as_uri())
    yield browser
    browser.close()


def test_a_run_evaluated_once_shows_bars_and_a_share_never_seen_says_none(once_page):
    browser = once_page
    view = browser.js("""(() => {
        const card = (id) => document.querySelector(`.card.chart[data-id="${id}"]`);
        const ticks = (c) => Array.from(c.querySelectorAll('svg > text[text-anchor=end]')).map(t => +t.textContent);
        return {kind: card('eval-accuracy').dataset.kind,
                bars: card('eval-accuracy').querySelectorAll('rect.bar').length,
                values: Array.from(card('eval-accuracy').querySelectorAll('text.value')).map(t => t.textContent),
                none: Array.from(card('repetition').querySelectorAll('text.none')).map(t => t.textContent),
                ticks: ticks(card('repetition'))};
    })()""")
    assert view["kind"] == "bar" and view["bars"] == 2 and view["values"] == ["0.62", "0.55"]
    assert view["none"] == ["none: 0 at every logged step"]
    assert min(view["ticks"]) == 0 and max(view["ticks"]) == 1  # 0..1, not a flat 0 on -1..1
    browser.drain()
    assert browser.errors() == []


def inspector_state(browser):
    return browser.js("""({run: INS.run, step: INS.step, rollout: INS.rollout, pos: INS.pos,
        text: Array.from(document.querySelectorAll('#tokens .tok')).map(t => t.textContent),
        title: document.getElementById('dist-title') && +document.getElementById('dist-title').dataset.pos,
        support: document.querySelectorAll('#bars .bar-row[data-kind=support]').length,
        rows: document.querySelectorAll('#bars .bar-row').length,
        sampled: Array.from(document.querySelectorAll('#bars .bar-row.sampled .lbl')).map(l => l.textContent)})""")


def expected_rollout(run_dir, step, index):
    return [r for r in rollouts(run_dir) if r["step"] == step][index]


def shown(token: str) -> str:
    return display_token(token).replace("\n", "⏎")


def test_clicking_a_token_opens_its_distribution(page):
    browser, _, run_dirs = page
    state = inspector_state(browser)
    record = expected_rollout(run_dirs[state["run"]], state["step"], state["rollout"])
    assert state["text"] == [shown(t) for t in record["tokens"]]
    for pos in {0, len(record["tokens"]) - 1} - {state["pos"]}:
        browser.js(f"document.querySelector('#tokens .tok[data-pos=\"{pos}\"]').click()")
        after = inspector_state(browser)
        topk = record["teacher_topk_ids"][pos]
        outside = record["token_ids"][pos] not in topk
        assert after["pos"] == after["title"] == pos
        assert after["support"] == len(topk) == 8 and after["rows"] == len(topk) + outside
        label = shown(record["tokens"][pos]).replace(" ", "␣")
        assert after["sampled"] == ["★" + label]
        assert browser.js("document.querySelectorAll('#tokens .tok.selected').length") == 1
    browser.drain()
    assert browser.errors() == []


def select(browser, sel_id: str, value) -> None:
    browser.js(
        f"(() => {{ const s = document.getElementById('{sel_id}'); s.value = '{value}';"
        "s.dispatchEvent(new Event('change')); })()"
    )


def test_switching_run_step_and_rollout_updates_the_inspector(page):
    browser, _, run_dirs = page
    select(browser, "inspector-run", 0)
    first = inspector_state(browser)
    select(browser, "inspector-run", 1)
    state = inspector_state(browser)
    assert state["run"] == 1 and state["step"] == first["step"]
    record = expected_rollout(run_dirs[1], state["step"], 0)
    assert state["text"] == [shown(t) for t in record["tokens"]] and state["support"] == 8
    steps = browser.js("Array.from(document.getElementById('inspector-step').options).map(o => +o.value)")
    assert steps == sorted({r["step"] for r in rollouts(run_dirs[1])})
    select(browser, "inspector-run", 3)  # the run with nothing logged yet says so instead of failing
    assert browser.js("document.getElementById('tokens').textContent").startswith("No rollouts logged")
    select(browser, "inspector-run", 1)
    for step in steps:
        for index in range(LOG_ROLLOUTS):
            select(browser, "inspector-step", step)
            select(browser, "inspector-rollout", index)
            state = inspector_state(browser)
            record = expected_rollout(run_dirs[1], step, index)
            assert (state["step"], state["rollout"]) == (step, index)
            assert state["text"] == [shown(t) for t in record["tokens"]]
            assert state["title"] == state["pos"] is not None and state["support"] == len(record["teacher_topk_ids"][0])
    select(browser, "inspector-color", "loss")
    colours = browser.js("Array.from(document.querySelectorAll('#tokens .tok')).map(t => t.style.background)")
    assert len(colours) == len(record["tokens"]) and all(colours)
    browser.drain()
    assert browser.errors() == []


# ----------------------------------------------------------------------------- an agentic run


@pytest.fixture(scope="module")
def agent_page(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("report_browser_agentic")
    run_dir = make_agentic_run(tiny_models, root)
    path = write_report([run_dir], root / "report", show_progress=False)
    browser = Browser(root / "profile")
    browser.open(path.as_uri())
    yield browser, run_dir
    browser.close()


def test_agentic_page_shows_success_rate_charts(agent_page):
    browser, _ = agent_page
    assert browser.js("document.body.dataset.rendered") == "yes"
    titles = browser.js("""Object.fromEntries(Array.from(document.querySelectorAll('.card.chart')).map(c =>
        [c.dataset.id, [c.querySelector('h3').textContent, c.querySelectorAll('path.series').length]]))""")
    assert titles["eval-accuracy"] == ["Eval success rate", 2]  # greedy and avg@k
    assert titles["rollout-accuracy"] == ["Training success rate (rollouts)", 1]
    assert titles["turns"][1] == titles["invalid-actions"][1] == 1
    browser.drain()
    assert browser.errors() == []


def episode_view(browser):
    return browser.js("""(() => {
        const toks = Array.from(document.querySelectorAll('#tokens .tok'));
        const style = (t) => { const s = getComputedStyle(t); return [s.fontStyle, s.color, s.backgroundColor]; };
        return {
            env: toks.filter(t => t.classList.contains('env')).map(t => ({text: t.textContent, pos: t.hasAttribute('data-pos'),
                 title: t.title, style: style(t)})),
            model: toks.filter(t => !t.classList.contains('env')).map(t => ({text: t.textContent, pos: +t.dataset.pos,
                 style: style(t)})),
            labels: document.querySelectorAll('#tokens .env-label').length,
            marks: Array.from(document.querySelectorAll('#tokens .turn-mark')).map(m => m.textContent),
            rewards: Array.from(document.querySelectorAll('#tokens .turn-reward')).map(m => m.textContent),
            header: document.getElementById('prompt').textContent};
    })()""")


def test_agentic_inspector_shows_environment_tokens_apart(agent_page):
    browser, run_dir = agent_page
    step = browser.js("INS.step")
    records = [r for r in rollouts(run_dir) if r["step"] == step]
    index = max(range(len(records)), key=lambda j: records[j]["action"].count(0))
    record = records[index]
    assert record["action"].count(0) > 0, "no rollout of the shown step has environment tokens"
    select(browser, "inspector-rollout", index)
    view = episode_view(browser)
    flags = record["action"]
    assert [t["text"] for t in view["env"]] == [shown(t) for t, a in zip(record["tokens"], flags) if not a]
    assert [t["pos"] for t in view["model"]] == [i for i, a in enumerate(flags) if a]
    # the environment's tokens: labelled, unscored (no value, no position to click) and styled apart
    assert all(not t["pos"] and t["title"] == "environment — not scored" for t in view["env"])
    assert all(t["style"][0] == "italic" for t in view["env"]) and all(t["style"][0] == "normal" for t in view["model"])
    assert {tuple(t["style"][1:]) for t in view["env"]}.isdisjoint({tuple(t["style"][1:]) for t in view["model"]})
    assert view["labels"] == sum(1 for i, a in enumerate(flags) if not a and (i == 0 or flags[i - 1]))
    turns = record["turns"]
    assert view["marks"] == [f"turn {j + 1}" for j in range(len(turns))]
    assert len(view["rewards"]) == len(turns) and all(r.startswith("reward ") for r in view["rewards"])
    won = "won in" if record["won"] else "lost after" if record["end"] == "lost" else "not won"
    assert record["prompt"] in view["header"] and won in view["header"] and f"{len(turns)} turn" in view["header"]
    # clicking an environment token opens nothing; the selected token stays a model token
    before = inspector_state(browser)
    assert flags[before["pos"]] == 1 and before["support"] == 8
    browser.js("document.querySelector('#tokens .tok.env').click()")
    assert inspector_state(browser)["pos"] == before["pos"]
    browser.drain()
    assert browser.errors() == []


# ----------------------------------------------------------------------------- evaluation samples


@pytest.fixture(scope="module")
def samples_page(tmp_path_factory):
    """Records written by hand: run "a" evaluated twice, run "b" once, and a multi-task run "m" (two tasks)."""
    root = tmp_path_factory.mktemp("report_samples")
    r = eval_record
    a = records_run(root, "a", {4: [r(0, False), r(1, True), r(2, True)], 9: [r(0, True), r(1, True), r(2, False)]})
    b = records_run(root, "b", {9: [r(0, False), r(0, True, sample=0), r(1, True), r(2, False, truncated=True)]})
    m = records_run(
        root,
        "m",
        {},
        tasks={"game": {9: [r(0, True, truncated=True)]}, "math": {4: [r(0, False)], 9: [r(0, True), r(1, False)]}},
    )
    path = write_report([a, b, m], root / "report", show_progress=False)
    browser = Browser(root / "profile")
    browser.open(path.as_uri())
    yield browser
    browser.close()


def sample_rows(browser) -> dict:
    return browser.js("""({
        rows: Array.from(document.querySelectorAll('#samples tbody tr')).map(tr =>
            Array.from(tr.children).slice(0, 3).map(td => td.textContent).join('|')),
        count: document.getElementById('samples-count').textContent,
        tasks: Array.from(document.getElementById('samples-task').options).map(o => o.textContent),
        taskShown: !document.getElementById('samples-task-label').hidden})""")


def test_the_samples_filters_show_the_rows_they_name(samples_page):
    browser = samples_page
    views = {}
    for run in (0, 1):
        for how in ("all", "wrong", "truncated", "since", "first"):
            select(browser, "samples-run", run)
            select(browser, "samples-filter", how)
            views[run, how] = sample_rows(browser)
    a, b = ({how: views[run, how]["rows"] for r, how in views if r == run} for run in (0, 1))
    assert a["all"] == ["0|greedy|right", "1|greedy|right", "2|greedy|wrong"]
    assert a["wrong"] == ["2|greedy|wrong"] and a["truncated"] == []
    assert a["since"] == ["0|greedy|right", "2|greedy|wrong"]  # item 0 wrong -> right, item 2 right -> wrong
    assert a["first"] == []  # the first run is the reference
    assert views[0, "all"]["count"] == "3 of 3 responses at step 9" and not views[0, "all"]["taskShown"]
    assert b["wrong"] == ["0|greedy|wrong", "2|greedy|wrong, truncated"] and b["truncated"] == [
        "2|greedy|wrong, truncated"
    ]
    assert b["since"] == []  # evaluated once
    assert b["first"] == ["0|greedy|wrong", "0|0|right"]  # item 0 flipped against run a's last evaluation
    browser.drain()
    assert browser.errors() == []


def test_a_multi_task_runs_samples_are_chosen_by_task(samples_page):
    browser = samples_page
    select(browser, "samples-filter", "all")
    select(browser, "samples-run", 2)
    view = sample_rows(browser)
    assert view["taskShown"] and view["tasks"] == ["game", "math"]
    assert view["rows"] == ["0|greedy|right, truncated"] and view["count"] == "1 of 1 responses of task game at step 9"
    select(browser, "samples-task", 1)
    select(browser, "samples-filter", "since")
    view = sample_rows(browser)
    assert view["rows"] == ["0|greedy|right"] and view["count"] == "1 of 2 responses of task math at step 9"
    select(browser, "samples-filter", "truncated")
    assert sample_rows(browser)["rows"] == []
    select(browser, "samples-run", 0)  # back to a run of its own: the task choice is hidden again
    assert not sample_rows(browser)["taskShown"]
    browser.drain()
    assert browser.errors() == []
