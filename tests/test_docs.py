"""The README and docs/ pages: every relative link and image resolves, the README stays a README.

Links are checked as GitHub renders them: a relative path must name an existing file (or folder),
and a ``#anchor`` must name a heading of the target Markdown page, slugified as GitHub does
(lowercase, punctuation other than '-' and '_' dropped, spaces to '-', repeats suffixed -1, -2).
External http(s) links are not fetched. Code blocks and inline code are not read for links.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

# The lines .ci/run (the test command) and a newcomer (the main job) copy from the README, verbatim.
TEST_COMMAND = (
    "pip install torch==2.13.0 && pip install -e '.[dev]' && ruff check . && ruff format --check . "
    '&& lint-imports && mypy && python -m pytest -q -n 2 --dist loadgroup -m "not slow"'
)
SLOW_COMMAND = "opd vllm-setup && python -m pytest -q -n 2 --dist loadgroup -m slow"  # CI's second step
MAIN_JOB = "pip install torch==2.13.0 && pip install -e . && opd demo"

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def outside_fences(text: str) -> list[str]:
    """The lines outside fenced code blocks (``` or ~~~, closed by a fence at least as long)."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            out.append(line)
    return out


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code removed."""
    return [INLINE_CODE.sub("", line) for line in outside_fences(text)]


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading's text: links reduced to their text, then its slug rule."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for line in outside_fences(page.read_text(encoding="utf-8")):
        h = HEADING.match(line)
        if h:
            slug = slugify(h.group(2))
            out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
            seen[slug] += 1
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link or image of ``page``, one line each."""
    problems = []
    # Whole prose text, not line by line: a link's text may wrap onto the next line.
    for target in LINK.findall("\n".join(prose_lines(page.read_text(encoding="utf-8")))):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


def test_slugify_follows_github():
    assert slugify("Multi-turn episodes (agentic OPD)") == "multi-turn-episodes-agentic-opd"
    assert slugify("Experiments: the papers' claims at small scale") == "experiments-the-papers-claims-at-small-scale"
    assert slugify("The `opd.losses` API, in [brief](x.md)") == "the-opdlosses-api-in-brief"
    assert slugify("snake_case and--dashes") == "snake_case-and--dashes"


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Notes\n\n## Setup\n\n```bash\n# Setup (a comment, not a heading)\n```\n\n## Setup\n\n## Setup\n")
    assert anchors(page) == {"notes", "setup", "setup-1", "setup-2"}


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Here\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#here) [gone](nope.md) [bad\nanchor](a.md#there) `[code](nope.md)` [web](https://x.y/z)\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "b.md: nope.md: no file nope.md",
        "b.md: a.md#there: no heading #there in a.md",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_resolve(page):
    assert broken_links(page) == []


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


@pytest.mark.parametrize("command", [TEST_COMMAND, SLOW_COMMAND, MAIN_JOB], ids=["test-command", "slow", "main-job"])
def test_readme_commands_are_verbatim_in_a_bash_block(command):
    """.ci/run greps README.md for the test command's line and runs it, then the slow tests' line; the main job
    is copied by hand."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert command in lines, f"README.md lost the line {command!r}"
    i = lines.index(command)
    assert lines[i - 1] == "```bash" and lines[i + 1] == "```", f"{command!r} is not alone in a ```bash block"


# ----------------------------------------------------------------------------- quoted intervals

RESULTS_MD = ROOT / "docs" / "RESULTS.md"
# "[lo, hi]", and the mean just before it where there is one ("+3.3 [-16.7, 23.4]"; not "avg@2 [...]")
INTERVAL = re.compile(r"(?:(?<![\w@.])([+-]?\d+(?:\.\d+)?)%?\s+)?\[(-?\d+(?:\.\d+)?)%?, (-?\d+(?:\.\d+)?)%?\]")
# Intervals a page quotes that RESULTS.md does not print, each said to be so where it is quoted.
NOT_IN_RESULTS = {
    ("docs/cross-tokenizer.md", "[64.2, 69.4]"): "gold-bytelevel's earlier CPU run, before its run data",
    ("docs/cross-tokenizer.md", "[4.6, 16.1]"): "gold-bytelevel's earlier CPU run, before its run data",
    ("docs/experiments.md", "[4.6, 16.1]"): "the disclosure of that earlier CPU run",
    ("docs/experiments.md", "[2.4, 40.0]"): "the wording rule's example",
    ("docs/demos.md", "[-42.2, 12.2]"): "agentic's earlier run, whose commit was not recorded",
}


def quoted_intervals(page: Path) -> list[tuple[str, str, str]]:
    """Every "[lo, hi]" of a page's prose as (mean or "", lo, hi), inline code and code blocks left out
    (the prose's lines joined, so a quote may wrap)."""
    prose = " ".join(" ".join(prose_lines(page.read_text(encoding="utf-8"))).split())
    return [(m.lstrip("+"), lo, hi) for m, lo, hi in INTERVAL.findall(prose)]


def _flip(x: str) -> str:
    return x[1:] if x.startswith("-") else f"-{x}"


def test_intervals_the_docs_quote_are_the_ones_results_md_makes():
    """An interval in the README or docs/ is one docs/RESULTS.md prints (which `opd results` makes from
    the committed run data), with the mean quoted beside it, either way round ("B beats A by -m [-hi,
    -lo]"), or a listed earlier run."""
    in_results = quoted_intervals(RESULTS_MD)
    printed = {(m, lo, hi) for m, lo, hi in in_results if m}
    pairs = {(lo, hi) for _, lo, hi in in_results}
    stale = []
    for page in PAGES:
        if page == RESULTS_MD:
            continue
        name = str(page.relative_to(ROOT))
        for m, lo, hi in quoted_intervals(page):
            if m:
                known = (m, lo, hi) in printed or (_flip(m), _flip(hi), _flip(lo)) in printed
            else:
                known = (lo, hi) in pairs or (_flip(hi), _flip(lo)) in pairs
            if not known and (name, f"[{lo}, {hi}]") not in NOT_IN_RESULTS:
                stale.append(f"{name}: {m} [{lo}, {hi}]")
    assert stale == [], "intervals quoted that docs/RESULTS.md does not print (stale, or list them):\n" + "\n".join(
        stale
    )
    for name, interval in NOT_IN_RESULTS:
        assert interval in (ROOT / name).read_text(encoding="utf-8"), f"{name} no longer quotes {interval}: unlist it"


def test_the_claim_count_docs_experiments_gives_is_results_md_s():
    """docs/experiments.md's "How many claims" counts the rows of RESULTS.md's summary table by verdict,
    and those that survive its Benjamini-Hochberg correction or are true by construction."""
    summary = RESULTS_MD.read_text(encoding="utf-8").split("## Summary of verdicts", 1)[1].split("\n## ", 1)[0]
    verdicts = Counter(re.findall(r"\| \*\*(reproduced|not reproduced|inconclusive)\*\* \|", summary))
    text = " ".join((ROOT / "docs" / "experiments.md").read_text(encoding="utf-8").split())
    said = re.search(
        r"tests (\d+) claims \(the rows of its summary table: (\d+) reproduced, (\d+) not reproduced, (\d+) "
        r"inconclusive\).*?about (\d+) of the (\d+) verdicts could be chance",
        text,
    )
    assert said, "docs/experiments.md lost its 'How many claims' sentence"
    total, yes, no, undecided, chance, total_again = map(int, said.groups())
    assert (yes, no, undecided) == (verdicts["reproduced"], verdicts["not reproduced"], verdicts["inconclusive"])
    assert total == total_again == sum(verdicts.values()) and chance == round(total / 20)
    # ... and what survives the false-discovery-rate correction, and the claims true by construction
    fdr = re.search(
        r"Benjamini-Hochberg false-discovery-rate correction at q = 0.05 over all (\d+) claims.*?: (\d+) of the (\d+) "
        r"decided verdicts survive it\. The (\d+) that do not.*? (\d+) claims are true by construction",
        text,
    )
    assert fdr, "docs/experiments.md lost its false-discovery-rate sentences"
    family, survive, decided, not_surviving, by_construction = map(int, fdr.groups())
    after_bh = re.findall(r"\| (survives|does not survive) \(adjusted p [^)]*\) \|", summary)
    assert (family, decided) == (total, yes + no)
    assert (survive, not_surviving) == (after_bh.count("survives"), after_bh.count("does not survive"))
    assert survive + not_surviving == decided
    assert by_construction == len(re.findall(r"^\|[^\n]*\*true by construction\*", summary, re.MULTILINE))


# ----------------------------------------------------------------------------- the map of the code

ARCHITECTURE = ROOT / "docs" / "architecture.md"
CODE_SPAN = re.compile(r"`([^`]+)`")
ROOT_DIRS = ("src/", "benchmarks/", "tests/", "docs/", "examples/")


def files_table(page: Path) -> list[tuple[str, str]]:
    """The (path, what it is) rows of a page's "## Files" table."""
    text = page.read_text(encoding="utf-8").split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| path |")]
    return [tuple(c.strip() for c in re.split(r"(?<!\\)\|", row)[1:3]) for row in rows]  # type: ignore[misc]


def table_rows(page: Path, root: Path = ROOT) -> list[tuple[str, set[Path], set[Path], list[str]]]:
    """Each row of the Files table: its path cell, the files and folders it lists as its own, all those it
    names (its own and the ones its text refers to), and a line for each name that is not there, all resolved.

    A row's path cell names files or folders from the repository root (`src/opd/losses/`,
    `src/opd/teachers/client.py`), and may add bare names beside its first (`server.py`); the row's
    folder is the first one's (or its parent). A source file a row's text names (`lsm.py`,
    `teachers/crosstok.py`, `src/opd/losses/cross.py`) is read from that folder, the package root
    (src/opd) or the repository root. A row lists what its path cell names, and what its text names
    inside a folder its path cell names (a package's row: `src/opd/tasks/`'s `jsonl.py`); a file its text
    names elsewhere is a reference to another row's (`src/opd/crosstok/`'s `teachers/crosstok.py`)."""
    src = root / "src" / "opd"
    rows = []
    for path_cell, what in files_table(page):
        names = CODE_SPAN.findall(path_cell)
        own: set[Path] = set()
        named: set[Path] = set()
        missing: list[str] = []
        if not names:
            rows.append((path_cell, own, named, [f"a row without a path: {path_cell!r}"]))
            continue
        folder = root / names[0] if names[0].endswith("/") else (root / names[0]).parent
        text_names = [n for n in CODE_SPAN.findall(what) if re.fullmatch(r"[\w/]+\.(py|js|css)", n)]
        for i, name in enumerate([*names, *text_names]):
            candidates = [root / name] if name.startswith(ROOT_DIRS) else [folder / name, src / name]
            found = next((c for c in candidates if c.exists()), None)
            if found is None:
                missing.append(f"{path_cell}: names {name}, which is not at {candidates[0].relative_to(root)}")
                continue
            found = found.resolve()
            named.add(found)
            if i < len(names) or any(d.is_dir() and found.is_relative_to(d) for d in own):
                own.add(found)
        rows.append((path_cell, own, named, missing))
    return rows


def table_paths(page: Path, root: Path = ROOT) -> tuple[set[Path], list[str]]:
    """The files and folders the Files table names, resolved, and a line for each name that is not there."""
    rows = table_rows(page, root)
    return set().union(*(named for _, _, named, _ in rows)), [line for *_, missing in rows for line in missing]


def src_modules(root: Path) -> list[Path]:
    """The modules of src/opd: every .py file but a package's __init__.py."""
    files = (root / "src" / "opd").rglob("*.py")
    return [p.resolve() for p in files if p.name != "__init__.py" and "__pycache__" not in p.parts]


def unlisted_modules(page: Path, root: Path = ROOT) -> list[str]:
    """The modules of src/opd no row of the Files table lists as its own (a reference from another row's
    text does not describe it)."""
    listed = set().union(*(own for _, own, _, _ in table_rows(page, root)))
    return sorted(str(p.relative_to(root.resolve())) for p in src_modules(root) if p not in listed)


def modules_listed_twice(page: Path, root: Path = ROOT) -> list[str]:
    """The modules and folders of src/opd that more than one row of the Files table lists as its own."""
    rows: dict[Path, list[str]] = {}
    for path_cell, own, _, _ in table_rows(page, root):
        for p in own:
            rows.setdefault(p, []).append(path_cell)
    src = (root / "src" / "opd").resolve()
    return sorted(
        f"{p.relative_to(root.resolve())}: rows " + " and ".join(cells)
        for p, cells in rows.items()
        if len(cells) > 1 and p.is_relative_to(src)
    )


def test_the_architecture_table_names_only_paths_that_exist():
    _, missing = table_paths(ARCHITECTURE)
    assert missing == [], "docs/architecture.md's Files table names paths that are not there:\n" + "\n".join(missing)


def test_every_module_is_in_the_architecture_table():
    """Read from the tree as it is when the test runs: a module added or renamed without its row fails here."""
    unlisted = unlisted_modules(ARCHITECTURE)
    assert unlisted == [], (
        "modules docs/architecture.md's Files table does not name (add a row, or the file's name to its package's "
        "row):\n" + "\n".join(unlisted)
    )


def _fake_src(root, *names: str) -> None:
    """Empty files under ``root``/src/opd, as a package tree the table checks read."""
    for name in names:
        (root / "src" / "opd" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "src" / "opd" / name).write_text("")


def test_a_module_missing_from_the_table_or_a_stale_path_is_reported(tmp_path):
    _fake_src(tmp_path, "a/one.py", "a/two.py", "a/__init__.py", "b.py", "a/__pycache__/one.cpython-311.pyc")
    page = tmp_path / "architecture.md"
    page.write_text(
        "# A\n\n## Files\n\n| path | what it is |\n|---|---|\n"
        "| `src/opd/a/` | the a package: `one.py` (one), `gone.py` (renamed since) |\n"
        "| `src/opd/b.py`, `c.py` | b and c |\n\n## Next\n\n`src/opd/a/two.py` outside the table\n"
    )
    named, missing = table_paths(page, tmp_path)
    assert named == {(tmp_path / p).resolve() for p in ("src/opd/a", "src/opd/a/one.py", "src/opd/b.py")}
    assert missing == [
        "`src/opd/a/`: names gone.py, which is not at src/opd/a/gone.py",
        "`src/opd/b.py`, `c.py`: names c.py, which is not at src/opd/c.py",
    ]
    assert unlisted_modules(page, tmp_path) == ["src/opd/a/two.py"]


def test_no_module_is_listed_twice_in_the_architecture_table():
    """One row per module: a package's row names its modules, or a module has a row of its own, not both."""
    twice = modules_listed_twice(ARCHITECTURE)
    assert twice == [], "modules docs/architecture.md's Files table lists in two rows (keep one):\n" + "\n".join(twice)


def test_a_module_listed_twice_is_reported_and_a_reference_lists_nothing(tmp_path):
    _fake_src(tmp_path, "a/one.py", "a/two.py", "b.py")
    page = tmp_path / "architecture.md"
    page.write_text(
        "# A\n\n## Files\n\n| path | what it is |\n|---|---|\n"
        "| `src/opd/a/` | the a package: `one.py` (one) |\n"
        "| `src/opd/b.py` | b, which calls `a/two.py` and `src/opd/a/one.py` |\n"
        "| `src/opd/a/one.py` | one, again |\n"
    )
    assert modules_listed_twice(page, tmp_path) == ["src/opd/a/one.py: rows `src/opd/a/` and `src/opd/a/one.py`"]
    assert unlisted_modules(page, tmp_path) == ["src/opd/a/two.py"]  # b's row refers to it; no row describes it
    assert table_paths(page, tmp_path) == (
        {(tmp_path / "src/opd" / p).resolve() for p in ("a", "a/one.py", "a/two.py", "b.py")},
        [],
    )


# ----------------------------------------------------------------------------- benchmark results

BENCHMARK_RESULTS = ROOT / "benchmarks" / "results"
# A hash (git's short or full, "-dirty"/"+dirty" or a note after it), or, for a result measured before its script
# recorded one, the commit that committed it: the code it measured was no later than that.
COMMIT = re.compile(r"[0-9a-f]{7,40}\b|unrecorded \(committed in [0-9a-f]{7,40}, \d{4}-\d\d-\d\d\)")


def provenance_problems(results: Path) -> list[str]:
    """What each benchmark JSON lacks of the commit and machine it was measured at: at its top level, or in
    every run a file gathers (an object of runs, each an object with both)."""
    problems = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        runs = isinstance(data, dict) and "commit" not in data and all(isinstance(v, dict) for v in data.values())
        for where, entry in data.items() if runs else [("", data)]:
            name = f"{path.name}{f' ({where})' if where else ''}"
            commit = entry.get("commit") if isinstance(entry, dict) else None
            if not isinstance(commit, str) or not COMMIT.match(commit):
                problems.append(f"{name}: no commit (a 'commit' field: the hash it was measured at)")
            if not (isinstance(entry, dict) and entry.get("machine")):
                problems.append(f"{name}: no machine (a 'machine' field)")
    return problems


def test_every_benchmark_result_records_its_commit_and_machine():
    assert provenance_problems(BENCHMARK_RESULTS) == []


def test_a_benchmark_result_without_a_commit_is_reported(tmp_path):
    (tmp_path / "ok.json").write_text(json.dumps({"commit": "aaff9eb-dirty", "machine": {"cpu_cores": 2}, "rows": []}))
    (tmp_path / "runs.json").write_text(json.dumps({"before": {"commit": "f59a700", "machine": "m"}, "after": {}}))
    (tmp_path / "old.json").write_text(json.dumps({"unrecorded": True, "machine": {"cpus": 2}, "rows": [1]}))
    (tmp_path / "marked.json").write_text(
        json.dumps({"commit": "unrecorded (committed in 789f6a9, 2026-11-22)", "machine": "m"})
    )
    (tmp_path / "vague.json").write_text(json.dumps({"commit": "HEAD", "machine": "m"}))
    assert provenance_problems(tmp_path) == [
        "old.json: no commit (a 'commit' field: the hash it was measured at)",
        "runs.json (after): no commit (a 'commit' field: the hash it was measured at)",
        "runs.json (after): no machine (a 'machine' field)",
        "vague.json: no commit (a 'commit' field: the hash it was measured at)",
    ]


def test_ci_runs_the_readme_commands_between_them_every_test():
    """The README's command leaves out the slow tests and CI's second step runs them: between them, all."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "readme_cmd" in ci and SLOW_COMMAND.split(" && ")[0] in ci
    slow_line = next(line for line in README.read_text(encoding="utf-8").splitlines() if line == SLOW_COMMAND)
    assert '-m "not slow"' in TEST_COMMAND and slow_line.endswith("-m slow")
    assert "slow_cmd" in ci and "-m slow" in ci
