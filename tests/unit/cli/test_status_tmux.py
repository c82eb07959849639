"""Issue 33, finding 7, "checked under tmux at 80 and 200 columns": the real `reconciler status` in a real terminal
(a detached tmux session of that size, on a private socket), against the daemon's real listener serving recorded
documents (tests/unit/cli/test_status_client.py). What the pane shows is read back with `capture-pane -J`, which
joins a line the terminal had to wrap: a line longer than the pane is one that overflowed.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.proc import wait_for
from tests.unit.cli.test_status_client import WATCH_INTERVAL, Daemon, answering
from tests.unit.cli.test_status_view import fixture

HEIGHT = 50


class Tmux:
    """One tmux server of its own (`-S` socket in the test's directory), one session, no status line; the pane
    stays after its command ends (remain-on-exit), for its last screen. The command's exit status is written to a
    file by the shell that runs it: tmux 3.3a may leave a fast command unreaped, its `pane_dead_status` empty."""

    def __init__(self, tmp_path: Path) -> None:
        assert shutil.which("tmux"), "tmux is not installed: bash testbed/install-deps.sh (make test installs it)"
        self.socket = tmp_path / "tmux.sock"
        self.conf = tmp_path / "tmux.conf"
        self.conf.write_text("set -g remain-on-exit on\nset -g status off\nset -g history-limit 5000\n")
        self.status = tmp_path / "exit-status"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", str(self.socket), "-f", str(self.conf), *args], capture_output=True,
                              text=True, timeout=15, check=True).stdout

    def start(self, width: int, argv: list[str]) -> None:
        """`argv` in a new WIDTH x HEIGHT terminal, with a UTF-8 locale and no COLUMNS/LINES of the caller's. Its
        shell traps SIGINT (a trap, not an ignore, so the command still gets Ctrl-C) to outlive it and write the
        command's exit status."""
        command = ["env", "-u", "COLUMNS", "-u", "LINES", "LANG=C.UTF-8", "LC_ALL=C.UTF-8", *argv]
        script = shlex.join(["sh", "-c", 'trap : INT; "$@"; echo $? > "$0"', str(self.status), *command])
        self("new-session", "-d", "-s", "status", "-x", str(width), "-y", str(HEIGHT), script)
        assert self("display-message", "-p", "-t", "status", "#{pane_width}x#{pane_height}").strip() == \
            f"{width}x{HEIGHT}"

    def screen(self) -> list[str]:
        """The pane's lines, scrolled-off ones included, each wrapped line joined back into one."""
        return [line.rstrip() for line in self("capture-pane", "-p", "-J", "-S", "-", "-t", "status").splitlines()]

    def exit_status(self) -> int | None:
        written = self.status.read_text() if self.status.exists() else ""
        return int(written) if written.endswith("\n") else None

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", str(self.socket), "kill-server"], capture_output=True, timeout=15, check=False)


@pytest.fixture
def daemon(tmp_path) -> Iterator[Daemon]:
    with answering(tmp_path) as served:
        yield served


@pytest.fixture
def tmux(tmp_path) -> Iterator[Tmux]:
    t = Tmux(tmp_path)
    yield t
    t.kill()


def fits(lines: list[str], width: int) -> None:
    wider = [line for line in lines if len(line) > width]
    assert not wider, f"{len(wider)} lines wider than {width}: {wider}"


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("name", ["status-copying", "status-held"])
def test_status_fits_the_terminal(console_script, daemon, tmux, name, width):
    daemon.doc = fixture(name)
    tmux.start(width, [console_script, "status", "--url", daemon.url, "--state-dir", str(daemon.state_dir)])
    wait_for(lambda: tmux.exit_status() is not None, 15, "status to end")
    lines = tmux.screen()
    fits(lines, width)
    assert tmux.exit_status() == 2  # not converged
    text = "\n".join(lines)
    assert f"phase {daemon.doc['phase']}" in text and "Traceback" not in text
    for title in ("NODES", "CONDITIONS", "BLOCKERS"):
        assert title in lines
    held = list(daemon.doc["held"].values())
    reason = held[0].splitlines()[0] if held else daemon.doc["lastPlan"]["blocked"][0]["reason"]
    blocker = next(line for line in lines[lines.index("BLOCKERS"):] if reason[:30] in line)
    assert blocker.startswith("head  ")
    if width == 80:  # what does not fit ends with an ellipsis, inside the line
        assert blocker.endswith("…") and len(blocker) <= 80
    else:  # the same row, longer than 80 columns would allow
        assert len(blocker) > 80 and reason[:60] in blocker


def test_watch_redraws_in_place_follows_the_terminal_and_ends_on_ctrl_c(console_script, daemon, tmux):
    tmux.start(80, [console_script, "status", "--url", daemon.url, "--state-dir", str(daemon.state_dir), "--watch",
                    "--interval", WATCH_INTERVAL])
    wait_for(lambda: "phase Blocked" in "\n".join(tmux.screen()), 15, "the first frame")
    fits(tmux.screen(), 80)

    daemon.doc = fixture("status-syncing")
    wait_for(lambda: "phase Converging" in "\n".join(tmux.screen()), 15, "the next answer drawn")
    lines = tmux.screen()
    assert "phase Blocked" not in "\n".join(lines) and lines.count("NODES") == 1  # redrawn, not appended
    fits(lines, 80)

    tmux("resize-window", "-t", "status", "-x", "200", "-y", str(HEIGHT))
    message = next(c["message"] for c in daemon.doc["conditions"] if c["type"] == "WeightsInSync" and c["message"])
    wait_for(lambda: any(line.endswith(message) for line in tmux.screen()), 15, "a frame at 200 columns")
    fits(tmux.screen(), 200)

    daemon.stop()
    wait_for(lambda: f"cannot reach the daemon at {daemon.url}" in "\n".join(tmux.screen()), 15, "the error drawn")
    assert "phase Converging" in "\n".join(tmux.screen())  # its last answer, still shown under the error
    assert tmux.exit_status() is None  # and it keeps asking

    tmux("send-keys", "-t", "status", "C-c")
    wait_for(lambda: tmux.exit_status() is not None, 15, "the watch to end on Ctrl-C")
    assert tmux.exit_status() == 5  # the last frame's: nobody answered
    fits(tmux.screen(), 200)
