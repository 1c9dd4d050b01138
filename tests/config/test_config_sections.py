"""Config sections: every option sits in one section; config.json is nested by section and reads back
as the same config; flat files (every config.json before sections) still load; a nested file cannot
set an option in the wrong section or twice; ``--help`` shows the sections."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from opd.cli import app
from opd.config import ConfigError, EvalConfig, SFTConfig, TrainConfig, build_config, dump_config, read_run_config
from opd.config.fields import option_fields, section_types
from opd.config.sections import SECTION_NAMES, TITLES, section_of
from opd.config.tasks import per_task_keys
from opd.report.load import load_run

# A run's config.json written by opd 0.1.0 (flat), from `opd experiment objectives` at 466b790.
FLAT_0_1_0 = Path(__file__).parent / "flat_config_0.1.0.json"
CLASSES = (TrainConfig, SFTConfig, EvalConfig)


def _train(**kw) -> TrainConfig:
    return TrainConfig.from_flat(student="/m/student", teacher="/m/teacher", **kw)


def test_every_option_of_every_command_sits_in_a_known_section_and_declares_whether_tasks_set_it():
    for cls in CLASSES:
        # the sections in config.json's and --help's order, each a frozen dataclass of options
        assert list(section_types(cls)) == [s for s in SECTION_NAMES if s in section_types(cls)], cls.__name__
        for where, f in option_fields(cls):
            assert where in SECTION_NAMES, (cls.__name__, f.name)
            assert isinstance(f.metadata["per_task"], bool), (cls.__name__, f.name)
        names = [f.name for _, f in option_fields(cls)]
        assert len(names) == len(set(names)), cls.__name__  # one section each: the flat names stay unique
        cfg = cls.from_flat(student="/m/s", init="/m/s") if cls is SFTConfig else cls.from_flat()
        for where, f in option_fields(cls):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(getattr(cfg, where), f.name, None)
    train, sft = set(per_task_keys(TrainConfig)), set(per_task_keys(SFTConfig))
    # OPD tasks bring their teacher and sampling, SFT tasks their targets; both their data and lengths
    assert {"teacher_url", "mask_special", "lr", "top_p", "task", "env", "batch_size"} <= train
    assert {"train_size", "dagger_from", "teacher", "task", "env", "batch_size"} <= sft
    assert not {"objective", "k", "steps", "seed", "student", "lora_r"} & (train | sft)
    assert "lr" not in sft  # one optimizer for every task's examples
    # one name, one section in every command (the report reads options by name: report/load.py), but for eval's own batch
    where: dict[str, set[str]] = {}
    for cls in CLASSES:
        for section, f in option_fields(cls):
            if not (cls is EvalConfig and f.name == "batch_size"):
                where.setdefault(f.name, set()).add(section)
    assert {name: sections for name, sections in where.items() if len(sections) > 1} == {}


def test_config_json_is_nested_by_section_and_reads_back_equal(tmp_path):
    cfg = _train(k=8, lr=1e-3, eval_every=5, lora_r=4, teacher_url="", report_to=["none"], env_args=["a=1"])
    dump_config(cfg, tmp_path / "config.json")
    written = json.loads((tmp_path / "config.json").read_text())
    assert list(written) == [s for s in SECTION_NAMES if s in written]  # in --help's order
    for section, options in written.items():
        assert isinstance(options, dict)
        assert all(section_of(TrainConfig, o) == section for o in options), section
    assert written["optimizer"]["lr"] == 1e-3 and written["eval"]["eval_every"] == 5 and written["lora"]["lora_r"] == 4
    again = build_config(TrainConfig, json.loads((tmp_path / "config.json").read_text()))
    assert again == cfg


def test_the_api_key_stays_out_of_the_nested_config_json(tmp_path):
    dump_config(_train(teacher_api_key="sk-secret"), tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    assert "sk-secret" not in text and "teacher_api_key" not in text
    assert "teacher_url" in json.loads(text)["teacher"]  # the section is written, the secret left out


def test_a_flat_config_json_of_version_0_1_0_still_loads(tmp_path):
    flat = json.loads(FLAT_0_1_0.read_text())
    assert not any(isinstance(v, dict) for v in flat.values())  # the fixture is flat, as 0.1.0 wrote it
    cfg = build_config(TrainConfig, flat)
    assert (cfg.objective.objective, cfg.objective.support, cfg.objective.k, cfg.optimizer.steps, cfg.optimizer.lr) == (
        "lsm",
        "student_topk",
        8,
        100,
        5e-4,
    )
    assert read_run_config(FLAT_0_1_0, TrainConfig) == flat
    # Written again it is nested, and the nested file is the same config.
    dump_config(cfg, tmp_path / "config.json")
    assert build_config(TrainConfig, json.loads((tmp_path / "config.json").read_text())) == cfg
    assert read_run_config(tmp_path / "config.json", TrainConfig) == {
        k: v for k, v in cfg.flat().items() if k != "teacher_api_key"
    }


def test_a_yaml_file_may_mix_sections_and_flat_options_and_the_command_line_wins():
    text = """
    teacher: {teacher: /m/teacher, teacher_dtype: bfloat16}
    objective: {objective: lsm, k: 16}
    optimizer:
      lr: 1e-4
    steps: 7
    student: /m/student
    """
    cfg = build_config(TrainConfig, yaml.safe_load(text), {"k": 4})
    assert (cfg.teacher.teacher, cfg.teacher.teacher_dtype, cfg.objective.k, cfg.optimizer.lr, cfg.optimizer.steps) == (
        "/m/teacher",
        "bfloat16",
        4,
        1e-4,
        7,
    )


def test_a_string_under_a_section_name_is_the_option_of_that_name():
    cfg = build_config(TrainConfig, {"student": "/m/s", "teacher": "/m/t", "objective": "sampled", "env": ""})
    assert (cfg.teacher.teacher, cfg.objective.objective) == ("/m/t", "sampled")


@pytest.mark.parametrize(
    "data, words",
    [
        ({"student": "/m/s", "teacher": {"lr": 0.1}}, ["lr is in the optimizer section, not teacher"]),
        ({"student": "/m/s", "lr": 0.1, "optimizer": {"lr": 0.2}}, ["lr is given twice", "keep one"]),
        ({"student": "/m/s", "optimizer": {"learning_rate": 0.1}}, ["unknown option 'learning_rate'", "optimizer"]),
        ({"student": "/m/s", "lora": {"lora_r": 4}, "tasks": None, "eval": {"eval_size": "many"}}, ["eval_size"]),
    ],
    ids=["wrong-section", "twice", "unknown-in-section", "type-checked-inside-a-section"],
)
def test_a_nested_file_that_cannot_mean_what_it_says_is_refused(data, words):
    with pytest.raises(ConfigError) as err:
        build_config(TrainConfig, data)
    for w in words:
        assert w in str(err.value)


def test_eval_batch_is_in_the_eval_section_of_opd_eval_and_the_optimizer_section_of_train(tmp_path):
    assert section_of(EvalConfig, "batch_size") == "eval" and section_of(TrainConfig, "batch_size") == "optimizer"
    cfg = EvalConfig.from_flat(student="/m/s", batch_size=16)
    dump_config(cfg, tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["eval"]["batch_size"] == 16
    assert build_config(EvalConfig, json.loads((tmp_path / "config.json").read_text())) == cfg


def test_the_report_reads_nested_and_flat_config_json_alike(tmp_path):
    cfg = _train(objective="lsm", k=8, env="")
    nested, flat = tmp_path / "nested", tmp_path / "flat"
    for d in (nested, flat):
        d.mkdir()
        (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    dump_config(cfg, nested / "config.json")
    record = {k: v for k, v in cfg.flat().items() if k != "teacher_api_key"}
    (flat / "config.json").write_text(json.dumps(record))
    assert load_run(nested).config == load_run(flat).config == record


def test_train_help_groups_its_flags_by_section():
    out = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    # a panel's header, not its title's words in some option's help text ("a LoRA run")
    positions = [out.index(f"╭─ {TITLES[s]} ") for s in SECTION_NAMES]
    assert positions == sorted(positions)  # the panels, in the sections' order
    lora = out[out.index(f"╭─ {TITLES['lora']} ") :]
    assert lora.index("--lora-r") < lora.index(TITLES["multitask"])  # each flag in its section's panel
