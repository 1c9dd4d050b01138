"""The machinery of opd's configurations: fields with help texts, one error type, shared checks, and
:class:`CommandConfig` (``from_flat``, ``replace``, ``flat``: frozen configs built with their dependent
defaults resolved); reading, merging and writing files is :mod:`opd.config.files`.

Below every config class and the task list (:mod:`opd.config.tasks`), which import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable
from dataclasses import field
from types import UnionType
from typing import TYPE_CHECKING, Any, Self, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from opd.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")
S = TypeVar("S")


def opt(default: Any, help: str, *, per_task: bool = False, secret: bool = False) -> Any:
    """A config option: a dataclass field of a section (:class:`Section`) with its help text and whether a
    task of a multi-task run may set it for itself (:mod:`opd.config.tasks`); mutable defaults go through a
    factory. A ``secret`` one (an API key) is left out of the config's repr and of every record of it
    (:func:`config_record`)."""
    meta = {"help": help, "per_task": per_task, **({"secret": True} if secret else {})}
    if isinstance(default, (list, dict, tuple)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta, repr=not secret)
    return field(default=default, metadata=meta, repr=not secret)


class ConfigError(UserError):
    """A configuration value is invalid; the message names the field and the fix."""


class Section:
    """A section of a command's options (a frozen dataclass of :func:`opt` fields: ``cfg.rollout``), what the
    components that read it are given. :meth:`check` refuses a value out of its option's range; what
    depends on other sections is the command's check."""

    def check(self) -> None:
        """Each option's own range, with a ConfigError naming the option and the fix."""

    def __bool__(self) -> bool:
        # six sections share their name with an option (cfg.eval is the section, cfg.eval.eval the option):
        # a truth test of a section is always a mistaken read of that option
        raise TypeError(
            f"{type(self).__name__} is a section of options, never true or false; read the option in it "
            "(cfg.eval.eval, cfg.teacher.teacher, cfg.env.env, ...)"
        )


def section(kind: type[S]) -> S:
    """A command config's field holding section ``kind`` (its defaults; :meth:`CommandConfig.from_flat`
    resolves them)."""
    made: S = field(default_factory=kind)
    return made


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a command config class's options sit, read once from its fields and their types."""

    sections: dict[str, type[DataclassInstance]]
    options: tuple[tuple[str, dataclasses.Field[Any]], ...]
    hints: dict[str, Any]


_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    if cls not in _LAYOUTS:
        hints = get_type_hints(cls)
        kinds: dict[str, type[DataclassInstance]] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        _LAYOUTS[cls] = _Layout(
            kinds,
            tuple((name, f) for name, kind in kinds.items() for f in dataclasses.fields(kind)),
            {name: hint for kind in kinds.values() for name, hint in get_type_hints(kind).items()},
        )
    return _LAYOUTS[cls]


def section_types(cls: type) -> dict[str, type[DataclassInstance]]:
    """The sections of command config class ``cls``: name -> section class, in the order of its fields."""
    return _layout(cls).sections


def option_fields(cls: type) -> tuple[tuple[str, dataclasses.Field[Any]], ...]:
    """Every option of command config class ``cls`` as (its section, its field), section by section."""
    return _layout(cls).options


def option_hints(cls: type) -> dict[str, Any]:
    """Every option of command config class ``cls`` and its type."""
    return _layout(cls).hints


class CommandConfig:
    """What every command's config (a frozen dataclass of sections, each a frozen dataclass of options) can
    do: be built from flat option values (the command line's) with the defaults that depend on other options
    resolved (:meth:`from_flat`), give them back flat (:meth:`flat`), and be changed into a new one
    (:meth:`replace`). A config is never changed after it is made."""

    @classmethod
    def resolve(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Every option's value (``values`` holds them all) with what the user may leave to opd, or give in
        another form, made what the config holds: a subclass resolves its own and calls this."""
        return values

    @classmethod
    def from_flat(cls, **values: Any) -> Self:
        """The config of these option values (the command line's names; the others at their defaults),
        resolved, placed in their sections and checked; an unknown option is a ConfigError naming it."""
        fields = {f.name: f for _, f in option_fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ConfigError(
                f"unknown option {', '.join(map(repr, unknown))} for {cls.__name__}; rename or remove it "
                "(the command's --help lists its options)"
            )
        full = {name: values[name] if name in values else _default(f) for name, f in fields.items()}
        return cls._placed(cls.resolve(full))

    @classmethod
    def _placed(cls, flat: dict[str, Any]) -> Self:
        kinds = section_types(cls)
        return cls(**{s: kind(**{f.name: flat[f.name] for f in dataclasses.fields(kind)}) for s, kind in kinds.items()})

    def replace(self, **changes: Any) -> Self:
        """A new config with these options (flat names) changed, checked. A default that depends on other
        options keeps the value it was resolved to: give it unset again to have it resolved for the change
        (``mask_special=None``: the new objective's; ``vllm_max_gap=0``: the new dtype's bound;
        ``vllm_sleep=0``: from the new ``--vllm-args``)."""
        return type(self).from_flat(**{**self.flat(), **changes})

    def flat(self) -> dict[str, Any]:
        """Every option's value, by option name (the secret ones too: :func:`config_record` leaves them out)."""
        return {f.name: getattr(getattr(self, s), f.name) for s, f in option_fields(type(self))}

    def check_resolved(self) -> None:
        """Refuse a config made directly with values :meth:`from_flat` would have resolved (an unset
        ``mask_special``, a list of teacher URLs): every reader may rely on the resolved form."""
        given = self.flat()
        resolved = type(self).resolve(dict(given))
        changed = [
            name for name, value in given.items() if resolved[name] is not value and resolved[name] != value
        ]  # NaN
        require(
            not changed,
            f"{type(self).__name__} was given {', '.join(f'{n}={given[n]!r}' for n in changed)} unresolved; "
            f"build it with {type(self).__name__}.from_flat(...) or change one with cfg.replace(...), which "
            "resolve them",
        )

    def check_sections(self) -> None:
        """Every section's own check (:meth:`Section.check`; the objective's options, declared below the
        config with the objectives, check themselves: ``ObjectiveOptions.problem``)."""
        for name in section_types(type(self)):
            part = getattr(self, name)
            if isinstance(part, Section):
                part.check()


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


DTYPES = ("float32", "bfloat16", "float16")
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_counts(section: object, **least: int) -> None:
    """Each named count of ``section`` is at least its bound: a negative one would otherwise slice its list
    from the end (``eval_size=-3`` evaluating all but three prompts) or divide by zero, instead of failing."""
    for name, bound in least.items():
        value = getattr(section, name)
        require(value >= bound, f"{name}={value} must be >= {bound}; set --{name.replace('_', '-')} to {bound} or more")


def default_of(kind: type, option: str) -> Any:
    """The default of ``option`` in section class ``kind``."""
    return next(_default(f) for f in dataclasses.fields(kind) if f.name == option)


def check_device(spec: str) -> None:
    """``--device`` must be auto, cpu, cuda or cuda:N (what :func:`opd.models.loading.resolve_device` reads)."""
    require(bool(re.fullmatch(DEVICE_PATTERN, spec)), f"device={spec!r}: use auto, cpu, cuda or cuda:N")


REPORT_TO = ("none", "tensorboard", "wandb", "trackio", "mlflow")
REPORT_TO_HELP = (
    "Experiment trackers that also get the metrics of metrics.jsonl, per step, and the config: none, "
    "tensorboard (RUN/tensorboard), wandb (RUN/wandb; offline without an API key), trackio, mlflow "
    "(MLFLOW_TRACKING_URI, else RUN/mlruns); several comma-separated or repeated. Each also gets the logged "
    "rollouts (prompt, response, verdict, KL) as a table at their step."
)


def check_report_to(names: Iterable[str] | str) -> list[str]:
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


def parse_problem(exc: json.JSONDecodeError | yaml.YAMLError) -> str:
    """A JSON or YAML parser's complaint on one line, with where it is: PyYAML's own message spans
    several lines (it quotes the file), which would break the CLI's one-line error."""
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


_KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


def typed_values(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    """``values`` read from a file, checked against ``cls``'s field types. YAML and JSON give any type,
    and the command line's types are typer's; unchecked, ``steps: many`` or ``k: 1.5`` fails deep inside a
    run with a traceback. Numeric strings pass for float fields (PyYAML reads ``lr: 5e-4`` as a string)
    and numbers and paths for string fields (``split: 0.1``); list fields are checked by their own validation."""
    hints = option_hints(cls)
    defaults = {f.name: f.default for _, f in option_fields(cls)}
    out = dict(values)
    for key, value in values.items():
        hint = hints.get(key.replace("-", "_"))
        optional = get_origin(hint) in (Union, UnionType)  # X | None: X's kind (dict[str, Any] is no str)
        kind = next((a for a in get_args(hint) if a is not type(None)), None) if optional else hint
        if value is None or kind not in _KINDS:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is float and isinstance(value, str):
            try:
                out[key] = value = float(value)
                number = True
            except ValueError:
                pass
        ok = {
            int: number and isinstance(value, int),
            float: number,
            bool: isinstance(value, bool),
            str: isinstance(value, (str, os.PathLike)) or number,
        }[kind]
        if not ok:
            default = defaults.get(key.replace("-", "_"))
            fix = f"write {_KINDS[kind]}"
            if kind is str:
                fix += " (in quotes where YAML would read another type)"
            elif isinstance(default, (int, float)):  # bool is an int too
                fix += f", e.g. {key}: {json.dumps(default)}"
            raise ConfigError(f"{key}: {value!r} in the {source} is not {_KINDS[kind]}; {fix}")
    return out


def coerce_numbers(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with whole numbers given for float fields made floats (YAML reads ``lr: 1`` as an int)."""
    hints = option_hints(cls)
    return {
        k: float(v) if hints.get(k) is float and isinstance(v, int) and not isinstance(v, bool) else v
        for k, v in values.items()
    }
