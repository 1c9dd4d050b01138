"""The machinery of opd's configurations: fields with help texts, one error type, shared checks,
and reading, merging and writing configs (defaults < a YAML/JSON file < the command line).

Below every config class and the task list (:mod:`opd.config.tasks`), which import it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import yaml

from opd.errors import UserError

C = TypeVar("C")


def opt(default: Any, help: str, secret: bool = False, **kw: Any) -> Any:
    """A dataclass field with help text (mutable defaults go through a factory). A ``secret`` one (an API
    key) is left out of the config's repr and of every record of it (:func:`config_record`)."""
    meta = {"help": help, **kw, **({"secret": True} if secret else {})}
    if isinstance(default, (list, dict, tuple)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta, repr=not secret)
    return field(default=default, metadata=meta, repr=not secret)


def config_record(cfg: Any) -> dict[str, Any]:
    """The config as a dict for config.json, checkpoints and trackers: every field but the secret ones."""
    secret = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("secret")}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in secret}


class ConfigError(UserError):
    """A configuration value is invalid; the message names the field and the fix."""


DTYPES = ("float32", "bfloat16", "float16")
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_device(spec: str) -> None:
    """``--device`` must be auto, cpu, cuda or cuda:N (what :func:`opd.models.loading.resolve_device` reads)."""
    require(bool(re.fullmatch(DEVICE_PATTERN, spec)), f"device={spec!r}: use auto, cpu, cuda or cuda:N")


REPORT_TO = ("none", "tensorboard", "wandb", "trackio")
REPORT_TO_HELP = (
    "Experiment trackers that also get the metrics of metrics.jsonl, per step, and the config: none, "
    "tensorboard (RUN/tensorboard), wandb (RUN/wandb; offline without an API key), trackio; "
    "several comma-separated or repeated."
)


def check_report_to(names: list | str) -> list[str]:
    """``--report-to``: tracker names, comma-separated or repeated, normalised; ``none`` stands alone."""
    given = [names] if isinstance(names, str) else list(names)
    items = list(dict.fromkeys(n.strip().lower() for v in given for n in str(v).split(",") if n.strip()))
    unknown = [n for n in items if n not in REPORT_TO]
    require(
        not unknown,
        f"report_to={','.join(unknown)}: unknown tracker; choose from {', '.join(REPORT_TO)} (several comma-separated)",
    )
    require(bool(items), f"report_to is empty; use none or name trackers: {', '.join(REPORT_TO[1:])}")
    require(
        items == ["none"] or "none" not in items,
        f"report_to={','.join(items)}: none turns tracking off, so it cannot be combined with a tracker",
    )
    return items


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of field names to values."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass a YAML or JSON file with --config")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of option names to values, not {type(data).__name__}")
    return data


def build_config(
    cls: type[C], file_values: dict[str, Any] | None = None, cli_values: dict[str, Any] | None = None
) -> C:
    """Merge defaults < file < CLI into a validated ``cls`` instance; unknown keys are errors."""
    names = {f.name for f in dataclasses.fields(cls)}
    merged: dict[str, Any] = {}
    for source, values in (("config file", file_values or {}), ("command line", cli_values or {})):
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in names:
                close = [n for n in names if n.startswith(key[:3])]
                hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
                raise ConfigError(f"unknown option {key!r} in the {source} for {cls.__name__}{hint}")
            if value is not None:
                merged[key] = value
    return cls(**coerce_numbers(cls, merged))


def coerce_numbers(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with whole numbers given for float fields made floats (YAML reads ``lr: 1`` as an int)."""
    hints = get_type_hints(cls)
    return {
        k: float(v) if hints.get(k) is float and isinstance(v, int) and not isinstance(v, bool) else v
        for k, v in values.items()
    }


def dump_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(json.dumps(config_record(cfg), indent=2, sort_keys=True) + "\n")
