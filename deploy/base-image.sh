#!/usr/bin/env bash
# Makes the base image deploy/Dockerfile names (debian:<release>-slim) without an image
# registry: debootstraps a minimal Debian of that release from Debian's own mirror and
# imports it under exactly that name and tag, so the Dockerfiles build unchanged.
#
#     sudo deploy/base-image.sh           # a no-op when the image is already there
#     sudo deploy/base-image.sh --force   # make it again
#
# Needs root, a Docker engine, Debian's mirror (DEBIAN_MIRROR, default
# http://deb.debian.org/debian) and debootstrap (Debian's package).
# Prints the image's name.
set -euo pipefail
cd "$(dirname "$0")/.."

force=
case ${1:-} in
    --force) force=1 ;;
    "") ;;
    *) echo "usage: deploy/base-image.sh [--force]" >&2; exit 2 ;;
esac

# The runtime's base: the first `FROM debian:...` of the Dockerfile.
image=$(sed -n 's/^FROM[[:space:]]\+\(debian:[^[:space:]]\+\).*/\1/p' deploy/Dockerfile | head -n1)
[[ -n $image ]] || { echo "deploy/Dockerfile names no debian image" >&2; exit 1; }
tag=${image#debian:}
suite=${tag%-slim}
if [[ -z $force ]] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "$image"
    exit 0
fi

command -v debootstrap >/dev/null 2>&1 || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

root=$(mktemp -d)
# debootstrap mounts /proc and /sys inside the new root while it installs: a run that
# failed half way may leave them mounted, and removing the tree must not reach into them.
cleanup() {
    awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
    rm -rf --one-file-system "$root"
}
trap cleanup EXIT
debootstrap --variant=minbase "$suite" "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2
# As the registry's slim images: no downloaded packages or package lists.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" --numeric-owner -c . | docker import --change 'CMD ["bash"]' - "$image" >/dev/null
echo "$image"
