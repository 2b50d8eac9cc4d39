#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine: install Debian's docker.io and docker-compose
# when they are missing (apt, as root), start dockerd in the background when nothing listens on its
# socket, and wait (bounded) until `docker info` answers. Idempotent: a running engine is left alone.
#
# The daemon is started the way our CI machines allow: vfs storage (no overlayfs in the sandbox), no
# default bridge and no iptables rules (containers use the host network, so no private address range
# is ever routed). Its log goes to ${DOCKERD_LOG:-/var/log/p2pfl-dockerd.log}.
set -euo pipefail

WAIT_S="${DOCKER_WAIT_S:-60}"
LOG="${DOCKERD_LOG:-/var/log/p2pfl-dockerd.log}"

say() { echo "engine: $*" >&2; }

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
if [ "${#need[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || { say "missing ${need[*]} and no apt-get to install them"; exit 1; }
  say "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 $SUDO apt-get install -y -qq "${need[@]}" >/dev/null \
    || { timeout 300 $SUDO apt-get update -qq && timeout 600 $SUDO apt-get install -y -qq "${need[@]}" >/dev/null; }
fi

if timeout 20 docker info >/dev/null 2>&1; then
  exit 0
fi

# A daemon killed with its machine session leaves its pid file behind, and a new dockerd refuses
# to start while it exists: remove pid files whose process is gone.
for pidfile in /var/run/docker.pid /var/run/docker/containerd/containerd.pid; do
  if [ -f "$pidfile" ]; then
    pid=$(cat "$pidfile" 2>/dev/null || true)
    # not `kill -0`: the number may since belong to another process, or to a thread of one
    comm=$(cat "/proc/${pid:-0}/comm" 2>/dev/null || true)
    if [ -z "$pid" ] || { [ "$comm" != dockerd ] && [ "$comm" != containerd ]; }; then
      say "removing stale $pidfile (pid ${pid:-?} is not running)"
      $SUDO rm -f "$pidfile"
    fi
  fi
done

say "starting dockerd (vfs storage, host networking only); log: $LOG"
# setsid: the daemon outlives this script and is not killed with make's process group.
$SUDO setsid dockerd --storage-driver=vfs --bridge=none --iptables=false --ip6tables=false \
  >>"$LOG" 2>&1 < /dev/null &
for _ in $(seq "$WAIT_S"); do
  if timeout 10 docker info >/dev/null 2>&1; then
    say "dockerd is up"
    exit 0
  fi
  sleep 1
done
say "dockerd did not answer within ${WAIT_S}s; last lines of $LOG:"
tail -n 20 "$LOG" >&2 || true
exit 1
