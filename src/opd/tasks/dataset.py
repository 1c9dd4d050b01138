"""Your own data, read with the Hugging Face ``datasets`` library: a ``save_to_disk`` directory (a
Dataset or a DatasetDict), a folder of data files, or parquet, arrow, JSON/JSONL and CSV files or
globs (``"data/*.parquet"``; all the files a glob matches form one split), or a Hub dataset name
(``openai/gsm8k``, ``openai/gsm8k:main`` for a configuration, at ``revision``) when no such path
exists (:func:`opd.hub.load_hub_dataset`: the Hugging Face cache, downloading where allowed).

Usage::

    task = DatasetTask("gsm8k/train.parquet", prompt_field="question", answer_format="gsm8k")
    task = DatasetTask("chat_ds/")                    # save_to_disk, with a "messages" column
    task = DatasetTask("math.jsonl", prompt_field="problem", answer_field="solution")
    task.examples("train"); task.examples("test"); task.reward(completion, example)

Columns. ``prompt_field`` holds the question as a string, or as chat messages (a list of
``{"role", "content"}``): then the conversation up to its last user turn is the prompt, whole
(system, user, assistant and tool turns, rendered by the chat template), and the assistant turn
after it is the solution when there is no solution column. A ``messages`` column stands in for a
missing ``prompt`` column. ``answer_field`` holds the reference, read with ``answer_format``
(:mod:`opd.tasks.grading`: the ``#### 42`` of GSM8K with ``gsm8k``, the last ``\\boxed{}`` of a
MATH solution with ``boxed``, where a reference without any box is the bare answer); a row without
one takes its solution's final answer, and a row with neither is a prompt without a reference (it
trains and is not graded; an ``answer`` column may be missing altogether, a column named by
``answer_field`` otherwise may not). ``solution_field`` (optional) is a worked completion, for
``opd sft``. A ``task`` column labels examples; a ``tools`` column holds each row's tool schemas
(a JSON list of objects, or its text), passed to the chat template as ``tools=``.
``system_prompt``, when given, is the system turn of every prompt (in place of a chat's own).

Splits (``split``): empty takes the data's ``train`` and ``test`` splits when it has both, and
holds out 10% (seeded, :func:`opd.tasks.task.hold_out`) of data with one split; ``"TRAIN,TEST"``
names two splits; a fraction (``"0.2"``) holds out that share of the only (or the ``train``)
split. With ``evaluation=True`` the task is for evaluation only: its test examples are the
``test`` split (or the one ``split`` names), or the whole set when it has one split.

Every problem is an ``opd.errors.UserError`` naming the file, the column or row, and the option
that fixes it (``flag_prefix="eval-"`` names the ``--eval-*`` options instead).
"""

from __future__ import annotations

import glob
import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opd.errors import UserError
from opd.hub import load_hub_dataset, looks_like_repo_id, split_config
from opd.tasks.grading import check_answer_format, extract_answer, grade, reference_answer
from opd.tasks.presets import PRESETS
from opd.tasks.rows import check_not_empty, check_utf8, convert_rows, find_bad_line
from opd.tasks.task import Example, check_split, hold_out, reference_of

__all__ = ["DatasetTask", "BUILDERS", "DEFAULT_TEST_FRACTION", "parse_split", "read_splits"]

# file suffix -> the datasets builder that reads it
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
DEFAULT_TEST_FRACTION = 0.1


def parse_split(spec: str | float) -> tuple[str, str] | float | None:
    """``""`` -> None (automatic), ``"train,test"`` -> two split names, ``"0.1"`` -> a held-out fraction."""
    if isinstance(spec, (int, float)):
        fraction = float(spec)
    elif not spec.strip():
        return None
    else:
        try:
            fraction = float(spec)
        except ValueError:
            names = tuple(p.strip() for p in spec.split(","))
            if len(names) != 2 or not all(names):
                raise UserError(
                    f"--split {spec!r}: give TRAIN,TEST (two split names, e.g. train,test) "
                    "or a fraction to hold out, e.g. 0.1"
                ) from None
            return names  # type: ignore[return-value]
    if not 0.0 <= fraction < 1.0:
        raise UserError(f"--split {spec!r}: a held-out fraction must lie in [0, 1), e.g. 0.1")
    return fraction


@contextmanager
def _quiet():
    """datasets' progress bars and its logged read errors (we raise our own) off while reading."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def read_splits(source: str | Path, revision: str = "", flag: str = "--task") -> tuple[dict[str, Any], list[Path]]:
    """``(split name -> datasets.Dataset, the JSON files read)`` of a file, glob, directory or Hub name:
    the one loader of data by name (a local path wins; then the Hub)."""
    import datasets

    source = str(source)
    path = Path(source)
    hub_name, config = split_config(source)
    if revision and (path.exists() or not looks_like_repo_id(hub_name)):
        raise UserError(f"{flag} {source}: a revision ({revision!r}) applies to a Hub dataset name only; drop it")
    with _quiet():
        if not path.exists() and not any(c in source for c in "*?[") and looks_like_repo_id(hub_name):
            others = f"{flag} {source!r} is no local path, 'arithmetic' or a preset ({', '.join(PRESETS)})"
            return load_hub_dataset(hub_name, config, revision, others), []
        if not path.exists() and any(c in source for c in "*?["):
            files = sorted(Path(f) for f in glob.glob(source, recursive=True) if Path(f).is_file())
            if not files:
                raise UserError(f"{source!r} matches no file (relative to {Path.cwd()}); check the pattern")
            return _read_files(source, files)
        if path.is_file():
            return _read_files(source, [path])
        if not path.is_dir():
            raise UserError(f"data file not found: {path} (check the path; it is read relative to {Path.cwd()})")
        try:
            if (path / "dataset_dict.json").is_file():
                loaded = {s: _load_saved_split(path, s) for s in _saved_splits(path)}
            elif (path / "state.json").is_file():
                loaded = {"train": datasets.load_from_disk(source)}
            else:  # a folder of data files: datasets infers the format, and splits from the file names
                loaded = dict(datasets.load_dataset(source))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one line
            _raise_if_empty(e, source)
            for f in sorted(path.rglob("*")):  # its text data files: a byte that is not UTF-8 is named
                if f.is_file() and BUILDERS.get(f.suffix.lower()) in ("json", "csv"):
                    check_utf8(f)
            raise UserError(
                f"could not read the directory {path} with datasets ({_first_line(e)}); give a "
                "save_to_disk directory, a folder of data files, or a file"
            ) from None
    return loaded, []


def _saved_splits(path: Path) -> list[str]:
    return json.loads((path / "dataset_dict.json").read_text())["splits"]


def _load_saved_split(path: Path, split: str) -> Any:
    """One split of a save_to_disk DatasetDict, so that a split datasets cannot load is named."""
    import datasets

    try:
        return datasets.load_from_disk(str(path / split))
    except IndexError:  # datasets 5.2 saves a 0-row split but cannot load it back
        raise UserError(
            f"split {split!r} of {path} is empty (0 rows); add rows, or save the data set without it"
        ) from None


def _raise_if_empty(e: Exception, source: str) -> None:
    found = re.search(r'Instruction "(.+?)" corresponds to no data', str(e))
    if found:
        raise UserError(
            f"split {found.group(1)!r} of {source} is empty (0 rows); add rows, or give other data"
        ) from None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _read_files(source: str, files: list[Path]) -> tuple[dict[str, Any], list[Path]]:
    import datasets

    kinds = {BUILDERS.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        found = ", ".join(sorted({f.suffix or f.name for f in files}))
        raise UserError(
            f"{source}: found {found} files; opd reads {', '.join(BUILDERS)} files (one type per --task), "
            "a folder of them, or a save_to_disk directory"
        )
    builder = kinds.pop()
    json_files = files if builder == "json" else []
    for f in files if builder in ("json", "csv") else []:  # text: a byte that is not UTF-8 is named, not a traceback
        if json_files:
            check_not_empty(f)  # which checks the encoding first
        else:
            check_utf8(f)
    try:
        loaded = datasets.load_dataset(builder, data_files=[str(f) for f in files])
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one line
        if json_files:
            for f in json_files:
                find_bad_line(f)
        _raise_if_empty(e, source)
        raise UserError(f"could not read {source} as {builder} ({_first_line(e)}); check the file") from None
    return dict(loaded), json_files


class DatasetTask:
    """Prompts and reference answers from a data set on disk; see the module docstring."""

    def __init__(
        self,
        source: str | Path,
        *,
        name: str = "",
        split: str | float = "",
        test_source: str | Path | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        solution_field: str = "solution",
        answer_format: str = "boxed",
        system_prompt: str = "",
        seed: int = 0,
        evaluation: bool = False,
        flag_prefix: str = "",
        revision: str = "",
        prompt_template: str = "",
    ):
        check_answer_format(answer_format)
        self.source, self.answer_format, self.system_prompt = str(source), answer_format, system_prompt
        # a benchmark preset's: '{prompt}' is the row's question; its numeric answers (AIME's) read as text
        self.prompt_template = prompt_template
        self.name = name or Path(self.source).stem.strip("*?[]") or "data"
        self.fields = {"prompt": prompt_field, "answer": answer_field, "solution": solution_field}
        self.flag_prefix = flag_prefix  # "eval-": errors name the --eval-* options
        self.columns: list[str] = []  # of the split read last, for notes (answer_source)
        flag = "--eval-task" if flag_prefix == "eval-" else "--task"
        splits, self._json_files = read_splits(source, revision, flag)
        if test_source is not None:
            test_splits, test_json = read_splits(test_source)
            train = self._convert(splits, self._only_split(splits, self.source), self._json_files)
            test = self._convert(test_splits, self._only_split(test_splits, str(test_source)), test_json)
        elif evaluation:
            train, test = [], self._convert(splits, self._eval_split(splits, str(split)), self._json_files)
        else:
            train, test = self._train_test(splits, split, seed)
        self._splits = {"train": train, "test": test}

    # ------------------------------------------------------------------ splits

    def _train_test(self, splits: dict[str, Any], split: str | float, seed: int) -> tuple[list, list]:
        spec = parse_split(split)
        if spec is None:
            spec = ("train", "test") if {"train", "test"} <= splits.keys() else DEFAULT_TEST_FRACTION
        if isinstance(spec, tuple):
            for s in spec:
                self._check_split_name(splits, s)
            return tuple(self._convert(splits, s, self._json_files) for s in spec)  # type: ignore[return-value]
        if len(splits) == 1:
            base = next(iter(splits))
        elif "train" in splits:
            base = "train"
        else:
            raise UserError(
                f"{self.source} has the splits {', '.join(splits)} and none is called train; "
                f"name the training and test splits with --{self.flag_prefix}split TRAIN,TEST"
            )
        return hold_out(self._convert(splits, base, self._json_files), spec, seed)

    def _eval_split(self, splits: dict[str, Any], name: str) -> str:
        if name:
            self._check_split_name(splits, name)
            return name
        if "test" in splits:
            return "test"
        if len(splits) == 1:
            return next(iter(splits))
        raise UserError(
            f"{self.source} has the splits {', '.join(splits)} and none is called test; "
            f"choose the evaluation split with --{self.flag_prefix}split NAME"
        )

    def _only_split(self, splits: dict[str, Any], source: str) -> str:
        if len(splits) != 1:
            raise UserError(f"{source} has several splits ({', '.join(splits)}); give a file with one")
        return next(iter(splits))

    def _check_split_name(self, splits: dict[str, Any], name: str) -> None:
        if name not in splits:
            raise UserError(
                f"{self.source} has no split {name!r} (its splits: {', '.join(splits)}); fix --{self.flag_prefix}split"
            )

    # ------------------------------------------------------------------ rows -> examples

    def _convert(self, splits: dict[str, Any], split: str, json_files: list[Path]) -> list[Example]:
        ds = splits[split]
        where = self.source if len(splits) == 1 else f"split {split!r} of {self.source}"
        if ds.num_rows == 0:
            raise UserError(
                f"{where} is empty (0 rows); choose another split with --{self.flag_prefix}split or add rows"
            )
        self.columns = list(ds.column_names)
        answer = self.fields["answer"]
        if self.prompt_template and answer in ds.column_names and getattr(ds.features[answer], "dtype", "") != "string":
            import datasets

            ds = ds.cast_column(answer, datasets.Value("string"))  # a preset's integers (AIME) are its answers
        return convert_rows(ds, where, self, json_files)

    def examples(self, split: str) -> list[Example]:
        check_split(split)
        return list(self._splits[split])

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if grade(completion, reference_of(example), self.answer_format) else 0.0

    def answer_source(self) -> str:
        """Where this data's reference answers come from, for a note about prompts without one."""
        return (
            f"an {self.fields['answer']!r} column (the columns of {self.source}: {', '.join(self.columns)}), or the "
            f"final answer of a solution read as --{self.flag_prefix}answer-format {self.answer_format}"
        )

    def reference(self, text: str, from_solution: bool) -> str | None:
        """The reference answer in a value of the answer column (or, without one, of a solution)."""
        return extract_answer(text, self.answer_format) if from_solution else reference_answer(text, self.answer_format)
