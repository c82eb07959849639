"""Runs ON A NODE (python3, standard library only) beside a weights copy: keeps the copy's page cache small.

Sent as `python3 -c SOURCE ROOT LIFETIME` over the reconciler's SSH session to each end of the copy; its stdin is
its lifeline. Every INTERVAL it tells the kernel, for every regular file below ROOT, that the cached pages are not
needed (`posix_fadvise(POSIX_FADV_DONTNEED)`): clean pages leave the page cache at once; a file that grew is
written back first (`fdatasync`), so its pages leave too. When the lifeline closes it makes one last pass and exits 0.

Why: on a GB10 the CPU and the GPU share one pool, and what the GPU's driver calls free does not count page cache
the kernel could reclaim (vllm-project/vllm#35313). A 119 GB copy through the last ~20 GiB of a node would fill
that pool with cache beside a serving generation, whose runtime allocations then fail (NV_ERR_NO_MEMORY,
NVIDIA/dgx-spark-playbooks#97). Why this and not a cgroup bound (`systemd-run --user -p MemoryHigh=`): it needs
no systemd user manager with the memory controller delegated, no sudo and no cgroup v2, and it bounds both ends,
the reader's cache as well as the writer's (docs/weights-transport.md "Page cache").

It reads nothing, writes nothing and follows no link: each file is opened read-only with O_NOFOLLOW and
O_NONBLOCK (a FIFO someone left in the tree cannot block it), and any error on one file (gone, renamed by rsync,
unreadable) only skips that file. It prints `ready` once it made its first pass, and `passes N` at the end.
"""

from __future__ import annotations

import os
import select
import stat
import sys
import time

# seconds between passes: the cache a copy builds in between is bounded by its rate x this. 0.25, not 0.1: each
# pass waits for the writeback of what grew (`fdatasync`), and ten such waits a second on both ends cost the copy
# ~15% on the testbed (docs/weights-transport.md "Speed"); ~0.5 GB at a Spark's ~2 GB/s, of ~20 GiB left.
INTERVAL = 0.25
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def drop(root: str, sizes: dict[str, int]) -> None:
    """One pass: every regular file below `root` (links not followed) out of the page cache. A file that grew
    since the last pass is being written: its dirty pages are written back first (`fdatasync`, which waits for
    them, where DONTNEED alone only starts their writeback and leaves them cached), so a writer faster than the
    disk cannot pile up dirty cache between passes. `sizes` keeps each file's size from the last pass."""
    seen = {}
    for top, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(top, name)
            try:
                fd = os.open(path, _FLAGS)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    seen[path] = st.st_size
                    if sizes.get(path) != st.st_size:
                        os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
    sizes.clear()
    sizes.update(seen)


def main(argv: list[str]) -> int:
    try:
        root, lifetime = argv[0], float(argv[1])
    except (IndexError, ValueError) as exc:
        print(f"usage: ROOT LIFETIME ({exc})", file=sys.stderr)
        return 2
    end = time.monotonic() + lifetime
    stdin = sys.stdin.fileno()
    sizes: dict[str, int] = {}
    drop(root, sizes)
    print("ready", flush=True)
    passes = 1
    while time.monotonic() < end:
        ready, _, _ = select.select([stdin], [], [], INTERVAL)
        if ready and not os.read(stdin, 4096):
            break
        drop(root, sizes)
        passes += 1
    drop(root, sizes)  # what the copy wrote last, now written back by the step's `sync -f`
    print(f"passes {passes + 1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
