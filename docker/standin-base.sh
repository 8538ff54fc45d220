#!/usr/bin/env bash
# A stand-in for the NGC base image, built on this machine from Debian's packages, for building
# and running the real Dockerfile where nvcr.io cannot be reached (CI: tests/launch/test_container_image.py).
# Debian minbase (debootstrap) with Python 3 and a virtual environment at /opt/venv, first on
# PATH, so that `python` and `pip` are what they are in NGC's image; no torch (the Dockerfile
# installs a CPU build when given TORCH_VERSION). Root only (debootstrap, chroot); a couple of
# minutes, most of it debootstrap.
#
#   docker/standin-base.sh                      # -> localhost/iga-ds-standin-base:bookworm-1
#   IGA_ENGINE=docker docker/standin-base.sh my/base:tag
#
# Variables: IGA_ENGINE (podman, the default, or docker: imports the root filesystem),
# IGA_STANDIN_SUITE (bookworm), IGA_STANDIN_MIRROR (http://deb.debian.org/debian).
set -euo pipefail

tag=${1:-localhost/iga-ds-standin-base:bookworm-1}
engine=${IGA_ENGINE:-podman}
suite=${IGA_STANDIN_SUITE:-bookworm}
mirror=${IGA_STANDIN_MIRROR:-http://deb.debian.org/debian}
if [[ $(id -u) != 0 ]]; then
    echo "standin-base.sh: needs root (debootstrap and chroot)" >&2
    exit 2
fi
for tool in debootstrap "$engine"; do
    if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1; then
        echo "standin-base.sh: $tool not installed (.ci/system-deps installs it)" >&2
        exit 2
    fi
done

work=$(mktemp -d "${TMPDIR:-/var/tmp}/iga-ds-standin.XXXXXX")
cleanup() {
    # debootstrap mounts /proc and /sys in the new root while it works; a run cut short can
    # leave them there, and rm must never walk into the machine's own /proc
    local mounts
    mounts=$(awk -v root="$work/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r)
    if [[ -n $mounts ]]; then xargs -r umount -l <<<"$mounts" || true; fi
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT
rootfs="$work/rootfs"

PATH="$PATH:/usr/sbin:/sbin" debootstrap --variant=minbase --include=python3-venv "$suite" "$rootfs" "$mirror"
chroot "$rootfs" python3 -m venv /opt/venv
# the image carries no package lists or downloaded packages
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin
tar -C "$rootfs" --numeric-owner --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* -c . |
    "$engine" import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' - "$tag"
echo "standin-base.sh: imported $tag ($suite minbase, Python 3 in /opt/venv)"
