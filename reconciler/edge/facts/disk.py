"""Room on a node's disks: free bytes and the filesystem where the weights and the images go (`disk_fact`), the
room at one path (`avail_fact`), and where paths lead on the node (`canonical_fact`)."""

from __future__ import annotations

from reconciler.edge.facts.base import Fact, ProbeError, Section, node_output
from reconciler.edge.facts.containers import DOCKER_SOCKET
from reconciler.edge.ssh import quote, quote_word


def disk_script(weights_path: str) -> list[str]:
    """The `disk` section: free bytes where the weights go (the model path, or its nearest existing parent: a
    first copy creates it) and where docker keeps images (its data root, from the engine's /info), one
    `weights`/`image` line of `df -P -B1` each: its free bytes (`parse_disk`) and the filesystem it is on
    (`parse_disk_fs`: both on one filesystem share its room). Needs `containers_script`'s socket line before."""
    return ["sec disk",
            f"p={quote_word(weights_path)}; while [ ! -e \"$p\" ] && [ \"$p\" != / ]; do p=$(dirname -- \"$p\"); "
            "done; printf 'weights '; df -P -B1 -- \"$p\" 2>/dev/null | tail -n 1; "
            "r=$(curl -sf --unix-socket \"$sock\" http://docker/info 2>/dev/null | "
            "grep -o '\"DockerRootDir\":\"[^\"]*\"' | cut -d '\"' -f 4); "
            "[ -n \"$r\" ] || r=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null); "
            "if [ -n \"$r\" ]; then printf 'image '; df -P -B1 -- \"$r\" 2>/dev/null | tail -n 1; fi; "
            "rc 0"]


@node_output("disk")
def parse_disk(sec: Section | None) -> dict[str, int] | None:
    """`weights`/`image` -> free bytes, from `df -P` rows (`FS 1-blocks Used Available Capacity Mount`); a line
    df did not complete is left out (not known)."""
    if sec is None or sec.rc != 0:
        return None
    free = {}
    for line in sec.body.splitlines():
        what, _, row = line.partition(" ")
        cols = row.split()
        if what not in ("weights", "image"):
            if line.strip():
                raise ValueError(f"not a df line: {line[:80]!r}")
            continue
        if not cols:
            continue  # df did not answer for it
        if len(cols) < 6 or not cols[3].isdigit():
            raise ValueError(f"not a `df -P -B1` row: {row[:80]!r}")
        free[what] = int(cols[3])
    return free


@node_output("disk")
def parse_disk_fs(sec: Section | None) -> dict[str, str] | None:
    """`weights`/`image` -> the filesystem its `df -P` row is on (`NodeObservation.disk_fs`): the row's device
    when it names a device node (`/dev/nvme0n1p2`: a bind mount of it is the same filesystem, so the same room),
    else its mount point (`tmpfs`, `overlay`: a name many filesystems share). On DGX OS the model path and
    docker's data root are both on the one NVMe's `/`: one room for both copies. The rows `parse_disk` reads."""
    if parse_disk(sec) is None:
        return None
    assert sec is not None
    where_on = {}
    for line in sec.body.splitlines():
        what, _, row = line.partition(" ")
        cols = row.split()
        if what in ("weights", "image") and cols:
            device, mount = cols[0], " ".join(cols[5:])  # a mount point may hold spaces; df's last column
            where_on[what] = device if device.startswith("/dev/") else mount
    return where_on


def parse_avail(sec: Section | None) -> int | None:
    """`df --output=avail`'s number (None: df did not say)."""
    words = sec.body.split() if sec is not None and sec.rc == 0 else []
    return int(words[-1]) if words and words[-1].isdigit() else None


def avail_fact(path: str) -> Fact[int | None]:
    """Bytes available to the SSH user on the filesystem of `path` (a failed copy's explanation)."""
    return Fact(f"df {path}", ("sec avail", f"df -B1 --output=avail {quote_word(path)} 2>/dev/null; rc $?"),
                lambda sections: parse_avail(sections.get("avail")))


@node_output("realpath")
def parse_canonical(sec: Section | None, count: int) -> list[str]:
    """`realpath -m`'s answer, one line per path asked, in order; anything else is a ProbeError."""
    if sec is None or sec.rc != 0:
        raise ProbeError(f"realpath failed: {sec.body.strip()[-200:] if sec else 'no answer'}")
    lines = sec.body.splitlines()
    if len(lines) != count:
        raise ProbeError(f"`realpath` answered {len(lines)} lines for {count} paths")
    return lines


def canonical_fact(paths: list[str]) -> Fact[list[str]]:
    """The node's own answer to where each path leads (`realpath -m`: symlinks, `.` and `..` resolved; a path
    that does not exist yet resolves as far as it does)."""
    return Fact("realpath", ("sec realpath", f"realpath -m -- {quote(paths)} 2>&1; rc $?"),
                lambda sections: parse_canonical(sections.get("realpath"), len(paths)))


def disk_fact(weights_path: str) -> Fact[tuple[dict[str, int] | None, dict[str, str] | None]]:
    """Free bytes and filesystems where the weights (at `weights_path`) and the images go, as the probe reads
    them: (`parse_disk`, `parse_disk_fs`) of one `disk` section."""
    def parse(sections: dict[str, Section]) -> tuple[dict[str, int] | None, dict[str, str] | None]:
        return parse_disk(sections.get("disk")), parse_disk_fs(sections.get("disk"))
    return Fact("disk", (DOCKER_SOCKET, *disk_script(weights_path)), parse)
