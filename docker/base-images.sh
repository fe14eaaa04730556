#!/usr/bin/env bash
# Local base images made from Debian packages, for machines that cannot pull from Docker Hub
# (the air-gapped path of docs/deployment-docker.md). Each image is built only when it is not
# there yet, so a second run costs nothing (KVSERVE_BASE_REBUILD=1 builds them again).
#
#   docker/base-images.sh                 # both images
#   docker build --build-arg PYTHON_IMAGE=kvserve-base/python:bookworm ...
#   KVSERVE_NGINX_IMAGE=kvserve-base/nginx:bookworm docker compose up
#
# kvserve-base/python:bookworm  stands in for python:3.11-slim: Debian's python3 (3.11) with a
#                               venv at /opt/venv first on PATH (so `pip install` needs no root
#                               site-packages and `python`/`pip` are the venv's)
# kvserve-base/nginx:bookworm   stands in for nginx:1.27-alpine: Debian's nginx, wget (the
#                               compose healthcheck) and gettext's envsubst; its entrypoint
#                               (docker/nginx-entrypoint.sh) renders templates like the official
#                               image's does
#
# Needs root, mmdebstrap, a Debian mirror (apt's own, deb.debian.org by default) and a Docker
# engine. Env: DOCKER (client, default `docker`), KVSERVE_PYTHON_BASE / KVSERVE_NGINX_BASE (tags),
# KVSERVE_DEBIAN_SUITE (bookworm), KVSERVE_DEBIAN_MIRROR (default: mmdebstrap's).
set -euo pipefail
cd "$(dirname "$0")/.."

docker=${DOCKER:-docker}
suite=${KVSERVE_DEBIAN_SUITE:-bookworm}
python_tag=${KVSERVE_PYTHON_BASE:-kvserve-base/python:$suite}
nginx_tag=${KVSERVE_NGINX_BASE:-kvserve-base/nginx:$suite}
mirror=()
[[ -n "${KVSERVE_DEBIAN_MIRROR:-}" ]] && mirror=("$KVSERVE_DEBIAN_MIRROR")

log() { echo "base-images: $*" >&2; }

have() { [[ "${KVSERVE_BASE_REBUILD:-0}" != 1 ]] && "$docker" image inspect "$1" >/dev/null 2>&1; }

# debootstrap the rootfs as a tarball on stdout; the apt lists and caches are left out
rootfs() {  # rootfs PACKAGES [mmdebstrap options...]
    local pkgs=$1; shift
    mmdebstrap --quiet --variant=minbase --include="$pkgs" \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
        "$@" "$suite" - "${mirror[@]}"
}

path=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

if have "$python_tag"; then
    log "$python_tag exists"
else
    log "building $python_tag"
    rootfs python3,python3-venv,ca-certificates,passwd \
        --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
        | "$docker" import \
            --change "ENV PATH=$path" \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["python3"]' \
            - "$python_tag" >/dev/null
fi

if have "$nginx_tag"; then
    log "$nginx_tag exists"
else
    log "building $nginx_tag"
    rootfs nginx,gettext-base,wget,ca-certificates \
        --customize-hook='copy-in docker/nginx-entrypoint.sh /usr/local/bin' \
        --customize-hook='chmod 0755 "$1"/usr/local/bin/nginx-entrypoint.sh' \
        --customize-hook='ln -sf /dev/stdout "$1"/var/log/nginx/access.log' \
        --customize-hook='ln -sf /dev/stderr "$1"/var/log/nginx/error.log' \
        | "$docker" import \
            --change 'ENTRYPOINT ["/usr/local/bin/nginx-entrypoint.sh"]' \
            --change 'CMD ["nginx", "-g", "daemon off;"]' \
            --change 'EXPOSE 80' \
            - "$nginx_tag" >/dev/null
fi
"$docker" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' |
    grep -F -e "$python_tag" -e "$nginx_tag" >&2
