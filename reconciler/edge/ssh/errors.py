"""What can go wrong talking to a node, as types: the loop decides by type (retry a transient one, stop and say
so for a host key), and every error names its node, so one node's trouble is that node's condition."""

from __future__ import annotations

import shlex
from collections.abc import Sequence


class RemoteError(Exception):
    """Something went wrong talking to a node; `node` says which."""

    transient = False

    def __init__(self, node: str, message: str):
        super().__init__(f"{node}: {message}")
        self.node = node
        self.message = message


class Unreachable(RemoteError):
    transient = True


class AuthFailed(RemoteError):
    pass


class HostKeyRejected(RemoteError):
    """Unknown or changed host key: a possible man in the middle, never retried automatically."""

    def __init__(self, node: str, message: str):
        # the kind leads the message: it is what /status, the Reachable condition and the alert show
        super().__init__(node, f"HostKeyRejected: {message}")


class CommandTimeout(RemoteError):
    transient = True


class Cancelled(RemoteError):
    """The caller asked the command to stop (shutdown); the channel was closed."""


class ChannelRefused(RemoteError):
    """sshd refused one more channel (MaxSessions, a jump host's policy): that command fails, the others on the
    connection go on."""

    transient = True


class OutputTooLarge(RemoteError):
    pass


class CommandFailed(RemoteError):
    def __init__(self, node: str, argv: Sequence[str], exit_code: int, stdout: str, stderr: str):
        detail = (stderr.strip() or stdout.strip())[-2000:]
        super().__init__(node, f"`{shlex.join(argv)}` exited {exit_code}: {detail}")
        self.argv, self.exit_code, self.stdout, self.stderr = list(argv), exit_code, stdout, stderr
