"""Exit codes: one table for every command, a contract with the scripts and CI jobs that run them (docs/cli.md).

Terraform's `-detailed-exitcode` is the convention operators already script against: 0 nothing to do, 1 an error
of any kind, 2 changes pending. A Python crash exits 1 (the interpreter's own code) and so does a usage error
(click's 2 is remapped, as Terraform also says 1 for a bad flag), so no failure can ever read as "changes pending".
The outcomes a script must tell apart from a plain error get codes of their own above 2, the same in every command.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0  #: nothing to do: no changes, converged, valid, all match
    ERROR = 1  #: an error of any kind not below: a crash, a usage error, a step failed, apply did not converge
    CHANGES = 2  #: differences found: plan or apply --dry-run has changes pending, verify found differing files,
    #: status reports a phase other than Converged
    INVALID = 3  #: the desired-state file, its secrets (the environment file) or a given snapshot are unusable
    HELD = 4  #: another actor holds the cluster's lease (the daemon, an apply): nothing was changed
    UNREACHABLE = 5  #: a node could not be reached over SSH (or, for `status`, the daemon's listener)


#: The table docs/cli.md shows, in words (tests/unit/cli/test_exit_codes.py keeps the two in step).
MEANING = {
    Exit.OK: "success: no changes, converged, valid, every file matches",
    Exit.ERROR: "an error of any kind (a crash, a bad option, a failed step, not converged, a doctor check failed)",
    Exit.CHANGES: "differences: changes pending (plan, apply --dry-run), files differ (verify), not converged (status)",
    Exit.INVALID: "the desired-state file, a secret it names or a given snapshot is invalid or missing",
    Exit.HELD: "another actor (the daemon, an apply) holds the cluster's lease: nothing changed",
    Exit.UNREACHABLE: "a node (status: the daemon) could not be reached",
}
