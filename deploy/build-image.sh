#!/usr/bin/env bash
# Builds the compose file's two local images from a pdmesh binary built on this host,
# with no image registry and no Rust toolchain image:
#   pdmesh:local             deploy/Dockerfile's `prebuilt` target around BINARY
#   pdmesh-prometheus:local  deploy/prometheus/Dockerfile (Debian's prometheus package)
#
#     cargo build --release -p pdmesh-cli
#     deploy/build-image.sh target/release/pdmesh
#
# The base image must exist (deploy/base-image.sh makes it). Uses the classic builder,
# which every engine has: it builds `runtime-base` and `prebuilt` and stops there.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${1:-target/release/pdmesh}
[[ -x $bin ]] || { echo "no pdmesh binary at $bin (cargo build --release -p pdmesh-cli)" >&2; exit 1; }

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
# The build context is the binary alone.
install -m 0755 "$bin" "$ctx/pdmesh"
# The two at once: each spends most of its time downloading Debian packages.
DOCKER_BUILDKIT=0 docker build -q -f deploy/Dockerfile --target prebuilt -t pdmesh:local "$ctx" >/dev/null &
pdmesh=$!
DOCKER_BUILDKIT=0 docker build -q -t pdmesh-prometheus:local deploy/prometheus >/dev/null &
prometheus=$!
failed=0
wait "$pdmesh" || { echo "building pdmesh:local failed" >&2; failed=1; }
wait "$prometheus" || { echo "building pdmesh-prometheus:local failed" >&2; failed=1; }
((failed == 0)) || exit 1
echo pdmesh:local pdmesh-prometheus:local
