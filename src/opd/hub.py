"""Names on the Hugging Face Hub, resolved to local folders: the one place opd turns ``--student
Qwen/Qwen3-1.7B`` or ``--task openai/gsm8k`` into files.

Order, for every name opd takes: a local path wins (a folder, a file, a glob); otherwise the name
is read as a Hub repository id (``ORG/NAME``, or a bare ``NAME``) and resolved through
huggingface_hub's cache (``HF_HOME``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` honoured): online it
downloads what the cache lacks (``snapshot_download``), offline it reads the cached snapshot of the
revision asked for (``refs/<revision>`` -> ``snapshots/<hash>/``). A name that is neither is one
``UserError`` naming the cache and the ``hf download`` command that fills it. Datasets given by name
are read with ``datasets.load_dataset`` online; offline, the Hub cache's snapshot of the dataset is
read as a folder of data files (datasets 5.2's own offline mode finds only data sets it prepared
itself, not a snapshot from ``hf download``), then datasets' own cache.

``trust_remote_code`` stays off: a model whose config maps its classes to the repository's own code
(``auto_map``) and a dataset with a loading script are refused, naming them. Where opd is not the
user's tool (vLLM engines, a served teacher) they are given the resolved folder, so every part of a
run reads the same files.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from opd.errors import UserError

# A Hub repository id: ORG/NAME or NAME, letters, digits, '-', '_', '.' (huggingface_hub's own rule).
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# A missing "data.jsonl" is a mistyped file, not a repository: its error stays the file's.
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv", ".txt", ".yaml", ".yml", ".safetensors")


def looks_like_repo_id(name: str) -> bool:
    """Could ``name`` be a Hub repository id (as opposed to only a path)?"""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.lower().endswith(_FILE_SUFFIXES)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def download_command(repo_id: str, revision: str = "", repo_type: str = "model") -> str:
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    return f"hf download {repo_id}{kind}" + (f" --revision {revision}" if revision else "")


def _not_found(what: str, repo_id: str, revision: str, repo_type: str, why: str) -> UserError:
    """``what`` names the option (``student model (--student)``), or is the whole subject of the sentence
    when it names the other readings of the name too (ending in "no local path, ...")."""
    rev = f" at revision {revision!r}" if revision else ""
    where = "offline (HF_HUB_OFFLINE=1)" if offline() else "on the Hub"
    subject = what if "no local path" in what else f"{what} {repo_id!r} is no local path"
    return UserError(
        f"{subject}, and the Hub {repo_type} {repo_id}{rev} is not in the cache "
        f"{cache_dir()} and could not be fetched {where} ({why}); fetch it where the network allows with "
        f"`{download_command(repo_id, revision, repo_type)}` (same HF_HOME), or give a local path"
    )


@lru_cache(maxsize=64)
def snapshot(repo_id: str, revision: str = "", repo_type: str = "model", what: str = "model") -> Path:
    """The local folder of a Hub repository at ``revision`` (default: main), from the cache or fetched."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision or None, repo_type=repo_type)
    except LocalEntryNotFoundError:
        raise _not_found(what, repo_id, revision, repo_type, "not cached") from None
    except HFValidationError as e:
        raise UserError(f"{what} {repo_id!r} is neither a local path nor a Hub repository id ({e})") from None
    except Exception as e:  # noqa: BLE001 - network, auth, missing revision: the user needs one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _not_found(what, repo_id, revision, repo_type, f"{type(e).__name__}: {first}") from None
    return Path(path)


def resolve_model(name: str | Path, revision: str = "", what: str = "model") -> Path:
    """A model (or tokenizer) folder: ``name`` itself when it exists locally, else its Hub snapshot.

    A name that is not a folder and cannot be a repository id is returned as given, for the caller's
    own "does not exist" message (it knows the option and the role)."""
    p = Path(name)
    if p.exists() or not looks_like_repo_id(str(name)):
        if revision and p.exists():
            raise UserError(
                f"{what} {p} is a local folder, and a revision ({revision!r}) applies to a Hub name only; "
                "drop the revision, or check out that revision into the folder"
            )
        return p
    folder = snapshot(str(name), revision, "model", what)
    refuse_remote_code_model(folder, str(name))
    return folder


def refuse_remote_code_model(folder: Path, name: str) -> None:
    """A model whose classes live in its repository's own Python files needs trust_remote_code: refused."""
    import json

    config = folder / "config.json"
    try:
        auto_map = json.loads(config.read_text()).get("auto_map") if config.is_file() else None
    except (OSError, ValueError):
        return  # the loader's own checks name a broken config
    if auto_map:
        code = sorted({str(v).split(".")[0] + ".py" for v in auto_map.values() if isinstance(v, str)})
        raise UserError(
            f"model {name} runs its own code ({', '.join(code) or 'auto_map in config.json'}), which needs "
            "trust_remote_code; opd keeps it off: use a model that transformers supports natively"
        )


def load_hub_dataset(repo_id: str, config: str = "", revision: str = "", what: str = "--task") -> dict[str, Any]:
    """``split name -> datasets.Dataset`` of a Hub dataset (see the module docstring for the order);
    ``what``: the option, or the subject of the "not found" sentence (see :func:`_not_found`)."""
    import datasets

    name = config or None
    if offline():
        try:
            folder = snapshot(repo_id, revision, "dataset", what if "no local path" in what else f"{what} dataset")
        except UserError as missing:
            return _prepared_offline(repo_id, name, revision, missing)
        _refuse_script(folder, repo_id)
        return _load(lambda: datasets.load_dataset(str(folder), name), repo_id, config)
    return _load(lambda: datasets.load_dataset(repo_id, name, revision=revision or None), repo_id, config)


def _prepared_offline(repo_id: str, name: str | None, revision: str, missing: UserError) -> dict[str, Any]:
    """datasets' own cache (a data set ``load_dataset`` prepared earlier), when the Hub cache has none."""
    import datasets

    try:
        return dict(datasets.load_dataset(repo_id, name, revision=revision or None))
    except Exception:  # noqa: BLE001 - not prepared either: the Hub cache's error says what to do
        raise missing from None


def _load(read: Any, repo_id: str, config: str) -> dict[str, Any]:
    try:
        return dict(read())
    except ValueError as e:
        text = str(e)
        if "config" in text.lower() and ("missing" in text.lower() or "available" in text.lower()):
            raise UserError(f"dataset {repo_id}: {text.splitlines()[0]}; name one as {repo_id}:CONFIG") from None
        raise UserError(f"could not read the dataset {repo_id} ({type(e).__name__}: {text.splitlines()[0]})") from None
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one line
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "script" in text.lower():
            raise UserError(
                f"dataset {repo_id} is built by a loading script, which needs trust_remote_code; opd keeps it off "
                "(and datasets 5 runs no scripts): use a copy of it in data files (parquet, JSON)"
            ) from None
        raise UserError(f"could not read the dataset {repo_id} ({type(e).__name__}: {text})") from None


def _refuse_script(folder: Path, repo_id: str) -> None:
    script = folder / f"{repo_id.split('/')[-1]}.py"
    if script.is_file() and not any(folder.rglob("*.parquet")) and not any(folder.rglob("*.json*")):
        raise UserError(
            f"dataset {repo_id} is built by a loading script ({script.name}), which needs trust_remote_code; opd "
            "keeps it off: use a copy of it in data files (parquet, JSON)"
        )


def split_config(spec: str) -> tuple[str, str]:
    """``NAME:CONFIG`` -> (NAME, CONFIG); a plain name has no config."""
    name, _, config = spec.partition(":")
    return name, config
