#!/usr/bin/env bash
# Container entrypoint: run this container's peer with `p2pfl node`, or the container HEALTHCHECK.
#
#   (no arguments) / --set K=V ...   p2pfl node for $P2PFL_PEER (the arguments are passed on)
#   node [ARGS...]                   the same
#   --healthcheck                    exit 0 if this peer's gRPC health service reports SERVING
#                                    (python -m p2pfl.health: imports neither torch nor Flower)
#   anything else                    run it (`bash`, `p2pfl ...`), or as a p2pfl subcommand (`certs ...`)
#
# The peer's identity and paths come from the environment (docker-compose.yml made by `p2pfl compose`
# sets them), so the HEALTHCHECK, which runs as a separate process, derives the same values:
#   P2PFL_PEER (required)  P2PFL_PORT (50051)  P2PFL_CONFIG (/p2pfl/config.yaml)
#   P2PFL_CERTS (/p2pfl/certs)  P2PFL_RUN_DIR (/p2pfl/run)  P2PFL_INSECURE (0: mutual TLS)
#   P2PFL_METRICS_PORT (unset: no /metrics)  P2PFL_METRICS_HOST (127.0.0.1)
# Misconfigurations (missing certificates, unreadable keys, unwritable run folder) are reported
# here in plain words before Python starts, with the fix.
set -euo pipefail

: "${P2PFL_CONFIG:=/p2pfl/config.yaml}"
: "${P2PFL_CERTS:=/p2pfl/certs}"
: "${P2PFL_RUN_DIR:=/p2pfl/run}"
: "${P2PFL_PORT:=50051}"
: "${P2PFL_INSECURE:=0}"

die() {
  echo "p2pfl-entrypoint: $*" >&2
  exit 1
}

is_true() {
  case "${1,,}" in
    1 | true | yes | on) return 0 ;;
    *) return 1 ;;
  esac
}

healthcheck() {
  [ -n "${P2PFL_PEER:-}" ] || die "P2PFL_PEER is not set: no peer to check"
  # python -m p2pfl.health: grpc and cryptography only (no CLI, no torch), cheap enough to run every 15 s
  if is_true "$P2PFL_INSECURE"; then
    exec python3 -m p2pfl.health "127.0.0.1:${P2PFL_PORT}" --insecure
  fi
  exec python3 -m p2pfl.health "127.0.0.1:${P2PFL_PORT}" --certs "$P2PFL_CERTS" --peer "$P2PFL_PEER"
}

check_cert_file() {
  local path="$1"
  if [ -d "$path" ]; then
    die "$path is a folder, not a file: the host file did not exist when the container was created, so docker made a folder in its place. On the host: remove that folder, run 'p2pfl certs --config CONFIG --out certs', then 'docker compose up -d' again."
  fi
  [ -f "$path" ] || die "$path not found: make the certificates on the host with 'p2pfl certs --config CONFIG --out certs' (or run with P2PFL_INSECURE=1 for plaintext, debugging only)"
  [ -r "$path" ] || die "cannot read $path as uid $(id -u): key files are mode 0600 and owned by whoever ran 'p2pfl certs'. Run compose as that user (export P2PFL_UID=\$(id -u) P2PFL_GID=\$(id -g) on the host before 'docker compose up')."
}

run_node() {
  [ -n "${P2PFL_PEER:-}" ] || die "set P2PFL_PEER to this container's peer id (the docker-compose.yml written by 'p2pfl compose' does)"
  [ -f "$P2PFL_CONFIG" ] || die "experiment config $P2PFL_CONFIG not found: mount it there (the generated docker-compose.yml does)"
  [ -r "$P2PFL_CONFIG" ] || die "cannot read $P2PFL_CONFIG as uid $(id -u)"
  local args=(node --config "$P2PFL_CONFIG" --peer "$P2PFL_PEER" --out "$P2PFL_RUN_DIR")
  if is_true "$P2PFL_INSECURE"; then
    echo "p2pfl-entrypoint: P2PFL_INSECURE is set: plaintext gRPC, no peer authentication" >&2
    args+=(--insecure)
  else
    local f
    for f in ca.crt "${P2PFL_PEER}.crt" "${P2PFL_PEER}.key"; do
      check_cert_file "${P2PFL_CERTS}/${f}"
    done
    args+=(--certs "$P2PFL_CERTS")
  fi
  if [ -n "${P2PFL_METRICS_PORT:-}" ]; then
    args+=(--metrics-port "$P2PFL_METRICS_PORT" --metrics-host "${P2PFL_METRICS_HOST:-127.0.0.1}")
  fi
  mkdir -p "$P2PFL_RUN_DIR" 2>/dev/null || true
  if ! [ -d "$P2PFL_RUN_DIR" ] || ! [ -w "$P2PFL_RUN_DIR" ]; then
    die "run folder $P2PFL_RUN_DIR is not writable as uid $(id -u): on the host, create it as the user compose runs as (p2pfl compose does) or export P2PFL_UID/P2PFL_GID to its owner's ids"
  fi
  echo "p2pfl-entrypoint: p2pfl ${args[*]} $*" >&2
  exec p2pfl "${args[@]}" "$@"
}

case "${1:-}" in
  --healthcheck) healthcheck ;;
  "" | -*) run_node "$@" ;;
  node)
    shift
    run_node "$@"
    ;;
  *)
    if command -v "$1" >/dev/null 2>&1; then
      exec "$@"
    fi
    exec p2pfl "$@"
    ;;
esac
