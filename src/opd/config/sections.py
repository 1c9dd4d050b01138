"""The sections of opd's configurations: which options belong together, in files and in ``--help``.

A command's config is a frozen dataclass of sections, each a frozen dataclass of options (``cfg.eval`` is
a :class:`opd.config.fields.Section`; ``cfg.eval.eval_every`` an option): an option sits in the section whose
class declares it. Every option has one name everywhere: its flag (``--eval-every``, flat: the command
line names no section), its attribute in its section and its key in a YAML/JSON file and in a run's
``config.json`` (``eval_every``). ``config.json`` is written nested by section (``{"eval": {"eval_every":
50, ...}}``) and ``--help`` shows one panel per section. A file may give its options nested, flat (every
``config.json`` written before sections), or both; an option in a section it does not belong to is an
error naming its section, so a nested file cannot silently set nothing.

A mapping under a section's name is that section. Six sections share their name with an option
(``data``, ``env``, ``teacher``, ``cross_tokenizer``, ``objective``, ``eval``); the option holds a
string (``eval``: true or false), never a mapping, so ``teacher: /models/t`` is the option and
``teacher: {teacher: /models/t}`` the section.
"""

from __future__ import annotations

from typing import Any

from opd.config.fields import ConfigError, option_fields

# The sections, in the order of config.json and --help, with their titles there (a command's config class
# declares them in this order). An option name means the same thing in train, sft and eval (``opd eval``'s
# batch_size, its generation batch, sits in its eval section).
SECTIONS: tuple[tuple[str, str], ...] = (
    ("model", "Student model"),
    ("data", "Data: prompts and answers"),
    ("env", "Environment: multi-turn games"),
    ("teacher", "Teacher: in-process or served"),
    ("cross_tokenizer", "Cross-tokenizer: a teacher with another tokenizer"),
    ("objective", "Objective: the loss"),
    ("rollout", "Rollouts: what the student samples, and with what engine"),
    ("optimizer", "Optimizer: steps, batches, learning rate"),
    ("eval", "Evaluation"),
    ("lora", "LoRA"),
    ("multitask", "Multi-task: several tasks in one run"),
    ("run", "Run directory, logging, checkpoints, processes"),
)
SECTION_NAMES = tuple(name for name, _ in SECTIONS)
TITLES = dict(SECTIONS)


def sections_of(cls: type) -> dict[str, str]:
    """Every option of config class ``cls`` and its section, section by section."""
    return {f.name: where for where, f in option_fields(cls)}


def section_of(cls: type, option: str) -> str:
    """The section ``option`` of config class ``cls`` sits in."""
    try:
        return sections_of(cls)[option]
    except KeyError:
        raise KeyError(f"{cls.__name__} has no option {option!r}") from None


def nest(cls: type, flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``flat`` (option -> value) as {section: {option: value}}: sections in SECTIONS' order, options in the
    class's field order."""
    where = sections_of(cls)
    out: dict[str, dict[str, Any]] = {name: {} for name in SECTION_NAMES}
    for option in where:
        if option in flat:
            out[where[option]][option] = flat[option]
    unknown = set(flat) - set(where)
    if unknown:
        raise KeyError(f"{cls.__name__} has no option {', '.join(sorted(unknown))}")
    return {name: values for name, values in out.items() if values}


def flatten(cls: type, data: dict[str, Any], source: str) -> dict[str, Any]:
    """A file's mapping, nested by section, flat or both, as option -> value (keys as written, dashes kept).

    Refused: an option inside a section it does not belong to, and one given twice (flat and nested)."""
    options = set(sections_of(cls))
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key, value in data.items():
        if key in SECTION_NAMES and isinstance(value, dict):
            items = [(str(k), v, key) for k, v in value.items()]
        else:
            items = [(key, value, "")]
        for option, v, section in items:
            name = option.replace("-", "_")
            if section and name in options and section_of(cls, name) != section:
                raise ConfigError(
                    f"{option} is in the {section_of(cls, name)} section, not {section}, of the {source}; "
                    f"move it under {section_of(cls, name)}: (or to the top level)"
                )
            if section and name not in options:
                raise ConfigError(
                    f"unknown option {option!r} in the {section} section of the {source} for {cls.__name__}; "
                    "rename or remove it (the command's --help lists its options by section)"
                )
            if name in where:
                raise ConfigError(
                    f"{option} is given twice in the {source} ({where[name] or 'top level'} and "
                    f"{section or 'top level'}); keep one"
                )
            where[name] = section
            flat[option] = v
    return flat
