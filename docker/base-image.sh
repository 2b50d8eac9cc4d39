#!/usr/bin/env bash
# Make the local base image the peer image builds FROM, without pulling from any registry:
# `debootstrap --variant=minbase bookworm` (Debian's own packages: python3 with venv/ensurepip,
# and dataset-fashion-mnist so the default experiments need no download), then `docker import`.
# Cached: does nothing when the image already exists (P2PFL_BASE_REBUILD=1 forces a rebuild).
#
#   docker/base-image.sh [IMAGE]        (default p2pfl-base:bookworm; needs root and a running engine)
set -euo pipefail

IMAGE="${1:-p2pfl-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3,python3-venv,dataset-fashion-mnist"

say() { echo "base-image: $*" >&2; }

# Bumped when the recipe changes, so a cached image made by an older recipe is rebuilt.
RECIPE=2
if [ "${P2PFL_BASE_REBUILD:-0}" != 1 ] && [ "$(docker image inspect -f '{{index .Config.Labels "org.p2pfl.base-recipe"}}' \
    "$IMAGE" 2>/dev/null)" = "$RECIPE" ]; then
  say "$IMAGE exists (cached)"
  exit 0
fi
[ "$(id -u)" = 0 ] || { say "debootstrap needs root"; exit 1; }
if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq debootstrap >/dev/null
fi

ROOTFS="$(mktemp -d /tmp/p2pfl-rootfs.XXXXXX)"
trap 'rm -rf --one-file-system "$ROOTFS"' EXIT
say "debootstrap minbase bookworm ($PACKAGES) into $ROOTFS"
timeout 1200 debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOTFS" "$MIRROR" \
  >"$ROOTFS.log" 2>&1 || { tail -n 30 "$ROOTFS.log" >&2; exit 1; }
rm -f "$ROOTFS.log"
# mktemp -d made the root 0700: the image's / must be 0755, or nothing is reachable for the non-root peer.
chmod 0755 "$ROOTFS"
# Smaller image: no apt lists, caches, docs or man pages (the dataset under /usr/share/datasets stays).
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/usr/share/doc/* \
  "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/*
say "importing as $IMAGE"
tar -C "$ROOTFS" -c . | timeout 900 docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' --change "LABEL org.p2pfl.base-recipe=$RECIPE" - "$IMAGE" >/dev/null
say "made $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE") bytes)"
