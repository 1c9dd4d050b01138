"""Every committed run config still loads to the values it holds: the flat config.json of 0.1.0 and the
nested ones written at 6c1edfd (train, sft, eval), the last commit before options were declared with
their sections as field metadata. Written again, each is the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd.config import EvalConfig, SFTConfig, TrainConfig, build_config, dump_config, read_run_config

HERE = Path(__file__).parent
NESTED = {"train": TrainConfig, "sft": SFTConfig, "eval": EvalConfig}


@pytest.mark.parametrize("command", list(NESTED))
def test_a_nested_config_json_written_at_6c1edfd_loads_to_its_values_and_is_written_the_same(command, tmp_path):
    cls, path = NESTED[command], HERE / f"nested_{command}_6c1edfd.json"
    written = json.loads(path.read_text())
    cfg = build_config(cls, written)
    dump_config(cfg, tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text()) == written
    flat = read_run_config(path, cls)
    assert flat == {option: value for section in written.values() for option, value in section.items()}


def test_the_nested_fixtures_hold_what_they_were_written_with():
    train = build_config(TrainConfig, json.loads((HERE / "nested_train_6c1edfd.json").read_text()))
    assert (
        train.objective.k,
        train.objective.tail,
        train.objective.mask_special,
        train.rollout.top_p,
        train.optimizer.lr,
    ) == (16, True, True, 0.95, 2e-4)
    assert train.rollout.vllm_args == "--gpu-memory-utilization 0.5 --enforce-eager" and train.lora.lora_targets == [
        "q_proj",
        "v_proj",
    ]
    assert [t["name"] for t in train.multitask.tasks] == ["math", "code"]
    sft = build_config(SFTConfig, json.loads((HERE / "nested_sft_6c1edfd.json").read_text()))
    assert (sft.model.init, sft.optimizer.steps, sft.optimizer.schedule, sft.eval.patience) == (
        "/m/init",
        300,
        "linear",
        3,
    )
    ev = build_config(EvalConfig, json.loads((HERE / "nested_eval_6c1edfd.json").read_text()))
    assert (ev.eval.samples, ev.eval.batch_size, ev.eval.maj_k, ev.eval.acc_teacher) == (4, 32, 4, 0.75)


def test_the_flat_config_json_of_0_1_0_loads_to_its_values_and_is_written_nested(tmp_path):
    path = HERE / "flat_config_0.1.0.json"
    flat = json.loads(path.read_text())
    cfg = build_config(TrainConfig, flat)
    dump_config(cfg, tmp_path / "config.json")
    again = read_run_config(tmp_path / "config.json", TrainConfig)
    assert {k: again[k] for k in flat} == flat
