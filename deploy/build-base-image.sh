#!/usr/bin/env bash
# Build specd-base:bookworm, a minimal Debian bookworm image with Python 3.11, for machines
# that can reach a Debian mirror and PyPI but no Docker image registry (so python:3.11-slim
# cannot be pulled). deploy/Dockerfile takes it via --build-arg BASE_IMAGE=specd-base:bookworm
# (compose: SPECD_BASE_IMAGE=specd-base:bookworm).
#
#   deploy/build-base-image.sh            # build once; a no-op when the image exists
#   FORCE=1 deploy/build-base-image.sh    # rebuild
#
# Settings (environment): IMAGE (default specd-base:bookworm), MIRROR (default: the first
# Debian mirror in /etc/apt/sources.list*, else http://deb.debian.org/debian), SUITE
# (bookworm), EXTRA_CA_DIR (default /usr/local/share/ca-certificates: *.crt files there are
# added to the image's trust store, because behind a TLS-intercepting egress proxy pip inside
# the containers must trust the same CA as the host; EXTRA_CA_DIR= adds none).
# Needs root, debootstrap and a running Docker engine.
set -euo pipefail

IMAGE=${IMAGE:-specd-base:bookworm}
SUITE=${SUITE:-bookworm}
EXTRA_CA_DIR=${EXTRA_CA_DIR-/usr/local/share/ca-certificates}
PACKAGES=python3,python3-venv,python3-pip,ca-certificates

if [[ -z "${FORCE:-}" ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE exists (FORCE=1 rebuilds it)"
  exit 0
fi

if [[ -z "${MIRROR:-}" ]]; then
  # The mirror apt already uses here: deb822 "URIs:" lines or one-line "deb URL suite" entries.
  MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
           | grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ' || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

command -v debootstrap >/dev/null || { echo "error: debootstrap not found (apt-get install -y debootstrap)" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "error: no Docker engine reachable (start dockerd)" >&2; exit 1; }

ROOTFS=$(mktemp -d /tmp/specd-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR"

# Same mirror inside the image, so `apt-get install` works in derived images (e.g. deploy/prometheus).
printf 'deb %s %s main\ndeb %s %s-updates main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" > "$ROOTFS/etc/apt/sources.list"

shopt -s nullglob
cas=("${EXTRA_CA_DIR:-/nonexistent}"/*.crt)
if (( ${#cas[@]} )); then
  echo "adding ${#cas[@]} CA certificate(s) from $EXTRA_CA_DIR"
  cp "${cas[@]}" "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates >/dev/null
fi

# Keep it small: no apt caches or lists, no docs or man pages.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*

tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  - "$IMAGE"
docker image ls "$IMAGE"
