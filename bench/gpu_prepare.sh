#!/usr/bin/env bash
# Builds .gpu/ (git-ignored), what bench/gpu_env.sh installs on a lent GPU machine: .gpu/whl holds the wheels,
# for that machine's Python (3.12, x86-64), of the packages this project needs beyond its image (which has
# PyTorch, numpy, PyYAML, networkx, rich, typer), at the versions of this checkout's .venv, and
# .gpu/fashion-mnist the Debian package's Fashion-MNIST files. A new checkout has no .gpu/; run this once
# before the first `run` of a session (pip download needs the package registry, about 4 MB):
#
#   bash bench/gpu_prepare.sh
#
# Then every call carries .gpu (`carry: [".gpu"]`). docs/results/runs/ (over 100 MB of committed evidence)
# would take the working tree that travels past its 64 MiB: take it out of the index for the call and put
# it back after (bench/reproduce/README.md, "On a lent GPU").
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
PKGS="pydantic pydantic-core annotated-types typing-inspection typing-extensions greenlet isal"
pins=$("$PY" - $PKGS <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
EOF
)
rm -rf .gpu/whl && mkdir -p .gpu/whl .gpu/fashion-mnist
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64; do
  plat+=(--platform "$p")
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${plat[@]}" -d .gpu/whl $pins
src=${FMNIST_DIR:-/usr/share/datasets/fashion-mnist}
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  [ -f "$src/$f" ] || { echo "gpu_prepare.sh: $src/$f: missing (make data installs it)" >&2; exit 1; }
  cp "$src/$f" .gpu/fashion-mnist/
done
echo "gpu_prepare.sh: .gpu/ holds $(ls .gpu/whl | wc -l) wheels ($pins) and Fashion-MNIST, $(du -sh .gpu | cut -f1) in all"
