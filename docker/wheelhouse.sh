#!/usr/bin/env bash
# Fill docker/wheelhouse/ on the host with every wheel the peer image needs, so `docker build` installs
# with `pip --no-index` and needs no network at all (our CI machines reach package registries only
# from the host). Versions follow the project venv when there is one (`pip freeze` as constraints),
# so the image runs what the tests ran. Idempotent: pip skips wheels already there.
#
#   docker/wheelhouse.sh [TORCH_VERSION]      (default 2.13.0: the CPU wheel in this machine's cache)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${1:-${TORCH_VERSION:-2.13.0}}"
PIP="${PIP:-.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"
OUT=docker/wheelhouse
mkdir -p "$OUT"

req="$(mktemp)"; cons="$(mktemp)"
trap 'rm -f "$req" "$cons"' EXIT
# --flower: the wheels of both image variants (the default one and the ClientApp one, FLOWER=1)
python3 docker/peer_requirements.py --flower > "$req"
# Build backend of the p2pfl package itself (pip builds it from source inside the image).
printf 'setuptools>=68\nwheel\n' >> "$req"
if [ -x .venv/bin/pip ]; then
  .venv/bin/pip freeze --exclude-editable | grep -v -i -E '^(torch|torchvision|p2pfl)' > "$cons" || true
fi
echo "wheelhouse: torch==$TORCH_VERSION + $(grep -c . "$req") requirements into $OUT" >&2
timeout 900 $PIP download -q --only-binary=:all: -d "$OUT" -c "$cons" "torch==$TORCH_VERSION" -r "$req" \
  2> >(grep -v "is ignored: it is neither" >&2)
# The PyPI name of torch's CPU build carries a local version (+cpu): refuse a CUDA wheel here, which
# would pull gigabytes of nvidia-* wheels into a CPU image.
if ls "$OUT"/nvidia_* >/dev/null 2>&1; then
  echo "wheelhouse: CUDA libraries found in $OUT: torch==$TORCH_VERSION is not a CPU wheel here" >&2
  exit 1
fi
du -sh "$OUT" >&2
