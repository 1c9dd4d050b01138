"""Model-path mistakes a user makes in the first hour, each a one-line error naming the fix."""

from __future__ import annotations

import shutil

import pytest
from helpers import cfg_for

from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.training import loop as train_mod


@pytest.fixture(scope="module")
def finished_run(tiny_models, tmp_path_factory):
    """A short opd run with a checkpoint and a final model."""
    out = tmp_path_factory.mktemp("run")
    train_mod.train(cfg_for(tiny_models, out, steps=1, eval_samples=0, ckpt_every=1), show_progress=False)
    return out / "run"


def test_a_run_directory_points_to_its_final_model(finished_run):
    with pytest.raises(UserError, match=f"opd run directory; its trained model is {finished_run / 'final'}"):
        load_model(finished_run)
    with pytest.raises(UserError, match="opd run directory"):
        load_tokenizer(finished_run)
    load_model(finished_run / "final")  # and that one loads


def test_an_unfinished_run_directory_says_how_to_continue(finished_run, tmp_path):
    unfinished = tmp_path / "run"
    shutil.copytree(finished_run, unfinished, ignore=shutil.ignore_patterns("final"))
    with pytest.raises(UserError, match="without a final model.*--resume"):
        load_model(unfinished, "teacher")


def test_checkpoint_directories_point_to_their_model(finished_run):
    ckpts = finished_run / "checkpoints"
    step = ckpts / (ckpts / "latest").read_text().strip()
    with pytest.raises(UserError, match=f"opd checkpoint; its model is {step / 'model'}"):
        load_model(step)
    with pytest.raises(UserError, match=f"latest one's model is {step / 'model'}"):
        load_model(ckpts)
    load_model(step / "model")


def test_a_tokenizer_only_directory(tiny_tokenizer):
    with pytest.raises(UserError, match="holds a tokenizer but no model"):
        load_model(tiny_tokenizer)
    load_tokenizer(tiny_tokenizer, "tokenizer")  # as a tokenizer it is fine


def test_a_config_without_weights(tiny_models, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_models[0] / "config.json", bare / "config.json")
    with pytest.raises(UserError, match=r"config.json but no weights"):
        load_model(bare, "teacher")
