"""Bad input at the command line: every mistake ends in one line, ``error: ...``, that names the problem
and the fix, with exit status 2 and no traceback.

Each case runs ``opd`` in-process through :func:`opd.cli.main`, what the console script calls, rather
than ``CliRunner().invoke(app)``: main is where a UserError becomes that one line, and CliRunner on the
bare app would only keep the exception. An exception that escapes main (a traceback on the user's
terminal) fails the case with that exception.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
from pathlib import Path

import pytest
import torch
from helpers import run_opd

# A run small enough that the cases which get as far as the rollout stay fast on two cores.
SHORT = "--device cpu --steps 1 --batch-size 2 --max-new-tokens 4 --eval-size 2 --eval-samples 0 --k 4 --eval-every 0"
TRAIN = f"train --student <S> --teacher <T> --out <OUT> {SHORT}"
EVAL = "eval --student <S> --out <OUT> --device cpu --eval-size 2 --samples 0"
SFT = "sft --init <S> --out <OUT> --device cpu --steps 1 --batch-size 2 --eval-size 2"
LONG_PROMPT = " ".join(["What is 1 + 1?"] * 200)  # about 1600 tokens: past the tiny models' 512 positions


def assert_one_line_error(code, out: str, err: str, pattern: str) -> None:
    """``pattern`` must match the whole message: the problem and the fix, nothing vaguer."""
    assert "Traceback" not in out + err, out + err
    assert code == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert err.rstrip().endswith(errors[0]), f"more output after the error line (a multi-line message?): {err}"
    message = errors[0].removeprefix("error: ")
    assert re.fullmatch(pattern, message), f"\n{message}\ndoes not match\n{pattern}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Data, config and directory mistakes, written once: <D> in the tables below."""
    d = tmp_path_factory.mktemp("bad_input")
    (d / "empty.jsonl").write_text("")
    (d / "long.jsonl").write_text((json.dumps({"prompt": LONG_PROMPT, "answer": "2"}) + "\n") * 4)
    (d / "bad.yaml").write_text("steps: [1\n")
    (d / "bad.json").write_text('{"steps": 1,\n')
    (d / "list.yaml").write_text("- steps\n")
    (d / "typo.yaml").write_text("stepz: 3\n")
    (d / "sft_keys.yaml").write_text("objective: lsm\n")
    (d / "words.yaml").write_text("steps: many\n")
    (d / "fraction.yaml").write_text("k: 1.5\n")
    (d / "task_typo.yaml").write_text("tasks:\n  - name: math\n    stepz: 3\n")
    (d / "task_words.yaml").write_text("tasks:\n  - name: math\n    eval_size: lots\n")
    # prompts without answers, and tools that are not a list of tool schemas (issue 64)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(4)))
    (d / "graded.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    (d / "bad_tools.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "tools": {"name": "add"}}) + "\n")
    # What opd writes, minus the content the checks do not read: a finished run, an unfinished one.
    (d / "run" / "final").mkdir(parents=True)
    (d / "run" / "metrics.jsonl").write_text("")
    step = d / "run" / "checkpoints" / "step_0000001"
    (step / "model").mkdir(parents=True)
    (step / "state.pt").write_bytes(b"")
    (d / "run" / "checkpoints" / "latest").write_text("step_0000001\n")
    (d / "unfinished" / "checkpoints").mkdir(parents=True)
    (d / "unfinished" / "metrics.jsonl").write_text("")
    (d / "no_runs").mkdir()
    (d / "runs" / "lsm").mkdir(parents=True)
    (d / "runs" / "lsm" / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n')
    (d / "corrupt" / "depth").mkdir(parents=True)
    (d / "corrupt" / "depth" / "results.json").write_text('{"name": "depth", ')
    (d / "stale" / "depth").mkdir(parents=True)
    (d / "stale" / "depth" / "results.json").write_text('{"name": "depth"}')
    return d


def expand(text: str, places: dict[str, Path], escape: bool) -> str:
    for key, path in places.items():
        text = text.replace(f"<{key}>", re.escape(str(path)) if escape else str(path))
    return text


def check_case(monkeypatch, capsys, places: dict[str, Path], command: str, pattern: str) -> None:
    args = [expand(a, places, escape=False) for a in shlex.split(command)]
    code, out, err = run_opd(monkeypatch, capsys, args)
    assert_one_line_error(code, out, err, expand(pattern, places, escape=True))


# (id, command line, the whole message as a regex); <S>/<T>: the tiny student and teacher, <D>: the
# files above, <OUT>: a fresh run directory.
CASES = [
    # wrong paths
    (
        "missing-student",
        "train --student <D>/nope --teacher <T> --out <OUT>",
        r"student model directory <D>/nope does not exist; pass a local directory written by save_pretrained, or a Hub name \(ORG/NAME\)",
    ),
    (
        "missing-teacher",
        "train --student <S> --teacher <D>/nope --out <OUT>",
        r"teacher model directory <D>/nope does not exist; pass a local directory written by save_pretrained, or a Hub name \(ORG/NAME\)",
    ),
    (
        "hub-student-not-cached",
        "train --student acme/absent --teacher <T> --out <OUT>",
        r"student model \(--student\) 'acme/absent' is no local path, and the Hub model acme/absent is not in the "
        r"cache .*hub and could not be fetched offline \(HF_HUB_OFFLINE=1\) \(not cached\); fetch it where the "
        r"network allows with `hf download acme/absent` \(same HF_HOME\), or give a local path",
    ),
    (
        "hub-task-revision-not-cached",
        "train --student <S> --teacher <T> --out <OUT> --task acme/sums --task-revision v2",
        r"--task 'acme/sums' is no local path, 'arithmetic' or a preset \(gsm8k, math500, aime24, aime25\), and the "
        r"Hub dataset acme/sums at revision 'v2' is not in the cache .*`hf download acme/sums --repo-type dataset "
        r"--revision v2` \(same HF_HOME\), or give a local path",
    ),
    (
        "keep-best-never-evaluated",
        "train --student <S> --teacher <T> --out <OUT> --keep-best eval/pass_at_k --eval-samples 0",
        r"keep_best='eval/pass_at_k': this run never evaluates eval/pass_at_k; it logs eval/accuracy, eval/response_tokens_max, eval/response_tokens_mean, eval/truncation_rate",
    ),
    (
        "no-student",
        "train --teacher <T> --out <OUT>",
        r"no student model given; pass --student DIR \(a Hugging Face model directory or Hub name\)",
    ),
    (
        "missing-init",
        "sft --init <D>/nope --out <OUT>",
        r"init model directory <D>/nope does not exist; pass a local directory written by save_pretrained, or a Hub name \(ORG/NAME\)",
    ),
    (
        "serve-missing-model",
        "serve-teacher <D>/nope --port 0",
        r"teacher model directory <D>/nope does not exist; pass a local directory written by save_pretrained, or a Hub name \(ORG/NAME\)",
    ),
    (
        "run-dir-as-student",
        "train --student <D>/run --teacher <T> --out <OUT>",
        r"<D>/run is an opd run directory; its trained model is <D>/run/final: pass --student <D>/run/final",
    ),
    (
        "run-dir-as-teacher",
        "train --student <S> --teacher <D>/run --out <OUT>",
        r"<D>/run is an opd run directory; its trained model is <D>/run/final: pass --teacher <D>/run/final",
    ),
    (
        "run-dir-to-serve",  # its model is an argument: the hint must not name --teacher
        "serve-teacher <D>/run --port 0",
        r"<D>/run is an opd run directory; its trained model is <D>/run/final: pass <D>/run/final as the model "
        r"argument \(opd serve-teacher MODEL_DIR\)",
    ),
    (
        "maj-at-k-without-samples",
        f"{EVAL} --maj-k 4",
        r"maj_k=4 votes over samples, and --samples is 0: set --samples to 4 or more",
    ),
    (
        "train-maj-at-k-over-samples",
        f"{TRAIN} --eval-samples 2 --maj-k 4",
        r"maj_k=4 needs as many samples per prompt; --eval-samples is 2: raise it or lower --maj-k",
    ),
    (
        "run-dir-to-eval",
        "eval --student <D>/run --out <OUT>",
        r"<D>/run is an opd run directory; its trained model is <D>/run/final: pass --student <D>/run/final",
    ),
    (
        "unfinished-run-as-student",
        "train --student <D>/unfinished --teacher <T> --out <OUT>",
        r"<D>/unfinished is an opd run directory without a final model \(the run did not finish\); continue it "
        r"with --resume --out <D>/unfinished, or pass a checkpoint's model, e\.g\. "
        r"<D>/unfinished/checkpoints/step_N/model",
    ),
    (
        "checkpoints-dir-as-student",
        "train --student <D>/run/checkpoints --teacher <T> --out <OUT>",
        r"<D>/run/checkpoints holds opd checkpoints; the latest one's model is "
        r"<D>/run/checkpoints/step_0000001/model: pass --student <D>/run/checkpoints/step_0000001/model",
    ),
    (
        "tokenizer-dir-as-student",
        "train --student <TOK> --teacher <T> --out <OUT>",
        r"<TOK> holds a tokenizer but no model \(no config\.json\); pass the directory that holds the model's "
        r"config\.json and weights as --student",
    ),
    # empty or missing data
    (
        "empty-prompts",
        f"{TRAIN} --task <D>/empty.jsonl",
        r'JSONL file <D>/empty\.jsonl is empty: add one \{"prompt": "\.\.\.", "answer": "\.\.\."\} object per line',
    ),
    (
        "empty-eval-prompts",
        f"{EVAL} --task <D>/empty.jsonl",
        r'JSONL file <D>/empty\.jsonl is empty: add one \{"prompt": "\.\.\.", "answer": "\.\.\."\} object per line',
    ),
    (
        "missing-task-file",
        f"{TRAIN} --task <D>/nope.jsonl",
        r"--task '<D>/nope\.jsonl' is neither an existing file, glob or directory \(read relative to .+\), nor "
        r"'arithmetic', a preset \(gsm8k, math500, aime24, aime25\) or a Hub dataset name \(ORG/NAME\); check the path",
    ),
    (
        "empty-sft-data",
        f"{SFT} --data <D>/empty.jsonl",
        r'SFT data file <D>/empty\.jsonl has no examples; write one \{"prompt": \.\.\., "solution": \.\.\.\} object '
        r"per line",
    ),
    (
        "missing-sft-data",
        f"{SFT} --data <D>/nope.jsonl",
        r"SFT data file <D>/nope\.jsonl does not exist; pass a JSONL file with prompt and solution per line",
    ),
    # prompts longer than allowed, and than the context
    (
        "prompts-over-max-prompt-tokens",
        f"{TRAIN} --task <D>/long.jsonl --split 0.5",
        r"2 of 2 training prompts are longer than max_prompt_tokens=256 \(longest: \d+ tokens, e\.g\. #0: "
        r"'What is 1 \+ 1\?.*'\.\.\.\); raise --max-prompt-tokens \(within the model's context\) \(skipping them would "
        r"leave none\)",
    ),
    (
        "prompts-over-max-prompt-tokens-as-an-error",
        f"{TRAIN} --task <D>/long.jsonl --split 0.5 --long-prompts error",
        r"2 of 2 training prompts are longer than max_prompt_tokens=256 \(longest: \d+ tokens, e\.g\. #0: "
        r"'What is 1 \+ 1\?.*'\.\.\.\); raise --max-prompt-tokens \(within the model's context\) or drop those prompts",
    ),
    (
        "prompt-over-context",
        f"{TRAIN} --task <D>/long.jsonl --split 0.5 --max-prompt-tokens 4096",
        r"a prompt of \d{4} tokens plus max_new_tokens=4 exceeds the model's context of 512 positions; lower "
        r"--max-new-tokens, or --max-prompt-tokens \(longer training prompts are skipped\)",
    ),
    (
        "held-out-prompt-over-context",
        f"{TRAIN} --eval-task <D>/long.jsonl --max-prompt-tokens 4096",
        r"a prompt of \d{4} tokens plus max_new_tokens=4 exceeds the model's context of 512 positions; lower "
        r"--max-new-tokens, or shorten the held-out prompts \(--eval-task; they are never skipped\)",
    ),
    (
        "eval-prompt-over-context",
        f"{EVAL} --task <D>/long.jsonl --max-prompt-tokens 4096",
        r"a prompt of \d{4} tokens plus max_new_tokens=64 exceeds the model's context of 512 positions; shorten "
        r"the prompts or lower --max-new-tokens",
    ),
    (
        "new-tokens-over-context",
        f"{TRAIN} --max-new-tokens 5000",
        r"a prompt of \d+ tokens plus max_new_tokens=5000 exceeds the model's context of 512 positions; lower "
        r"--max-new-tokens, or --max-prompt-tokens \(longer training prompts are skipped\)",
    ),
    # config files
    (
        "invalid-yaml",
        f"{TRAIN} --config <D>/bad.yaml",
        r"config file <D>/bad\.yaml is not valid YAML \(line 2, column 1: expected ',' or '\]', but got "
        r"'<stream end>'\); fix it there",
    ),
    (
        "invalid-json",
        f"{TRAIN} --config <D>/bad.json",
        r"config file <D>/bad\.json is not valid JSON \(line 2, column 1: Expecting property name enclosed in "
        r"double quotes\); fix it there",
    ),
    (
        "config-not-a-mapping",
        f"{TRAIN} --config <D>/list.yaml",
        r"config file <D>/list\.yaml must hold a mapping of option names to values, not list",
    ),
    (
        "missing-config",
        f"{TRAIN} --config <D>/nope.yaml",
        r"config file <D>/nope\.yaml does not exist; pass a YAML or JSON file with --config",
    ),
    (
        "unknown-config-key",
        f"{TRAIN} --config <D>/typo.yaml",
        r"unknown option 'stepz' in the config file for TrainConfig \(did you mean steps\?\); rename or remove it "
        r"\(the command's --help lists its options\)",
    ),
    (
        "train-key-in-sft-config",
        f"{SFT} --config <D>/sft_keys.yaml",
        r"unknown option 'objective' in the config file for SFTConfig; rename or remove it \(the command's --help "
        r"lists its options\)",
    ),
    (
        "words-for-a-count",
        f"{TRAIN} --config <D>/words.yaml",
        r"steps: 'many' in the config file is not a whole number; write a whole number, e\.g\. steps: 200",
    ),
    (
        "fraction-for-a-count",
        f"{TRAIN} --config <D>/fraction.yaml",
        r"k: 1\.5 in the config file is not a whole number; write a whole number, e\.g\. k: 32",
    ),
    (
        "unknown-task-key",
        f"{TRAIN} --tasks <D>/task_typo.yaml",
        r"task 'math': 'stepz' is not a setting; a task may set task, task_revision, .*teacher_url, .*, eval_samples",
    ),
    (
        "words-for-a-task-count",
        f"{TRAIN} --tasks <D>/task_words.yaml",
        r"task 'math': eval_size: 'lots' in the task list is not a whole number; write a whole number, e\.g\. "
        r"eval_size: 200",
    ),
    # conflicting options
    (
        "teacher-and-teacher-url",
        f"{TRAIN} --teacher-url http://127.0.0.1:9",
        r"both --teacher and --teacher-url are set; give one \(a model directory or a served teacher\)",
    ),
    (
        "tail-without-renormalize",
        f"{TRAIN} --tail --no-renormalize",
        r"tail compares full-vocabulary masses plus the mass outside the support, in place of renormalizing; "
        r"--no-renormalize \(the truncated ablation\) cannot go with it: drop --no-renormalize or --tail",
    ),
    (
        "tail-with-sampled",
        f"{TRAIN} --tail --objective sampled",
        r"tail is a variant of --objective lsm, not of sampled; drop --tail or use --objective lsm",
    ),
    (
        "forward-kl-share-out-of-range",
        f"{TRAIN} --forward-kl-share 1.5",
        r"forward_kl_share=1\.5 must lie in \[0, 1\]",
    ),
    (
        "forward-kl-share-with-tail",
        f"{TRAIN} --forward-kl-share 0.2 --tail",
        r"forward_kl_share mixes the two KL directions on lsm's renormalized support: use it with --objective lsm, "
        r"without --tail or --no-renormalize",
    ),
    (
        "forward-kl-share-with-sampled",
        f"{TRAIN} --forward-kl-share 0.2 --objective sampled",
        r"forward_kl_share mixes the two KL directions on lsm's renormalized support: use it with --objective lsm, "
        r"without --tail or --no-renormalize",
    ),
    (
        "teacher-dtype-for-a-served-teacher",
        "train --student <S> --teacher-url http://127.0.0.1:9 --teacher-dtype bfloat16 --out <OUT>",
        r"teacher_dtype applies to an in-process teacher \(--teacher DIR\); a served teacher keeps the dtype it "
        r"was started with \(opd serve-teacher --dtype\): drop --teacher-dtype",
    ),
    (
        "vllm-url-without-vllm",
        f"{TRAIN} --vllm-url http://127.0.0.1:9",
        r"--vllm-url set but rollout_engine is hf; add --rollout-engine vllm",
    ),
    (
        "vllm-url-not-a-url",
        f"{TRAIN} --rollout-engine vllm --vllm-url notaurl",
        r"--vllm-url 'notaurl' must start with http:// or https:// and name a host \(e.g. http://127.0.0.1:8000\)",
    ),
    (
        "static-cache-not-a-mode",
        f"{TRAIN} --static-cache yes",
        r"static_cache='yes': choose one of auto, on, off",
    ),
    (
        "static-cache-on-with-vllm",
        f"{TRAIN} --rollout-engine vllm --static-cache on",
        r"static_cache=on is a setting of opd's own sampling loop \(--rollout-engine hf\), not of vllm; drop "
        r"--static-cache on",
    ),
    (
        "teacher-url-not-a-url",
        "train --student <S> --teacher-url 127.0.0.1:8000 --out <OUT>",
        r"--teacher-url '127.0.0.1:8000' must start with http:// or https:// and name a host \(e.g. http://127.0.0.1:8000\)",
    ),
    (
        "rollout-engine-not-registered",
        f"{TRAIN} --rollout-engine sglang",
        r"rollout_engine='sglang' is not a registered rollout engine; choose one of hf, vllm \(or register yours with "
        r"opd.rollout.registry.register\)",
    ),
    (
        "eval-split-without-eval-task",
        f"{TRAIN} --eval-split test",
        r"eval_split set without eval_task; give --eval-task DATA, or drop the eval options",
    ),
    (
        "init-and-arch",
        f"{SFT} --arch qwen2:1:8",
        r"give exactly one of --init \(a model directory\) or --arch \(qwen2:LAYERS:WIDTH\)",
    ),
    (
        "two-demos",
        "demo --agentic --multitask --out <OUT>",
        r"--agentic and --multitask are two demos; choose one",
    ),
    # negative, zero and huge counts
    ("negative-steps", f"{TRAIN} --steps -1", r"steps=-1 must be >= 1; set --steps to 1 or more"),
    ("zero-batch", f"{TRAIN} --batch-size 0", r"batch_size=0 must be >= 1; set --batch-size to 1 or more"),
    ("zero-k", f"{TRAIN} --k 0", r"k=0 must be >= 1; set --k to 1 or more"),
    (
        "k-over-vocabulary",
        f"{TRAIN} --k 100000",
        r"k=100000 is larger than the vocabulary \(1024 tokens\); choose --k <= 1024",
    ),
    ("negative-eval-size", f"{TRAIN} --eval-size -3", r"eval_size=-3 must be >= 1; set --eval-size to 1 or more"),
    (
        "negative-ckpt-every",
        f"{TRAIN} --ckpt-every -1",
        r"ckpt_every=-1 must be >= 0; set --ckpt-every to 0 or more",
    ),
    ("negative-lr", f"{TRAIN} --lr -1", r"lr=-1\.0 must be > 0"),
    (
        "negative-weight-decay",
        f"{TRAIN} --weight-decay -1",
        r"weight_decay=-1\.0 must be >= 0 \(0: none\)",
    ),
    (
        "negative-clip",
        f"{TRAIN} --clip-eps -1 --objective sampled --updates-per-batch 2",
        r"clip_eps=-1\.0 must be > 0 \(0\.2 is PPO's usual clip\)",
    ),
    (
        "env-workers-over-limit",
        f"{TRAIN} --env-workers 1000",
        r"env_workers=1000: use 0 \(games in this process\) to \d+ worker processes, or leave it unset for one "
        r"per free CPU core",
    ),
    ("eval-zero-batch", f"{EVAL} --batch-size 0", r"batch_size=0 must be >= 1; set --batch-size to 1 or more"),
    ("eval-negative-samples", f"{EVAL} --samples -1", r"samples=-1 must be >= 0; set --samples to 0 or more"),
    ("eval-negative-size", f"{EVAL} --eval-size -2", r"eval_size=-2 must be >= 1; set --eval-size to 1 or more"),
    ("sft-zero-steps", f"{SFT} --steps 0", r"steps=0 must be >= 1; set --steps to 1 or more"),
    (
        "serve-zero-max-k",
        "serve-teacher <T> --max-k 0",
        r"--max-k 0 must be >= 1; pass a positive count or leave it out for the default",
    ),
    (
        "serve-port-out-of-range",
        "serve-teacher <T> --port 70000",
        r"cannot listen on 127\.0\.0\.1:70000 \(.+\); pick another --port \(0 picks a free one\)",
    ),
    (
        "experiment-zero-seeds",
        "experiment depth --seeds 0 --out <OUT> --quick",
        r"--seeds 0 must be >= 1 \(3 or more for intervals\)",
    ),
    ("experiment-zero-workers", "experiment depth --workers 0 --out <OUT> --quick", r"--workers 0 must be >= 1"),
    (
        "demo-negative-steps",
        "demo --steps -5 --out <OUT>",
        r"--steps -5 must be >= 1 \(OPD steps per objective\); leave it out for the default",
    ),
    (
        "report-zero-inspector-steps",
        "report <D>/runs/lsm --inspector-steps 0 --out <OUT>",
        r"inspector_steps=0: the token inspector needs at least 1 step; pass --inspector-steps 1 or more",
    ),
    # unknown names
    (
        "unknown-experiment",
        "experiment nosuch --out <OUT>",
        r"unknown experiment 'nosuch'; choose one of: [a-z-]+(, [a-z-]+)*",
    ),
    (
        "unknown-objective",
        f"{TRAIN} --objective kl",
        r"objective='kl': choose one of lsm, sampled, full_kl",
    ),
    (
        "unknown-env",
        f"{TRAIN} --env nosuch",
        r"unknown environment 'nosuch': use one of alfworld, textworld, toy(, [\w-]+)*",
    ),
    ("unknown-device", f"{TRAIN} --device tpu", r"device='tpu': use auto, cpu, cuda or cuda:N"),
    (
        "serve-unknown-dtype",
        "serve-teacher <T> --dtype float64",
        r"--dtype 'float64': use auto, float32, bfloat16, float16",
    ),
    (
        "serve-negative-prompt-limit",
        "serve-teacher <T> --max-prompt-tokens -1",
        r"--max-prompt-tokens -1 must be >= 0 \(0: the model's context length\)",
    ),
    # data as users have it: prompts without answers, chat-template options, tools (issue 64)
    (
        "tools-not-a-list-of-objects",
        f"{TRAIN} --task <D>/bad_tools.jsonl",
        r'field "tools" in <D>/bad_tools\.jsonl, line 1 is a dict, not a list of objects; write a JSON list of tool '
        r'schemas, e\.g\. \[\{"type": "function", "function": \{"name": "add", "parameters": \{\.\.\.\}\}\}\], or null',
    ),
    (
        "chat-template-kwargs-not-an-object",
        f"{TRAIN} --chat-template-kwargs enable_thinking=false",
        r"chat_template_kwargs='enable_thinking=false' is not JSON \(Expecting value, column 1\); write a JSON object, "
        r"e\.g\. '\{\"enable_thinking\": false\}'",
    ),
    (
        "teacher-chat-template-kwargs-a-list",
        f"{TRAIN} --teacher-chat-template-kwargs '[1]'",
        r"teacher_chat_template_kwargs='\[1\]' is a list, not a JSON object; write an object of template options, "
        r"e\.g\. '\{\"enable_thinking\": false\}'",
    ),
    (
        "eval-task-without-answers",
        f"{TRAIN} --task <D>/graded.jsonl --eval-task <D>/prompts.jsonl",
        r"--eval-task <D>/prompts\.jsonl has no reference answers to grade \(looked for an 'answer' column \(the "
        r"columns of <D>/prompts\.jsonl: prompt\), or the final answer of a solution read as --eval-answer-format "
        r"boxed\); give evaluation data with answers \(--eval-answer-field names its column\), or drop --eval-task",
    ),
    (
        "no-eval-with-an-eval-task",
        f"{TRAIN} --no-eval --eval-task <D>/graded.jsonl",
        r"eval_task='<D>/graded\.jsonl' is set with evaluation off \(--no-eval\); drop one of them",
    ),
    (
        "eval-of-prompts-without-answers",
        f"{EVAL} --task <D>/prompts.jsonl",
        r"--task <D>/prompts\.jsonl has no reference answers to grade against \(looked for an 'answer' column \(the "
        r"columns of <D>/prompts\.jsonl: prompt\), or the final answer of a solution read as --answer-format "
        r"boxed\); opd eval measures accuracy: give data with answers \(--answer-field names its column\)",
    ),
    # report and results
    (
        "report-on-a-folder-without-runs",
        "report <D>/no_runs",
        r"<D>/no_runs is not a run directory \(no metrics\.jsonl or config\.json\); pass a directory written by "
        r"`opd train`, e\.g\. runs/demo/lsm",
    ),
    (
        "report-on-the-parent-of-runs",
        "report <D>/runs",
        r"<D>/runs is not a run directory \(no metrics\.jsonl or config\.json\); it holds run directories: pass "
        r"them, e\.g\. `opd report <D>/runs/lsm`",
    ),
    (
        "report-on-a-missing-folder",
        "report <D>/nope",
        r"<D>/nope is not a directory; pass run directories written by `opd train` or `opd demo`",
    ),
    (
        "results-without-results",
        "results --from <D>/no_runs --doc <OUT>/RESULTS.md",
        r"no experiment results under <D>/no_runs; run `opd experiment NAME` first",
    ),
    (
        "results-corrupt-json",
        "results --from <D>/corrupt --doc <OUT>/RESULTS.md",
        r"<D>/corrupt/depth/results\.json is not a results\.json written by `opd experiment` \(JSONDecodeError: "
        r".+\); delete it and rerun `opd experiment depth`",
    ),
    (
        "results-missing-fields",
        "results --from <D>/stale --doc <OUT>/RESULTS.md",
        r"<D>/stale/depth/results\.json is not a results\.json written by `opd experiment` \(KeyError: 'quick'\); "
        r"delete it and rerun `opd experiment depth`",
    ),
]


@pytest.mark.parametrize(("command", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_naming_the_problem_and_the_fix(
    command, pattern, tiny_models, tiny_tokenizer, files, tmp_path, monkeypatch, capsys
):
    student, teacher = tiny_models
    places = {"S": student, "T": teacher, "TOK": tiny_tokenizer, "D": files, "OUT": tmp_path / "out"}
    check_case(monkeypatch, capsys, places, command, pattern)


# ----------------------------------------------------------------------------- broken models


def copy_model(src: Path, dst: Path, change) -> Path:
    """``src`` with ``change(model)`` applied to its weights, beside its tokenizer files."""
    from opd.models.loading import load_model

    model = load_model(src)
    with torch.no_grad():
        change(model)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(("config", "model", "generation")):
            shutil.copy(f, dst / f.name)
    return dst


def fill_nan(model) -> None:
    for p in model.parameters():
        p.fill_(float("nan"))


def overflow(model) -> None:
    # finite weights whose final norm overflows float32: the logits come out NaN
    model.model.norm.weight.fill_(3e38)


@pytest.fixture(scope="module")
def broken(tiny_models, tmp_path_factory):
    student, teacher = tiny_models
    root = tmp_path_factory.mktemp("broken")
    return {
        "NANS": copy_model(student, root / "nan_student", fill_nan),
        "NANT": copy_model(teacher, root / "nan_teacher", fill_nan),
        "HOTT": copy_model(teacher, root / "overflowing_teacher", overflow),
    }


BROKEN = [
    (
        "nan-student",
        TRAIN.replace("<S>", "<NANS>"),
        r"student model <NANS> has NaN or infinite weights \(model\.embed_tokens\.weight and \d+ more\); pass a "
        r"model saved before it diverged \(an earlier checkpoint\), or retrain it",
    ),
    (
        "nan-teacher",
        TRAIN.replace("<T>", "<NANT>"),
        r"teacher model <NANT> has NaN or infinite weights \(model\.embed_tokens\.weight and \d+ more\); pass a "
        r"model saved before it diverged \(an earlier checkpoint\), or retrain it",
    ),
    (
        "nan-model-to-eval",
        EVAL.replace("<S>", "<NANS>"),
        r"student model <NANS> has NaN or infinite weights \(.+\); pass a model saved before it diverged \(an "
        r"earlier checkpoint\), or retrain it",
    ),
    (
        "nan-model-to-serve",
        "serve-teacher <NANT> --port 0",
        r"teacher model <NANT> has NaN or infinite weights \(.+\); pass a model saved before it diverged \(an "
        r"earlier checkpoint\), or retrain it",
    ),
    (
        # Its losses would mask the NaN log-probs out (as they do -inf ones) and train on nothing.
        "teacher-log-probs-nan",
        TRAIN.replace("<T>", "<HOTT>"),
        r"the teacher's log-probs are NaN at \d+ of \d+ scored positions: its forward pass overflows on these "
        r"rollouts \(its weights are finite\); run it in a wider dtype \(--teacher-dtype float32\), or check the "
        r"--teacher model",
    ),
    (
        # The first update (Adam: about lr per weight) overflows the student; the next step's check stops it.
        "loss-diverges",
        f"{TRAIN} --steps 2 --lr 1e30 --warmup-steps 0",
        r"the (loss|gradient norm) became (nan|inf) at step 1; training stopped before the update and the last "
        r"good checkpoint in <OUT>/checkpoints is kept\. Lower --lr, raise --warmup-steps, or check the teacher's "
        r"outputs",
    ),
]


@pytest.mark.parametrize(("command", "pattern"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_a_broken_model_or_a_diverging_run_is_one_line_naming_the_fix(
    command, pattern, tiny_models, broken, tmp_path, monkeypatch, capsys
):
    student, teacher = tiny_models
    places = {"S": student, "T": teacher, "OUT": tmp_path / "out", **broken}
    check_case(monkeypatch, capsys, places, command, pattern)


# ----------------------------------------------------------------------------- served teachers


def test_a_port_in_use_is_refused_before_the_teacher_loads(tiny_models, monkeypatch, capsys):
    import opd.teachers.server as server_mod

    loads = []
    monkeypatch.setattr(server_mod, "load_model", lambda *a, **kw: loads.append(a))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, out, err = run_opd(monkeypatch, capsys, ["serve-teacher", tiny_models[1], "--port", port])
    assert_one_line_error(
        code,
        out,
        err,
        rf"cannot listen on 127\.0\.0\.1:{port} \(.*[Aa]ddress already in use\); pick another --port \(0 picks a "
        r"free one\)",
    )
    assert loads == []  # a large teacher takes minutes to load: the port is tried first


@pytest.fixture(scope="module")
def foreign_teacher_url(tmp_path_factory):
    """An opd teacher server whose model has a tokenizer of its own (not the tiny student's)."""
    from opd.models.loading import load_model, load_tokenizer, tiny_qwen2
    from opd.models.tokenizer import train_tokenizer
    from opd.tasks import ArithmeticTask
    from opd.teachers.server import Limits, TeacherApp, start_server, stop_server

    ex = ArithmeticTask(n_train=300, n_test=10, seed=5).examples("train")
    tok = train_tokenizer([e.prompt for e in ex] + [e.solution for e in ex], vocab_size=600)
    path = tmp_path_factory.mktemp("foreign")
    tiny_qwen2(len(tok), 1, 32, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    app = TeacherApp(load_model(path, "teacher"), load_tokenizer(path, "teacher"), "foreign", Limits(max_k=16))
    server = start_server(app, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    stop_server(server)


def test_a_served_teacher_with_another_tokenizer_names_both_fixes(
    foreign_teacher_url, tiny_models, tmp_path, monkeypatch, capsys
):
    args = shlex.split(SHORT) + ["--student", tiny_models[0], "--teacher-url", foreign_teacher_url]
    code, out, err = run_opd(monkeypatch, capsys, ["train", "--out", tmp_path / "run", *args])
    assert_one_line_error(
        code,
        out,
        err,
        r"the served teacher's vocabulary \(\d+ tokens, \d+ output rows\) differs from the student's \(1024 tokens, "
        r"1024 rows\); serve a teacher with the student's tokenizer, or give --teacher-tokenizer DIR \(the served "
        r"model's tokenizer\) for cross-tokenizer OPD",
    )


# ----------------------------------------------------------------------------- the parser's own errors

# Mistakes typer catches before opd sees them: its usage box (several lines, exit status 2), never a traceback.
USAGE = [
    ("train --stepz 3", "No such option: --stepz", "--steps"),
    ("train --steps many", "Invalid value for '--steps'", "integer"),
    ("experiment", "Missing argument 'name'", "opd experiment --help"),
]


@pytest.mark.parametrize(("command", "problem", "fix"), USAGE, ids=[u[0] for u in USAGE])
def test_a_mistyped_option_gets_the_parsers_usage_error(command, problem, fix, monkeypatch, capsys):
    code, out, err = run_opd(monkeypatch, capsys, shlex.split(command))
    said = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out + err).split())
    assert "Traceback" not in said and code == 2, said
    assert problem in said and fix in said and "--help" in said, said


# ----------------------------------------------------------------------------- run folders and data reads (issue 70)

T0 = f"train --student <S> --teacher <T> {SHORT}"
E0 = "eval --student <S> --device cpu --eval-size 2 --samples 0"
S0 = "sft --init <S> --device cpu --steps 1 --batch-size 2 --eval-size 2 --validation-size 0"
NOT_UTF8 = r", line {line}, column \d+: byte 0xe9 is not UTF-8 \(the file is in another encoding, e\.g\. latin-1 or cp1252\); re-save it as UTF-8"
NO_CHECK = r"fix the name, or pass --no-check-chat-template-kwargs for a template that reads its options indirectly"


def latin1_line(row: dict) -> bytes:
    return json.dumps(row, ensure_ascii=False).encode("latin-1") + b"\n"


@pytest.fixture(scope="module")
def found(tiny_models, tiny_tokenizer, tmp_path_factory):
    """What users have where they point --out and --data (<F>), written once: no case may change a byte of it."""
    from chat_templates import with_tools_template

    from opd.models.loading import load_tokenizer, tiny_qwen2

    student, _ = tiny_models
    f = tmp_path_factory.mktemp("found")
    shutil.copytree(student, f / "hf_model")
    (f / "notes").mkdir()
    (f / "notes" / "config.json").write_text('{"mine": 1}\n')
    (f / "notes" / "todo.txt").write_text("keep\n")
    sft_run = f / "sft_run"  # an opd sft run, and one written before the marker (the packaged demo student's files)
    (sft_run / "final").mkdir(parents=True)
    (sft_run / "opd-run.json").write_text('{"command": "sft"}\n')
    (sft_run / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n')
    (sft_run / "final" / "model.safetensors").write_bytes(b"weights")
    shutil.copytree(Path(__file__).parents[1] / "src/opd/assets/demo/runs/student", f / "old_sft_run")
    finished = f / "finished"  # a finished train run whose checkpoints/ were deleted
    (finished / "final").mkdir(parents=True)
    (finished / "opd-run.json").write_text('{"command": "train"}\n')
    (finished / "config.json").write_text('{"objective": "lsm"}\n')
    (finished / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n')
    (finished / "summary.json").write_text("{}\n")
    (finished / "final" / "model.safetensors").write_bytes(b"weights")
    (f / "a_file").write_text("not a folder\n")
    (f / "latin1.jsonl").write_bytes(latin1_line({"prompt": "Caf\u00e9: 1 + 1?", "answer": "2"}))
    (f / "latin1_sft.jsonl").write_bytes(latin1_line({"prompt": "Caf\u00e9: 1 + 1?", "solution": "\\boxed{2}"}))
    (f / "latin1.csv").write_bytes("prompt,answer\nCaf\u00e9: 1 + 1?,2\n".encode("latin-1"))
    (f / "long_sft.jsonl").write_text((json.dumps({"prompt": LONG_PROMPT, "solution": "\\boxed{2}"}) + "\n") * 4)
    (f / "empty_prompt_sft.jsonl").write_text(
        json.dumps({"prompt": "1 + 1?", "solution": "\\boxed{2}"})
        + "\n"
        + json.dumps({"prompt": "", "solution": "x"})
        + "\n"
    )
    tok = with_tools_template(load_tokenizer(tiny_tokenizer, "tokenizer"))  # its template reads enable_thinking
    tiny_qwen2(len(tok), 1, 32, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).save_pretrained(f / "thinking")
    tok.save_pretrained(f / "thinking")
    return f


def tree(*roots: Path) -> dict[str, str]:
    """Every file's sha256 and every folder under ``roots``: what a case must leave as it found it."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for root in roots
        for p in sorted(root.rglob("*"))
    }


OWNED = [
    # --out: a folder opd does not own, or a model it reads
    (
        "out-at-a-model-folder",
        f"{T0} --out <F>/hf_model",
        r"--out <F>/hf_model is not an opd run folder \(it holds chat_template\.jinja, config\.json, .*model\.safetensors, "
        r".+\); choose a new or empty folder",
    ),
    (
        "out-is-the-student",
        f"{T0} --out <S>",
        r"--out <S> is the model given as --student; the run would overwrite its files: choose another --out",
    ),
    (
        "eval-out-is-the-student",
        f"{E0} --out <S>",
        r"--out <S> is the model given as --student; the run would overwrite its files: choose another --out",
    ),
    (
        "out-at-a-folder-with-a-config",
        f"{T0} --out <F>/notes",
        r"--out <F>/notes is not an opd run folder \(it holds config\.json, todo\.txt\); choose a new or empty folder",
    ),
    (
        "resume-at-a-folder-with-a-config",
        f"{T0} --resume --out <F>/notes",
        r"--resume: <F>/notes is not an opd run folder \(it holds config\.json, todo\.txt\); point --out at an opd "
        r"train run, or choose a new folder without --resume",
    ),
    (
        "resume-at-an-sft-run",
        f"{T0} --resume --out <F>/sft_run",
        r"--resume: <F>/sft_run holds an opd sft run, not an opd train run; resume a train run, or choose a new "
        r"--out without --resume",
    ),
    (
        "resume-at-an-sft-run-from-before-the-marker",
        f"{T0} --resume --out <F>/old_sft_run",
        r"--resume: <F>/old_sft_run holds an opd sft run, not an opd train run; resume a train run, or choose a new "
        r"--out without --resume",
    ),
    (
        "resume-a-finished-run-without-checkpoints",
        f"{T0} --resume --out <F>/finished",
        r"--resume: <F>/finished holds a finished opd train run without checkpoints \(no checkpoints/latest\), so "
        r"there is nothing to resume; choose a new --out to train again",
    ),
    (
        "resume-a-missing-folder",
        f"{T0} --resume --out <F>/nope",
        r"--resume: <F>/nope does not exist, so there is no run to resume; check --out, or drop --resume to start a "
        r"new run there",
    ),
    (
        "sft-at-a-train-run",
        f"{S0} --out <F>/finished",
        r"--out <F>/finished holds an opd train run; opd sft writes its own: choose another --out",
    ),
    (
        "sft-over-its-own-run",  # sft has no --resume: the message must not advise one
        f"{S0} --out <F>/sft_run",
        r"<F>/sft_run already holds a run of opd sft \(metrics\.jsonl\); opd sft has no --resume: choose a new --out "
        r"\(or delete that folder\) to start over",
    ),
    (
        "eval-at-a-train-run",
        f"{E0} --out <F>/finished",
        r"--out <F>/finished holds an opd train run; opd eval writes its own: choose another --out",
    ),
    (
        "out-at-a-file",
        f"{T0} --out <F>/a_file",
        r"--out <F>/a_file is a file; --out must be a folder \(a new one, or a run of opd train\)",
    ),
    (
        "eval-out-at-a-file",
        f"{E0} --out <F>/a_file",
        r"--out <F>/a_file is a file; --out must be a folder \(a new one, or a run of opd eval\)",
    ),
    # data that is not UTF-8: one reader for train, eval, sft --task and sft --data
    (
        "train-task-not-utf8",
        f"{T0} --out <OUT> --task <F>/latin1.jsonl",
        "<F>/latin1\\.jsonl" + NOT_UTF8.format(line=1),
    ),
    ("eval-task-not-utf8", f"{E0} --out <OUT> --task <F>/latin1.jsonl", "<F>/latin1\\.jsonl" + NOT_UTF8.format(line=1)),
    ("sft-task-not-utf8", f"{S0} --out <OUT> --task <F>/latin1.jsonl", "<F>/latin1\\.jsonl" + NOT_UTF8.format(line=1)),
    (
        "sft-data-not-utf8",
        f"{S0} --out <OUT> --data <F>/latin1_sft.jsonl",
        "<F>/latin1_sft\\.jsonl" + NOT_UTF8.format(line=1),
    ),
    ("csv-not-utf8", f"{T0} --out <OUT> --task <F>/latin1.csv", "<F>/latin1\\.csv" + NOT_UTF8.format(line=2)),
    # sft --data gets the checks of --task
    (
        "sft-data-over-context",
        f"{S0} --out <OUT> --data <F>/long_sft.jsonl --max-prompt-tokens 4096",
        r"a prompt of \d{4} tokens plus max_new_tokens=64 exceeds the model's context of 512 positions; shorten "
        r"the prompts or lower --max-new-tokens",
    ),
    (
        "sft-data-empty-prompt",
        f"{S0} --out <OUT> --data <F>/empty_prompt_sft.jsonl",
        r"1 of 2 prompts are not usable in <F>/empty_prompt_sft\.jsonl, e\.g\. row 2: 'prompt' is empty; --prompt-field "
        r"must name a column of non-empty strings or of chat messages with a user turn",
    ),
    # settings accepted silently or ending in a traceback
    (
        "dist-timeout-inf",
        f"{T0} --out <OUT> --dist-timeout inf",
        r"dist_timeout=inf must be > 0 and at most 1e\+09 seconds \(about 31 years: a larger wait overflows torch's "
        r"process-group timers\)",
    ),
    (
        "dist-timeout-nan",
        f"{T0} --out <OUT> --dist-timeout nan",
        r"dist_timeout=nan must be > 0 and at most 1e\+09 seconds .+",
    ),
    (
        "dist-timeout-huge",
        f"{T0} --out <OUT> --dist-timeout 1e15",
        r"dist_timeout=1000000000000000\.0 must be > 0 and at most 1e\+09 seconds .+",
    ),
    (
        "template-option-never-read",
        "train --student <F>/thinking --teacher <T> --out <OUT> --chat-template-kwargs '{\"enable_thinkin\": false}'",
        r"chat_template_kwargs: the chat template never reads 'enable_thinkin' \(the variables it reads: "
        r"enable_thinking\); " + NO_CHECK,
    ),
    (
        "eval-template-option-never-read",
        "eval --student <S> --out <OUT> --chat-template-kwargs '{\"enable_thinking\": false}'",
        r"chat_template_kwargs: the chat template never reads 'enable_thinking' \(the variables it reads: none\); "
        + NO_CHECK,
    ),
    (
        "no-eval-with-eval-every",
        "train --student <S> --teacher <T> --out <OUT> --no-eval --eval-every 5",
        r"eval_every=5 is set with evaluation off \(--no-eval\); drop one of them",
    ),
    # messages that named another problem
    (
        "vllm-url-port-out-of-range",
        f"{T0} --out <OUT> --rollout-engine vllm --vllm-url http://127.0.0.1:99999",
        r"--vllm-url 'http://127\.0\.0\.1:99999' has the port '99999'; a port is a number from 0 to 65535 \(e\.g\. "
        r"http://127\.0\.0\.1:8000\)",
    ),
    (
        "teacher-url-port-out-of-range",
        "train --student <S> --teacher-url http://127.0.0.1:99999 --out <OUT>",
        r"--teacher-url 'http://127\.0\.0\.1:99999' has the port '99999'; a port is a number from 0 to 65535 .+",
    ),
]


@pytest.mark.parametrize(("command", "pattern"), [c[1:] for c in OWNED], ids=[c[0] for c in OWNED])
def test_a_bad_out_or_data_is_refused_and_nothing_found_changes(
    command, pattern, tiny_models, found, tmp_path, monkeypatch, capsys
):
    student, teacher = tiny_models
    out = tmp_path / "out"
    places = {"S": student, "T": teacher, "F": found, "OUT": out}
    before = tree(found, student, teacher)
    check_case(monkeypatch, capsys, places, command, pattern)
    assert tree(found, student, teacher) == before
    # a new --out holds at most opd's marker, written before the data was read
    assert not out.exists() or [p.name for p in out.iterdir()] in ([], ["opd-run.json"])


def test_eval_out_that_cannot_be_written_is_refused_before_the_evaluation(tiny_models, tmp_path, monkeypatch, capsys):
    import opd.evaluation.model_eval as eval_mod
    import opd.runs.rundir as rundir_mod

    def read_only(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    loads = []
    monkeypatch.setattr(rundir_mod, "_atomic_write_text", read_only)  # what a read-only folder does, even as root
    monkeypatch.setattr(eval_mod, "load_model", lambda *a, **kw: loads.append(a))
    args = shlex.split(expand(E0, {"S": tiny_models[0]}, escape=False)) + ["--out", str(tmp_path / "ro")]
    code, out, err = run_opd(monkeypatch, capsys, args)
    pattern = rf"cannot write in --out {re.escape(str(tmp_path / 'ro'))} \(Permission denied\); choose a folder you can write to"
    assert_one_line_error(code, out, err, pattern)
    assert loads == []  # refused before the model loaded, so before any evaluation


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_is_refused(tiny_models, tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    args = shlex.split(expand(E0, {"S": tiny_models[0]}, escape=False)) + ["--out", str(ro)]
    code, out, err = run_opd(monkeypatch, capsys, args)
    assert_one_line_error(code, out, err, rf"cannot write in --out {re.escape(str(ro))} \(Permission denied\); .+")
    assert list(ro.iterdir()) == []


def test_a_task_left_out_of_evaluation_is_no_eval_every_contradiction():
    from opd.config import TrainConfig, resolve_tasks

    # the run's --eval-every is for the tasks that evaluate; one with eval: false is not refused for it
    cfg = TrainConfig.from_flat(teacher="t", eval_every=5, tasks=[{"name": "a", "eval": False}, {"name": "b"}])
    assert [(s.cfg.eval.eval, s.cfg.eval.eval_every) for s in resolve_tasks(cfg)] == [(False, 0), (True, 5)]
