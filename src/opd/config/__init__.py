"""Typed run configurations (``opd.config``): one dataclass per command, validated on construction,
settable from the CLI and a YAML/JSON file, dumped into every run directory.

* :mod:`~opd.config.fields` -- the machinery: fields with help texts, :class:`ConfigError`, shared
  checks, file values checked against the fields' types.
* :mod:`~opd.config.sections` -- which options belong together: ``config.json`` and ``--help`` by section.
* :mod:`~opd.config.files` -- reading and merging configs (defaults < file < command line), writing
  ``config.json``.
* :mod:`~opd.config.tasks` -- a multi-task run's task list, resolved into one config per task.
* :mod:`~opd.config.options` -- :class:`TrainConfig`, :class:`SFTConfig`, :class:`EvalConfig`.
* :mod:`~opd.config.sources` -- the options every command shares: models, prompts, games.
* :mod:`~opd.config.teachers` -- the teacher's options of ``opd train``, served or in-process.
"""

from opd.config.engines import STATIC_CACHE
from opd.config.fields import (
    DTYPES,
    REPORT_TO,
    CommandConfig,
    ConfigError,
    Section,
    check_device,
    check_report_to,
    coerce_numbers,
    opt,
    option_fields,
    option_hints,
    section_types,
)
from opd.config.files import build_config, config_record, dump_config, read_config_file, read_run_config
from opd.config.options import (
    EvalConfig,
    SFTConfig,
    TrainConfig,
    check_cross_tokenizer,
)
from opd.config.tasks import (
    TASK_MODES,
    TEACHER_SCORING,
    TaskSpec,
    per_task_keys,
    read_task_list,
    resolve_tasks,
)
from opd.config.teachers import CROSS_TOKENIZER, TeacherOptions, parse_special_map
from opd.objectives import DEFAULT_SPECIAL_TOKENS, ObjectiveOptions

__all__ = [
    "CommandConfig",
    "CROSS_TOKENIZER",
    "DEFAULT_SPECIAL_TOKENS",
    "DTYPES",
    "REPORT_TO",
    "STATIC_CACHE",
    "TEACHER_SCORING",
    "TASK_MODES",
    "ConfigError",
    "EvalConfig",
    "ObjectiveOptions",
    "SFTConfig",
    "Section",
    "TaskSpec",
    "TeacherOptions",
    "TrainConfig",
    "build_config",
    "check_cross_tokenizer",
    "check_device",
    "check_report_to",
    "coerce_numbers",
    "config_record",
    "dump_config",
    "opt",
    "option_fields",
    "option_hints",
    "parse_special_map",
    "per_task_keys",
    "read_config_file",
    "read_run_config",
    "read_task_list",
    "resolve_tasks",
    "section_types",
]
