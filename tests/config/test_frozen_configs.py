"""Configs are frozen: built by ``from_flat``, which resolves the defaults that depend on other options into
the config it makes; a direct construction with an unresolved value, an unknown option, or a change after
the fact is refused."""

from __future__ import annotations

import dataclasses

import pytest

from opd.config import ConfigError, EvalConfig, ObjectiveOptions, SFTConfig, TeacherOptions, TrainConfig


def test_from_flat_resolves_what_depends_on_other_options_into_the_config_it_makes():
    cfg = TrainConfig.from_flat(
        teacher_url=["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
        chat_template_kwargs='{"enable_thinking": false}',
        report_to="tensorboard,wandb",
        rollout_engine="vllm",
        vllm_args="--enable-sleep-mode",
    )
    assert cfg.teacher.teacher_url == "http://127.0.0.1:8001,http://127.0.0.1:8002"
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.run.report_to == ["tensorboard", "wandb"]
    assert (cfg.rollout.vllm_sleep, cfg.rollout.vllm_max_gap) == (1, 1e-3)  # vLLM's words; float32's bound
    assert (
        TrainConfig.from_flat().objective.mask_special,
        TrainConfig.from_flat(objective="sampled").objective.mask_special,
    ) == (
        True,
        False,
    )
    assert TrainConfig.from_flat(objective="sampled", mask_special=True).objective.mask_special is True
    assert EvalConfig.from_flat(student="s", rollout_engine="vllm", dtype="bfloat16").rollout.vllm_max_gap == 0.05


def test_a_config_is_never_changed_after_it_is_made_and_a_replaced_one_is_checked_again():
    cfg = TrainConfig.from_flat(k=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.objective.k = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.objective = ObjectiveOptions()  # type: ignore[misc]
    assert cfg.replace(k=4).objective.k == 4 and cfg.objective.k == 8
    with pytest.raises(ConfigError, match="k=0 must be >= 1"):
        cfg.replace(k=0)
    with pytest.raises(ConfigError, match="k=0 must be >= 1"):  # a section replaced directly is checked too
        dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, k=0))
    assert TrainConfig.from_flat(**cfg.flat()) == cfg  # resolving a resolved config changes nothing
    # a change that a default depends on: cfg.replace resolves it again, dataclasses.replace refuses it unresolved
    vllm = cfg.replace(rollout_engine="vllm", objective="sampled", mask_special=None)
    assert (vllm.rollout.vllm_max_gap, vllm.objective.mask_special, vllm.objective.k) == (1e-3, False, 8)
    with pytest.raises(ConfigError, match=r"vllm_max_gap=0.0 unresolved.*cfg.replace"):
        dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, rollout_engine="vllm"))


@pytest.mark.parametrize("cls", [TrainConfig, SFTConfig, EvalConfig])
def test_an_unknown_option_is_a_config_error_naming_it(cls):
    with pytest.raises(ConfigError, match=r"unknown option 'stepz' for \w+Config"):
        cls.from_flat(stepz=3)


@pytest.mark.parametrize(
    "kw, named",
    [
        ({}, "mask_special=None"),
        (
            {
                "objective": ObjectiveOptions(mask_special=False),
                "teacher": TeacherOptions(teacher_url=["http://127.0.0.1:8001"]),
            },
            "teacher_url=",
        ),
    ],
)
def test_a_direct_construction_with_an_unresolved_value_is_refused_naming_it(kw, named):
    with pytest.raises(ConfigError, match=rf"{named}.*unresolved; build it with TrainConfig.from_flat"):
        TrainConfig(**kw)  # a direct construction, on purpose


def test_options_are_read_in_their_section_and_a_section_is_never_true_or_false():
    cfg = TrainConfig.from_flat(teacher="/m/t", top_p=0.95, eval=False)
    assert (cfg.teacher.teacher, cfg.rollout.top_p, cfg.eval.eval) == ("/m/t", 0.95, False)
    with pytest.raises(AttributeError):
        cfg.top_p  # noqa: B018 (a flat read: the option is in its section)
    # six sections share their name with an option: `if cfg.eval:` would always hold, so it is refused
    for section in (cfg.eval, cfg.teacher, cfg.env, cfg.data, cfg.objective):
        with pytest.raises(TypeError, match="is a section of options, never true or false"):
            bool(section)
