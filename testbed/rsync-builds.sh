#!/usr/bin/env bash
# The rsync daemons the confinement test (tests/unit/steps/test_rsyncd_confinement.py) runs the one-time daemon's helper
# against, besides the installed one: the versions real targets run, with their known escapes.
#   3.2.7  Debian 12's own build 3.2.7-1+deb12u6 (Ubuntu 24.04, DGX OS's base, ships a 3.2.7), from Debian's archive
#   3.4.1  upstream 3.4.1 (Debian's orig tarball, sha256-pinned), built here: the version whose daemon let a client
#          holding the secret write outside the module through a planted link (CVE-2026-53785)
# Both land in $RSYNC_BUILDS (default /var/cache/spark-reconciler/rsync/VERSION/rsync). Idempotent: nothing is
# downloaded when both are there. Downloads come only from Debian's archive (a registry, like apt itself).
set -euo pipefail

DEST=${RSYNC_BUILDS:-/var/cache/spark-reconciler/rsync}
MIRROR=http://deb.debian.org/debian/pool/main/r/rsync
TARBALL=rsync_3.4.1+ds1.orig.tar.xz
TARBALL_SHA256=bb9e2dda7e79d9639bc04bdafff6bb0b06a606ed915358b574696384215c9e5c
DEB_VERSION=3.2.7-1+deb12u6

if [ -x "$DEST/3.2.7/rsync" ] && [ -x "$DEST/3.4.1/rsync" ]; then
    echo "rsync-builds.sh: 3.2.7 and 3.4.1 already in $DEST"
    exit 0
fi
work=$(mktemp -d)
chmod 755 "$work"  # apt-get download runs as _apt
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST/3.2.7" "$DEST/3.4.1"

if [ ! -x "$DEST/3.2.7/rsync" ]; then
    (cd "$work" && apt-get download -q "rsync=$DEB_VERSION" >/dev/null)
    dpkg-deb -x "$work"/rsync_*.deb "$work/deb"
    install -m 755 "$work/deb/usr/bin/rsync" "$DEST/3.2.7/rsync"
fi

if [ ! -x "$DEST/3.4.1/rsync" ]; then
    curl -fsS --retry 3 -o "$work/$TARBALL" "$MIRROR/$TARBALL"
    echo "$TARBALL_SHA256  $work/$TARBALL" | sha256sum -c --quiet
    tar -C "$work" -xf "$work/$TARBALL"
    # Debian's +ds1 tarball drops the bundled zlib and popt: build against the system's (libpopt-dev, zlib1g-dev)
    (cd "$work/rsync-3.4.1" && mkdir -p zlib popt && touch zlib/dummy.in popt/dummy.in \
        && ./configure -q --with-included-zlib=no --with-included-popt=no --disable-md2man --disable-xxhash \
           --disable-zstd --disable-lz4 --disable-openssl >/dev/null 2>&1 \
        && make -j"$(nproc)" rsync >/dev/null 2>&1)
    install -m 755 "$work/rsync-3.4.1/rsync" "$DEST/3.4.1/rsync"
fi
# sed reads the whole output: `head -1` exits after a line, and rsync's next write then dies of SIGPIPE (pipefail: 141)
"$DEST/3.2.7/rsync" --version | sed -n 1p
"$DEST/3.4.1/rsync" --version | sed -n 1p
