"""SSH to the nodes: the only package that talks SSH, and the only place that quotes remote commands.

- `commands`: the command line a node receives: quoting, the node-side deadline, the exact sudo commands;
- `errors`: what can go wrong, as types the loop decides by;
- `session`: one persistent paramiko session per node (host-key policy, jump hosts, channels under deadlines, the
  one read loop) and the pool of them, which also gives a node over another of its fabric addresses (`via`).

The names below are the package's interface; the rest of the reconciler imports them from here.
"""

from reconciler.edge.ssh.commands import (
    ENDED_BY_TIMEOUT,
    KILL_AFTER,
    bounded,
    quote,
    quote_word,
    sudo_allowed,
    sudo_argv,
    sudo_commands,
    sudoers_line,
    sudoers_snippet,
)
from reconciler.edge.ssh.errors import (
    AuthFailed,
    Cancelled,
    ChannelRefused,
    CommandFailed,
    CommandTimeout,
    HostKeyRejected,
    OutputTooLarge,
    RemoteError,
    Unreachable,
)
from reconciler.edge.ssh.hop import ISOLATION, fabric_host_keys, hop_address, hop_options
from reconciler.edge.ssh.session import (
    KEEPALIVE,
    KEEPALIVE_MISSES,
    MAX_CHANNELS,
    MAX_OUTPUT,
    REFUSAL_GAP,
    REFUSAL_RETRIES,
    Companion,
    Result,
    Session,
    Sessions,
    answer_deadline,
    node_deadline,
    via,
)

__all__ = ["ENDED_BY_TIMEOUT", "ISOLATION", "KEEPALIVE", "KEEPALIVE_MISSES", "KILL_AFTER", "MAX_CHANNELS",
           "MAX_OUTPUT", "REFUSAL_GAP", "REFUSAL_RETRIES", "AuthFailed", "Cancelled", "ChannelRefused",
           "CommandFailed", "CommandTimeout", "Companion", "HostKeyRejected", "OutputTooLarge", "RemoteError",
           "Result", "Session", "Sessions", "Unreachable", "answer_deadline", "bounded", "fabric_host_keys",
           "hop_address", "hop_options", "node_deadline", "quote", "quote_word", "sudo_allowed", "sudo_argv",
           "sudo_commands", "sudoers_line", "sudoers_snippet", "via"]
