"""Reading, merging and writing configs: defaults < a YAML/JSON file < the command line, and the
``config.json`` every run directory holds, nested by section (:mod:`opd.config.sections`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, TypeVar

import yaml

from opd.config.fields import CommandConfig, ConfigError, coerce_numbers, option_fields, parse_problem, typed_values
from opd.config.sections import flatten, nest

C = TypeVar("C", bound=CommandConfig)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of option names to values, flat or nested by section (as read:
    :func:`build_config` flattens and checks it)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass a YAML or JSON file with --config")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "JSON" if p.suffix == ".json" else "YAML"
        raise ConfigError(f"config file {p} is not valid {kind} ({parse_problem(exc)}); fix it there") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of option names to values, not {type(data).__name__}")
    return data


def build_config(
    cls: type[C], file_values: dict[str, Any] | None = None, cli_values: dict[str, Any] | None = None
) -> C:
    """Merge defaults < file < CLI into a validated ``cls`` instance; unknown keys are errors. The file's
    values may be nested by section (a run's ``config.json``) or flat (one written before sections)."""
    names = {f.name for _, f in option_fields(cls)}
    merged: dict[str, Any] = {}
    file_values = typed_values(cls, flatten(cls, file_values or {}, "config file"), "config file")
    for source, values in (("config file", file_values), ("command line", cli_values or {})):
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in names:
                close = [n for n in names if n.startswith(key[:3])]
                hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
                raise ConfigError(
                    f"unknown option {key!r} in the {source} for {cls.__name__}{hint}; rename or remove it "
                    "(the command's --help lists its options)"
                )
            if value is not None:
                merged[key] = value
    return cls.from_flat(**coerce_numbers(cls, merged))


def config_record(cfg: CommandConfig) -> dict[str, Any]:
    """The config as a dict for config.json, checkpoints and trackers: every field but the secret ones."""
    secret = {f.name for _, f in option_fields(type(cfg)) if f.metadata.get("secret")}
    return {k: copy.deepcopy(v) for k, v in cfg.flat().items() if k not in secret}


def dump_config(cfg: CommandConfig, path: str | Path) -> None:
    """``config.json``: the record nested by section, in the order of ``--help``; ``--config`` reads it back."""
    Path(path).write_text(json.dumps(nest(type(cfg), config_record(cfg)), indent=2) + "\n")


def read_run_config(path: str | Path, cls: type) -> dict[str, Any]:
    """A run's ``config.json`` (or a config file) as a flat option -> value dict, whether it is nested by
    section or flat (run directories written before sections)."""
    return flatten(cls, read_config_file(path), f"config {path}")
