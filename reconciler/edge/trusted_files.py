"""The local files the reconciler trusts: only their owner (root or the reconciler's own user) may change them.

Whoever can write the desired-state file is root on every node (it says what runs there, trust section and all);
whoever can write an identity file or a known_hosts file can impersonate the reconciler or a node. So, as sshd's
StrictModes does for authorized_keys, each such file and every directory above it must be owned by root or by the
user the reconciler runs as, and writable by nobody else. A world-writable directory with the sticky bit that
root owns (/tmp) is accepted: nobody else can rename or remove the entries in it that are not theirs.

An identity file is a private key besides: whoever can read it is the reconciler on every node. So it must be
accessible by its owner alone, as ssh demands of every key it loads (OpenSSH `sshkey_perm_ok`: any of the 077
bits and the key "will be ignored"). paramiko, which loads it here, checks no mode at all.
"""

from __future__ import annotations

import getpass
import os
import pwd
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from reconciler.core import envfile, spec
from reconciler.core.spec import Desired

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_NOT_THE_OWNER = stat.S_IRWXG | stat.S_IRWXO  # ssh's 077


@dataclass(frozen=True)
class Trusted:
    """A file the reconciler trusts; `private`: a private key, which its owner alone may even read."""

    path: Path
    private: bool = False

    def __str__(self) -> str:
        return str(self.path)


def trusted_paths(desired: Desired, desired_path: str | Path) -> list[Trusted]:
    """The desired-state file, and every node's known_hosts file and identity file (deduplicated, in order; a
    path named as a key anywhere is checked as a key)."""
    out = [Trusted(Path(desired_path))]
    for node in desired.nodes:
        out.append(Trusted(Path(node.ssh.known_hosts)))
        if node.ssh.identity_file:
            out.append(Trusted(Path(node.ssh.identity_file), private=True))
    private = {t.path.absolute() for t in out if t.private}
    return [Trusted(p, p in private) for p in dict.fromkeys(t.path.absolute() for t in out)]


def _problem(path: Path, st: os.stat_result, uid: int, what: str) -> str | None:
    if st.st_uid not in (0, uid):
        return f"{path}: {what} is owned by uid {st.st_uid}, not root or the reconciler's user (uid {uid})"
    if st.st_mode & _OTHERS_WRITE:
        sticky_root_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid == 0
        if not sticky_root_dir:
            return (f"{path}: {what} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod go-w")
    return None


def _key_problem(path: Path, st: os.stat_result) -> str | None:
    """A private key anyone but its owner may read (or write, or run): ssh would ignore it; here it is refused."""
    if not st.st_mode & _NOT_THE_OWNER:
        return None
    who = "others" if st.st_mode & stat.S_IRWXO else "its group"
    return (f"{path}: the private key is accessible by {who} (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 "
            "(ssh ignores such a key: \"UNPROTECTED PRIVATE KEY FILE\")")


def problems(paths: Sequence[Path | Trusted], uid: int | None = None,
             lstat: Callable[[Path], os.stat_result] = os.stat) -> list[str]:
    """Why each path (or a directory above it) can be changed by someone other than root and `uid`, and why a
    private key among them can be read by anyone else. A missing file is not reported here: loading it says so."""
    uid = os.geteuid() if uid is None else uid
    out: list[str] = []
    for entry in paths:
        path, private = (entry.path, entry.private) if isinstance(entry, Trusted) else (entry, False)
        try:
            st = lstat(path)
        except OSError:
            continue
        if (p := _problem(path, st, uid, "the file") or (_key_problem(path, st) if private else None)) is not None:
            out.append(p)
        for parent in path.parents:
            try:
                pst = lstat(parent)
            except OSError:
                continue
            if (p := _problem(parent, pst, uid, f"a directory above {path.name}")) is not None:
                out.append(p)
                break
    return list(dict.fromkeys(out))


#: The shipped unit's `User=` (systemd/reconciler.service): whose files are judged when root checks them.
UNIT_USER = "spark"


def daemon_user(name: str | None = None) -> tuple[str, int]:
    """The user the daemon runs as, and its uid: `name`; else whoever runs this, but as root the shipped unit's
    user (root runs `doctor` and `validate` to read the environment file; the daemon's key is that user's, not
    root's). KeyError for a user that does not exist."""
    if name is not None:
        return name, pwd.getpwnam(name).pw_uid
    euid = os.geteuid()
    if euid == 0:
        try:
            return UNIT_USER, pwd.getpwnam(UNIT_USER).pw_uid
        except KeyError:
            return "root", 0
    return getpass.getuser(), euid


class EnvironmentFileError(Exception):
    """The environment file named cannot be used: missing, unreadable, or open to others."""


@dataclass(frozen=True)
class Secrets:
    """Where the values of serving.secrets come from: `environ` (the environment file's values over this process's
    environment, as systemd sets them over the unit's) and `where`, said when a name is missing."""

    environ: Mapping[str, str]
    where: str


def secrets_environment(path: Path, explicit: bool, base: Mapping[str, str],
                        uid: int | None = None) -> Secrets:
    """The values the commands take serving.secrets from. The file is read as systemd reads it (core.envfile) and
    wins over the caller's shell, so `plan` compares the daemon's values, not a stale export. A file anyone but its
    owner (root or us) may change, or anyone at all may read, is refused (it holds the keys). The default file
    missing or unreadable falls back to the environment alone (a testbed, a user without access), saying so;
    a file named with --env-file must be there."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise EnvironmentFileError(f"{path}: not a regular file")
        if unsafe := problems([path], uid):
            raise EnvironmentFileError("; ".join(unsafe))
        if st.st_mode & stat.S_IRWXO:
            raise EnvironmentFileError(f"{path}: the environment file is readable by others (mode "
                                       f"{stat.S_IMODE(st.st_mode):04o}); it holds the secrets: chmod o-rwx {path}")
        values = envfile.parse(path.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        if explicit:
            raise EnvironmentFileError(f"{path}: {exc.strerror} (--env-file)") from None
        return Secrets(base, f"this process's environment ({path}: {exc.strerror})")
    return Secrets({**base, **values}, f"{path} or this process's environment")


def load(path: str | Path, secrets: Secrets | None, uid: int | None = None) -> tuple[Desired | None, list[str]]:
    """The desired state as the daemon takes it, or every reason it cannot (one line each, placed): the file's own
    problems, each secret `secrets` lacks, and each trusted file someone other than root or `uid` (default: this
    process's user; `validate` as root passes the daemon's, `daemon_user`) may change. With `secrets=None`
    (validate --skip-secrets, export, sudoers) the secrets and the trust are not judged."""
    try:
        if secrets is None:
            return spec.load(path), []
        desired = spec.load(path, secrets.environ, where=secrets.where)
    except spec.InvalidDesiredState as exc:
        return None, exc.lines()
    unsafe = problems(trusted_paths(desired, path), uid)
    return (None, unsafe) if unsafe else (desired, [])


def load_text(text: str, path: str | Path, secrets: Secrets, read_from: Path, uid: int | None = None
              ) -> tuple[Desired | None, list[str]]:
    """A kept generation's text (reconciler.loop.history), read from `read_from`, judged as `load` judges the file
    at `path`: its own problems, the secrets it names, the files it trusts, and `read_from` itself (and the
    directories above it), which is then as much the desired state as the file. A rollback brings back only what
    would be taken today."""
    try:
        desired = spec.loads(text, str(path)).with_secrets(secrets.environ)
    except spec.InvalidDesiredState as exc:
        return None, exc.lines()
    except spec.MissingSecrets as exc:
        return None, [f"{name} is not set in {secrets.where} (or holds a control character)"
                      for name in exc.names + exc.unusable]
    unsafe = problems([Trusted(Path(read_from)), *trusted_paths(desired, path)], uid)
    return (None, unsafe) if unsafe else (desired, [])
