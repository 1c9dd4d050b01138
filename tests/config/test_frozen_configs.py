"""Configs are frozen: built by ``from_flat``, which resolves the defaults that depend on other options into
the config it makes; a direct construction with an unresolved value, an unknown option, or a change after
the fact is refused."""

from __future__ import annotations

import dataclasses

import pytest

from opd.config import ConfigError, EvalConfig, SFTConfig, TrainConfig


def test_from_flat_resolves_what_depends_on_other_options_into_the_config_it_makes():
    cfg = TrainConfig.from_flat(
        teacher_url=["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
        chat_template_kwargs='{"enable_thinking": false}',
        report_to="tensorboard,wandb",
        rollout_engine="vllm",
        vllm_args="--enable-sleep-mode",
    )
    assert cfg.teacher_url == "http://127.0.0.1:8001,http://127.0.0.1:8002"
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.report_to == ["tensorboard", "wandb"]
    assert (cfg.vllm_sleep, cfg.vllm_max_gap) == (1, 1e-3)  # vLLM's words; float32's bound
    assert (TrainConfig.from_flat().mask_special, TrainConfig.from_flat(objective="sampled").mask_special) == (
        True,
        False,
    )
    assert TrainConfig.from_flat(objective="sampled", mask_special=True).mask_special is True
    assert EvalConfig.from_flat(student="s", rollout_engine="vllm", dtype="bfloat16").vllm_max_gap == 0.05


def test_a_config_is_never_changed_after_it_is_made_and_a_replaced_one_is_checked_again():
    cfg = TrainConfig.from_flat(k=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k = 4  # type: ignore[misc]
    assert dataclasses.replace(cfg, k=4).k == 4 and cfg.k == 8
    with pytest.raises(ConfigError, match="k=0 must be >= 1"):
        dataclasses.replace(cfg, k=0)
    assert TrainConfig.from_flat(**cfg.flat()) == cfg  # resolving a resolved config changes nothing
    # a change that a default depends on: cfg.replace resolves it again, dataclasses.replace refuses it unresolved
    vllm = cfg.replace(rollout_engine="vllm", objective="sampled", mask_special=None)
    assert (vllm.vllm_max_gap, vllm.mask_special, vllm.k) == (1e-3, False, 8)
    with pytest.raises(ConfigError, match=r"vllm_max_gap=0.0 unresolved.*cfg.replace"):
        dataclasses.replace(cfg, rollout_engine="vllm")


@pytest.mark.parametrize("cls", [TrainConfig, SFTConfig, EvalConfig])
def test_an_unknown_option_is_a_config_error_naming_it(cls):
    with pytest.raises(ConfigError, match=r"unknown option 'stepz' for \w+Config"):
        cls.from_flat(stepz=3)


@pytest.mark.parametrize(
    "kw, named",
    [({}, "mask_special=None"), ({"mask_special": False, "teacher_url": ["http://127.0.0.1:8001"]}, "teacher_url=")],
)
def test_a_direct_construction_with_an_unresolved_value_is_refused_naming_it(kw, named):
    with pytest.raises(ConfigError, match=rf"{named}.*unresolved; build it with TrainConfig.from_flat"):
        TrainConfig(**kw)  # a direct construction, on purpose
