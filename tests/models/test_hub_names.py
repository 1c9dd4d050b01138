"""Models by Hub name: resolved through huggingface_hub's cache (laid out by the tests, offline), a local
folder winning, revisions honoured, and one-line errors naming the cache and the download command."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import make_tiny_model
from hub_cache import cache_repo, commit_of

from opd.errors import UserError
from opd.hub import resolve_model
from opd.models.loading import load_model, load_tokenizer


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_hub_name_loads_the_cached_snapshot_of_each_revision(hub, tiny_tokenizer, tmp_path):
    a = make_tiny_model(tiny_tokenizer, tmp_path / "a", seed=1)
    b = make_tiny_model(tiny_tokenizer, tmp_path / "b", seed=2)
    cache_repo(hub, "acme/tiny", a)
    snap_b = cache_repo(hub, "acme/tiny", b, revision="v2")
    main, v2 = load_model("acme/tiny", "student"), load_model("acme/tiny", "student", revision="v2")
    assert torch.equal(_weights(main), _weights(load_model(a, "student")))
    assert torch.equal(_weights(v2), _weights(load_model(b, "student")))
    assert not torch.equal(_weights(main), _weights(v2))
    by_commit = load_model("acme/tiny", "student", revision=snap_b.name)  # a commit hash reads its snapshot
    assert torch.equal(_weights(by_commit), _weights(v2))
    tok = load_tokenizer("acme/tiny", "student")
    assert tok.get_vocab() == load_tokenizer(a, "student").get_vocab()


def test_a_local_folder_wins_over_the_hub_name_it_spells(hub, tiny_tokenizer, tmp_path, monkeypatch):
    cache_repo(hub, "acme/tiny", make_tiny_model(tiny_tokenizer, tmp_path / "cached", seed=1))
    monkeypatch.chdir(tmp_path)
    make_tiny_model(tiny_tokenizer, tmp_path / "acme" / "tiny", seed=3)
    assert resolve_model("acme/tiny").resolve() == (tmp_path / "acme" / "tiny").resolve()
    with pytest.raises(UserError, match=r"is a local folder, and a revision \('v2'\) applies to a Hub name only"):
        resolve_model("acme/tiny", "v2")


def test_a_name_not_cached_offline_names_the_cache_and_the_download_command(hub, tiny_tokenizer, tmp_path):
    with pytest.raises(UserError) as e:
        load_model("acme/absent", "student")
    msg = str(e.value)
    assert "'acme/absent' is no local path" in msg and str(hub) in msg and "`hf download acme/absent`" in msg
    assert "HF_HUB_OFFLINE=1" in msg
    cache_repo(hub, "acme/tiny", make_tiny_model(tiny_tokenizer, tmp_path / "a"))
    with pytest.raises(
        UserError, match=r"acme/tiny at revision 'v9' is not in the cache .*hf download acme/tiny --revision v9"
    ):
        load_model("acme/tiny", "teacher", revision="v9")


def test_a_model_that_needs_its_own_code_is_refused_naming_it(hub, tiny_tokenizer, tmp_path):
    src = make_tiny_model(tiny_tokenizer, tmp_path / "custom")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    cache_repo(hub, "acme/custom", src)
    with pytest.raises(UserError, match=r"acme/custom runs its own code \(modeling_custom.py\).*trust_remote_code"):
        load_model("acme/custom", "student")


def test_a_missing_path_that_cannot_be_a_hub_name_keeps_the_folder_message(hub, tmp_path):
    with pytest.raises(UserError, match=r"student model directory .*/x/y/z does not exist"):
        load_model(tmp_path / "x" / "y" / "z", "student")


def test_a_training_run_takes_hub_names_and_records_them(hub, tiny_models, tmp_path):
    from helpers import cfg_for, run_options

    from opd.training import loop as train_mod

    student, teacher = tiny_models
    cache_repo(hub, "acme/student", student)
    cache_repo(hub, "acme/teacher", teacher, revision="r1")
    cfg = cfg_for(("acme/student", "acme/teacher"), tmp_path, teacher_revision="r1", steps=1, eval=False)
    train_mod.train(cfg, show_progress=False)
    options = run_options(tmp_path / "run")
    assert (options["student"], options["teacher"], options["teacher_revision"]) == (
        "acme/student",
        "acme/teacher",
        "r1",
    )
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert "base_model: acme/student\n" in (tmp_path / "run" / "final" / "README.md").read_text()  # the card
    shutil.rmtree(hub / "models--acme--teacher")  # the teacher is read from the cache, not copied
    with pytest.raises(UserError, match="acme/teacher"):
        train_mod.train(
            cfg_for(("acme/student", "acme/teacher"), tmp_path / "2", steps=1, eval=False), show_progress=False
        )
    assert commit_of("acme/student@main") in str(resolve_model("acme/student"))


def test_an_engine_of_its_own_is_given_the_folder_the_students_name_resolved_to(hub, tiny_models, tmp_path):
    """A vLLM engine reads the student's files itself: it gets the snapshot folder, not a name to look up."""
    from helpers import cfg_for

    from opd.rollout import registry
    from opd.training import loop as train_mod

    seen = []

    def recording(ctx):
        seen.append(ctx.model_dir)
        return registry.ENGINES["hf"](ctx)

    snap = cache_repo(hub, "acme/student", tiny_models[0], revision="r2")
    registry.register("recording", recording)
    try:
        cfg = cfg_for(("acme/student", tiny_models[1]), tmp_path, student_revision="r2", steps=1, eval=False)
        train_mod.train(cfg.replace(rollout_engine="recording"), show_progress=False)
    finally:
        registry.ENGINES.pop("recording")
    assert seen == [str(snap)]


def test_serve_teacher_serves_a_hub_name_under_that_name(hub, tiny_models, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from opd.teachers import server

    cache_repo(hub, "acme/teacher", tiny_models[1], revision="r3")
    served = []

    def fake_server(app, sock, verbose):  # uvicorn left out: the app is what the name reaches
        served.append(app)

        def stop(sockets):
            raise KeyboardInterrupt

        return SimpleNamespace(server_address=sock.getsockname()[:2], run=stop)

    monkeypatch.setattr(server, "_server", fake_server)
    server.serve("acme/teacher", port=0, device="cpu", revision="r3")
    assert served[0].model_name == "acme/teacher"
    with pytest.raises(UserError, match=r"acme/teacher at revision 'main' is not in the cache"):
        server.serve("acme/teacher", port=0, device="cpu", revision="main")
