"""Runs ON THE TARGET NODE (python3, standard library only): make a model tree's links, as the verified manifest says.

Sent as `python3 -c SOURCE ROOT` over the reconciler's SSH session; stdin carries one `PATH\\0VALUE\\0` pair per
link, each already checked on the head (`weights.links_to_make`: a path inside the tree, a relative value that
stays inside it by its text). Why the reconciler makes the links and rsync does not: no link ever crosses the
rsync daemon (`rsyncd_helper`), because the daemon's only confinement without a chroot is rsync's path
sanitising, and through 3.4.1 a link planted by one stream carried a later stream's write out of the module.

Each directory on the way is opened relative to the last with O_NOFOLLOW (made 0755 when missing), so a link on the
way is refused, never followed; the link is made under a temporary name and renamed over the old entry (a file, a
link with another value); an existing directory at the path is refused. Prints `made N`; exits 1 when any link
could not be made (each named on stderr), 2 on bad arguments.
"""

from __future__ import annotations

import os
import stat
import sys

TEMP_SUFFIX = ".spark-reconciler-link"


def parent_fd(root_fd: int, parts: list[str]) -> int:
    """An fd of the directory holding the link, walked from the root without following any link."""
    fd = os.dup(root_fd)
    for name in parts:
        try:
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            os.mkdir(name, 0o755, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def make(root_fd: int, path: str, value: str) -> None:
    *dirs, name = path.split("/")
    if not name or any(p in ("", ".", "..") for p in dirs + [name]) or not value or value.startswith("/"):
        raise ValueError("not a relative link inside the tree")
    fd = parent_fd(root_fd, dirs)
    try:
        try:
            if os.readlink(name, dir_fd=fd) == value:
                return
        except FileNotFoundError:
            pass
        except OSError:  # not a link: a directory is refused, a file is replaced
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise IsADirectoryError("a directory is there") from None
        temp = name + TEMP_SUFFIX
        try:
            os.unlink(temp, dir_fd=fd)
        except FileNotFoundError:
            pass
        os.symlink(value, temp, dir_fd=fd)
        os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: ROOT (PATH\\0VALUE\\0 pairs on stdin)", file=sys.stderr)
        return 2
    fields = sys.stdin.buffer.read().split(b"\0")
    pairs = [(fields[i].decode(), fields[i + 1].decode()) for i in range(0, len(fields) - 1, 2)]
    root_fd = os.open(argv[0], os.O_RDONLY | os.O_DIRECTORY)
    failed = 0
    for path, value in pairs:
        try:
            make(root_fd, path, value)
        except (OSError, ValueError) as exc:
            failed += 1
            print(f"{path} -> {value}: {exc}", file=sys.stderr)
    print(f"made {len(pairs) - failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
