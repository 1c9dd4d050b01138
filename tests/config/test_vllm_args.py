"""``--vllm-args``: split once, when the config is checked, into the option list every reader takes."""

from __future__ import annotations

import pytest

from opd.config import ConfigError, EvalConfig, TrainConfig
from opd.rollout.vllm_server import option_value, without_option


def test_the_config_holds_the_split_options_and_keeps_the_string_config_json_has_held():
    cfg = TrainConfig.from_flat(rollout_engine="vllm", vllm_args="--enforce-eager --served-model-name 'a b' -tp=2")
    assert cfg.rollout.vllm_argv == ("--enforce-eager", "--served-model-name", "a b", "-tp=2")
    assert cfg.rollout.vllm_argv is cfg.rollout.vllm_argv  # split once, not per reader
    assert cfg.rollout.vllm_args == "--enforce-eager --served-model-name 'a b' -tp=2"
    assert EvalConfig.from_flat(student="s", rollout_engine="vllm", vllm_args="--enforce-eager").rollout.vllm_argv == (
        "--enforce-eager",
    )
    assert TrainConfig.from_flat().rollout.vllm_argv == ()


def test_vllm_args_that_cannot_be_split_are_refused_when_the_config_is_made():
    with pytest.raises(ConfigError, match="cannot be split into options.*check its quotes"):
        TrainConfig.from_flat(rollout_engine="vllm", vllm_args="--served-model-name 'x")


@pytest.mark.parametrize(
    "args, kept",
    [
        (["--gpu-memory-utilization", "0.5", "--enforce-eager"], ["--enforce-eager"]),
        (["-tp", "2", "--gpu-memory-utilization=0.5"], ["-tp", "2"]),
        (["--enforce-eager"], ["--enforce-eager"]),
        (["--gpu-memory-utilization-x", "1"], ["--gpu-memory-utilization-x", "1"]),  # another option
    ],
)
def test_without_option_drops_the_option_and_its_value_in_either_form(args, kept):
    assert without_option(args, "--gpu-memory-utilization") == kept
    assert option_value(without_option(args, "--gpu-memory-utilization"), "--gpu-memory-utilization") is None
