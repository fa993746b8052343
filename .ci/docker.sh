# shellcheck shell=bash
# Docker for `cross build` (sourced by .ci/cross and .ci/cross-image, after .ci/lib.sh): a daemon,
# and the build image Cross.toml names.
#
# The image is made from Debian packages alone: cross's published images live in an image registry
# that CI cannot reach, and a Dockerfile would need a base image from one too. debootstrap writes a
# minimal Debian into a folder, apt installs the cross compilers in it, and `docker import` turns
# the folder into an image. It is tagged with a hash of its recipe (suite and packages) so a
# changed package list builds a new image and an unchanged one is reused, and also under the fixed
# name Cross.toml uses.

cross_image=edge-outbox-cross:bookworm
cross_image_suite=bookworm
# The C compilers and libc of both targets (rusqlite's bundled SQLite and ring compile C; gcc links),
# and the host's, for build scripts.
cross_image_packages="gcc libc6-dev pkg-config gcc-aarch64-linux-gnu libc6-dev-arm64-cross gcc-arm-linux-gnueabihf libc6-dev-armhf-cross"
cross_image_mirror=${EDGE_OUTBOX_DEBIAN_MIRROR:-http://deb.debian.org/debian}

# docker_up: succeeds once a docker daemon answers. Uses a running one; otherwise starts dockerd
# (Debian package docker.io) with settings that need no kernel overlay support and leave the
# machine's firewall and network interfaces alone: the builds need no network. The daemon started
# here is stopped by docker_down. On failure, says why on stderr.
docker_pid=
docker_up() {
    docker info >/dev/null 2>&1 && return 0
    command -v dockerd >/dev/null || apt_install docker.io || return 1
    local log=${TMPDIR:-/tmp}/edge-outbox-dockerd.log sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    # --group: the socket's group, so that cross, run by this user, may use a daemon root runs.
    "${sudo[@]}" dockerd --storage-driver=vfs --iptables=false --bridge=none --group "$(id -g)" \
        >"$log" 2>&1 &
    docker_pid=$!
    for _ in $(seq 120); do
        docker info >/dev/null 2>&1 && return 0
        if ! kill -0 "$docker_pid" 2>/dev/null; then
            docker_pid=
            echo "dockerd exited at start; the end of $log:" >&2
            tail -5 "$log" >&2
            return 1
        fi
        sleep 0.5
    done
    echo "dockerd (pid $docker_pid) did not answer within 60 s; the end of $log:" >&2
    tail -5 "$log" >&2
    docker_down
    return 1
}

# docker_down: stops the daemon docker_up started, if any, and waits for it to exit.
docker_down() {
    [ -n "$docker_pid" ] || return 0
    kill -TERM "$docker_pid" 2>/dev/null || true
    wait "$docker_pid" 2>/dev/null || true
    docker_pid=
}

cross_image_tag() {
    # shellcheck disable=SC2086 # a list of packages, one line each
    printf '%s\n' "$cross_image_suite" minbase $cross_image_packages | sha256sum |
        cut -c1-12 | sed 's/^/edge-outbox-cross:/'
}

# cross_image_build: makes sure $cross_image is the image of the current recipe, building it if no
# image with the recipe's tag exists.
cross_image_build() {
    local tag start=$SECONDS
    tag=$(cross_image_tag)
    if docker image inspect "$tag" >/dev/null 2>&1; then
        echo "cross image: $tag exists (recipe unchanged), not rebuilt"
    else
        echo "cross image: building $tag from Debian $cross_image_suite ($cross_image_mirror)"
        apt_install debootstrap
        # A subshell, so that the folder (a whole system) is removed however the build ends.
        (
            root=$(mktemp -d "${TMPDIR:-/tmp}/edge-outbox-cross-image.XXXXXX")
            log=$root.log
            trap 'as_root rm -rf "$root" "$log"' EXIT
            as_root debootstrap --variant=minbase "$cross_image_suite" "$root" "$cross_image_mirror" \
                >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
            as_root chroot "$root" sh -ec "
                export DEBIAN_FRONTEND=noninteractive
                apt-get update -q
                apt-get install -y -q --no-install-recommends $cross_image_packages
                apt-get clean
                rm -rf /var/lib/apt/lists/*" >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
            as_root tar -C "$root" -c . | docker import \
                --message "Debian $cross_image_suite minbase + $cross_image_packages (edge-outbox .ci/docker.sh)" \
                - "$tag" >/dev/null
        )
        echo "cross image: $tag built in $((SECONDS - start)) s"
    fi
    docker tag "$tag" "$cross_image"
}

# cross_image_tidy: removes what earlier recipes left: images of other edge-outbox-cross tags, and
# containers of the current image that a killed cross run did not remove (cross runs with --rm).
# The current image stays: it is the cache the next run reuses. Docker's vfs driver keeps a full
# copy of the image per container, so leftovers cost hundreds of MB each.
cross_image_tidy() {
    local current ref
    current=$(cross_image_tag)
    docker ps -aq --filter "ancestor=$cross_image" --filter status=exited | xargs -r docker rm >/dev/null
    docker image ls --format '{{.Repository}}:{{.Tag}}' edge-outbox-cross | while read -r ref; do
        case $ref in "$current" | "$cross_image") ;; *) docker image rm "$ref" >/dev/null ;; esac
    done
}
