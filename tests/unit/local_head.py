"""A head on this machine, for the lease's tests: what the SSH session does with a script or a companion, done by
the real `sh` (with the real flock, timeout, cat and date) in a HOME of its own. Only the SSH hop is left out.

`date_offset` puts a `date` first on the PATH that answers as a clock stepped by that many seconds would: a head
whose clock was stepped between two actors' visits."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from reconciler.edge.ssh import CommandTimeout, Result, bounded


class LocalHead:
    def __init__(self, home: Path, date_offset: int = 0):
        self.home = home
        self.path = "/usr/bin:/bin"
        self.companions: list[LocalCompanion] = []
        if date_offset:
            bin_dir = home.parent / f"clock{date_offset:+d}"
            bin_dir.mkdir(exist_ok=True)
            real = shutil.which("date")
            (bin_dir / "date").write_text(f'#!/bin/sh\nexec {real} -d "@$(( $({real} +%s) + {date_offset} ))" "$@"\n')
            (bin_dir / "date").chmod(0o755)
            self.path = f"{bin_dir}:{self.path}"

    def __getitem__(self, node):
        return self

    @property
    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "PATH": self.path}

    def run_script(self, script, timeout, cancel=None):
        p = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=timeout,
                           env=self.env, check=False)
        return Result(p.stdout, p.stderr, p.returncode)

    @contextlib.contextmanager
    def companion(self, argv, *, timeout, stdin, open_timeout) -> Iterator[LocalCompanion]:
        """As `Session.companion`: bounded on the "node", given `stdin`, whose end is the companion's signal; the
        block's end closes it (the channel's close)."""
        proc = subprocess.Popen(bounded(list(argv), timeout), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self.env, start_new_session=True)
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.flush()
        companion = LocalCompanion(proc)
        self.companions.append(companion)
        try:
            yield companion
        finally:
            companion.hang_up()


class LocalCompanion:
    """`ssh.Companion`'s interface over a local process: its lines, its end."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.out = b""

    def line(self, timeout: float) -> str | None:
        """The next stdout line; None once it ended without one; CommandTimeout when none came within `timeout`."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.out:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise CommandTimeout("head", "the companion said nothing within the deadline")
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.out += chunk
        line, _, self.out = self.out.partition(b"\n")
        return line.decode(errors="replace")

    def end(self, timeout: float) -> Result:
        """Close its stdin and wait for it to end."""
        self.hang_up()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        code = self.proc.wait(timeout)
        return Result((self.out + self.proc.stdout.read()).decode(), self.proc.stderr.read().decode(), code)

    def hang_up(self) -> None:
        """What sshd does when the holder's connection closes (it ended, was killed, or lost the network): the
        companion's stdin ends."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def kill(self) -> None:
        """The companion's whole process group killed outright (no cleanup of its own)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait_ended(self, timeout: float = 10) -> int:
        return self.proc.wait(timeout)


def hang_up(*heads: LocalHead) -> None:
    """End every companion the heads started (a test's teardown: no flock holder outlives its test)."""
    for head in heads:
        for companion in head.companions:
            companion.hang_up()
            companion.wait_ended()
