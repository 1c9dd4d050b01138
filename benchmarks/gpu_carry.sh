#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.py on an offline GPU machine, downloaded here into .gpu_wheels/.
#
# The GPU machine has torch (CUDA), transformers 5.17, peft, accelerate, numpy, rich, typer, pyyaml,
# safetensors, tokenizers, matplotlib, fsspec, xxhash, pyarrow, h11 and anyio, and no network. opd
# needs transformers >= 5.24 and a few pure-Python packages more; they are downloaded here (no
# dependencies resolved: the list is explicit) for Python 3.12 on x86_64 Linux.
#
#   .gpu_wheels/*.whl         always installed: transformers (this venv's version), math-verify and its
#                             parser (latex2sympy2_extended, antlr4-python3-runtime), datasets with dill
#                             and multiprocess, starlette, uvicorn, and TRL (GOLD, for the experiments that
#                             compare with it: benchmarks/gpu_experiments.sh)
#   .gpu_wheels/compat/*.whl  installed only if `import transformers` fails after that: the versions of
#                             huggingface-hub (+ httpx2, httpcore2, truststore), tokenizers, safetensors
#                             and regex that transformers 5.24 checks for at import. The machine's image
#                             (/work/.library/device/KINDS.md, 2026-11: huggingface_hub 1.33.0, tokenizers
#                             0.23.2, safetensors 0.8.0) already satisfies it, so this is a fallback only.
#
# The image also has pandas (datasets imports it). The printed command installs nothing: it unpacks
# the wheels into /tmp/gpu_site and puts that and src/ first on PYTHONPATH (opd runs from the tree,
# `python -m opd`; subprocesses and torchrun's ranks inherit it).
#
# Usage (repository root, dev venv active): bash benchmarks/gpu_carry.sh   -- then run the printed command there.
set -euo pipefail
cd "$(dirname "$0")/.."

# the versions to carry are those of the dev environment (activate it first: source /work/venv/bin/activate)
PY=${PYTHON:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/}python}
echo "versions from $("$PY" -c 'import sys; print(sys.executable)')"
ver() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
TRANSFORMERS=$(ver transformers 2>/dev/null || echo 5.24.0)
MATH_VERIFY=$(ver math-verify 2>/dev/null || echo 0.9.0)
L2S=$(ver latex2sympy2_extended 2>/dev/null || echo 1.11.0)
DATASETS=$(ver datasets 2>/dev/null || echo 5.2.0)
# antlr4: the runtime latex2sympy2_extended's parser was generated for (its pin: <=4.13.2)
ANTLR=$(ver antlr4-python3-runtime 2>/dev/null || echo 4.13.2)

rm -rf .gpu_wheels
mkdir -p .gpu_wheels/compat
platform=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 --only-binary=:all:)
dl() { pip download -q --no-deps "${platform[@]}" -d "$@"; }

dl .gpu_wheels \
  "transformers==$TRANSFORMERS" \
  "math-verify==$MATH_VERIFY" \
  "latex2sympy2_extended==$L2S" \
  "antlr4-python3-runtime==$ANTLR" \
  "datasets==$DATASETS" \
  "dill==$(ver dill 2>/dev/null || echo 0.4.1)" \
  "multiprocess==$(ver multiprocess 2>/dev/null || echo 0.70.19)" \
  "starlette==$(ver starlette 2>/dev/null || echo 1.10.0)" \
  "uvicorn==$(ver uvicorn 2>/dev/null || echo 0.54.0)" \
  "trl==$(ver trl 2>/dev/null || echo 1.16.0)"

# abi3 / cp312 binaries for the fallback (platform tags above)
dl .gpu_wheels/compat \
  "huggingface-hub==$(ver huggingface_hub 2>/dev/null || echo 2.4.0)" \
  "httpx2==$(ver httpx2 2>/dev/null || echo 2.16.2)" \
  "httpcore2==$(ver httpcore2 2>/dev/null || echo 2.16.2)" \
  "truststore==$(ver truststore 2>/dev/null || echo 0.10.4)" \
  "tokenizers==$(ver tokenizers 2>/dev/null || echo 0.23.3)" \
  "safetensors==$(ver safetensors 2>/dev/null || echo 0.8.0)" \
  "regex==$(ver regex 2>/dev/null || echo 2026.11.19)"

echo "downloaded:"
ls -l .gpu_wheels .gpu_wheels/compat | awk '/\.whl$/ {printf "  %7.2f MB  %s\n", $5 / 1e6, $9}'
total=$(du -cb .gpu_wheels/*.whl .gpu_wheels/compat/*.whl | tail -1 | cut -f1)
echo "total: $(awk -v b="$total" 'BEGIN {printf "%.1f MB", b / 1e6}') (.gpu_wheels, carried with run(carry=[\".gpu_wheels\"]))"
if [ "$total" -gt 25000000 ]; then
  echo "gpu_carry.sh: over the 25 MB budget" >&2
  exit 1
fi

# the machine gets a copy of the working tree without .git: the commit travels in the command
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit+dirty"

echo
echo "Command for the GPU machine (repository root), run with carry [\".gpu_wheels\"] and timeout_s 600 (all the gpu"
echo "tests take longer than one command: --only picks files, docs/development.md \"On a GPU\"). The wheels are unpacked into /tmp/gpu_site, first on PYTHONPATH (no pip, no write to"
echo "the machine's environment; unpacked wheels keep their .dist-info, so transformers' version checks see them):"
echo
cat <<EOF
export PYTHONPATH=/tmp/gpu_site:\$PWD/src OPD_COMMIT=$commit; for w in .gpu_wheels/*.whl; do python3 -m zipfile -e "\$w" /tmp/gpu_site; done; python3 -c "import transformers" 2>/dev/null || for w in .gpu_wheels/compat/*.whl; do python3 -m zipfile -e "\$w" /tmp/gpu_site; done; python3 benchmarks/gpu_check.py --only env,losses,train --out \$OUT/gpu_check.json
EOF
