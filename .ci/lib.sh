# Shared by .ci/run and .ci/cross: root, apt packages, and the disk a CI machine may be short of.

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# apt_install PACKAGE...: installs the ones missing, refreshing the package lists only if needed.
apt_install() {
    local missing=() p
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ "${#missing[@]}" -eq 0 ] && return
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get install -y -q --no-install-recommends "${missing[@]}" ||
        { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends "${missing[@]}"; }
}

# The interoperability tests decode our CBOR with a non-Rust library and write through the SQL
# contract from Python.
python_cbor2() {
    python3 -c 'import cbor2' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check cbor2
}

# Disk. A CI run once died of "No space left on device" in its ARM stage, with about 10 GB of
# earlier stages' builds still on disk. A one-shot build gains nothing from incremental caches,
# and each stage deletes the build products no later stage needs. EDGE_OUTBOX_CI_KEEP_BUILDS=1
# keeps them, for a developer who runs CI in a working tree with a warm target dir.
export CARGO_INCREMENTAL=0
target_dir=${CARGO_TARGET_DIR:-target}
disk_free() { echo "disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free"; }
done_with() {
    [ "${EDGE_OUTBOX_CI_KEEP_BUILDS:-0}" = 1 ] || rm -rf "$@"
    disk_free
}
