"""Runs ON A NODE (python3, standard library only): the weights copy's paths, never through a link on the way.

Sent as `python3 -c SOURCE ...` over the reconciler's SSH session, in one of three ways:

- `ROOT` (on the target): make a model tree's links, as the verified manifest says. stdin carries one
  `PATH\\0VALUE\\0` pair per link, each already checked on the head (`weights.links_to_make`: a path inside the
  tree, a relative value that stays inside it by its text). Why the reconciler makes the links and rsync does not:
  no link ever crosses the rsync daemon (`rsyncd_helper`), because the daemon's only confinement without a chroot
  is rsync's path sanitising, and through 3.4.1 a link planted by one stream carried a later stream's write out of
  the module. The link is made under a temporary name and renamed over the old entry (a file, a link with another
  value); an existing directory at the path is refused. Prints `made N`.
- `send INSTRUCTIONS rsync ARGS...` (on the source): hold open exactly the directories the listing checked, check
  each file in them once more, then become the stream's rsync (exec), reading each file through the directory it
  holds (issue 53, finding A). The copy used to name the checked links to `rsync --copy-links`, which resolved each
  link again when it read it: whoever could write the hub's blob store swapped a store file, or a directory on the
  way, for a link to `~/.ssh/id_ed25519` between the check and the read, and the key landed in the worker's tree.
  And a regular (no `-L`) run follows a directory on the way too: only the last component is opened with
  O_NOFOLLOW. INSTRUCTIONS (a file the head wrote in the SSH user's own 0700 directory, relative to $HOME) holds
  NUL-separated records of four fields: `P FD ROOT DIR`, a directory to hold on descriptor FD (the canonical ROOT
  the listing printed, the tree's or the hub's blob store's, walked from `/`, then DIR below it, no link followed
  anywhere: a link there now is a change since the listing); and `F FD NAME SIZE`, a file in it that must still be
  a regular file of SIZE bytes. rsync's own list (its `--files-from`, written here, never by anyone else) names
  `FD/NAME` below `/proc/self/fd/`: the kernel resolves `FD` to the directory held, whatever was renamed or swapped
  since (rsync 3.5 walks its path again, link by link with O_NOFOLLOW, which refuses a swap as well), and rsync
  opens `NAME` with O_NOFOLLOW. On the target the files arrive under STAGING as `FD/NAME` (`receive` moves them).
  Exits CHANGED when anything differs from the listing (each named on stderr; nothing is sent), 64 on bad input.
- `receive ROOT LIFETIME` (on the target, beside the copy, like the page-cache bound): stdin carries a line with a
  byte count, then that many bytes of `STAGED\\0PATH\\0` pairs, then stays open as the lifeline. It makes ROOT (as
  `mkdir -p`), STAGING below it and each staged directory in it, never through a link, removes whatever link or
  special file is below STAGING (rsync's receiver must never write through one), and prints `ready`. Then every
  INTERVAL it moves each file that arrived (rsync renames a file to its name only once it is whole) from
  STAGING/STAGED to PATH in the tree (a regular file only; a second path of the same file gets a hard link), so a
  copy interrupted half-way has its whole files at their paths, as before. When the lifeline closes: a last look,
  the staging directories left empty removed, `placed N`; exit 1 naming each file that did not arrive or could not
  be placed.

Each directory on the way is opened relative to the last with O_NOFOLLOW (made 0755 when missing, where the mode
makes directories), so a link on the way is refused, never followed. Exits 1 when anything could not be done (each
named on stderr), 2 on bad arguments.
"""

from __future__ import annotations

import fcntl
import os
import resource
import select
import stat
import sys
import tempfile
import time

TEMP_SUFFIX = ".spark-reconciler-link"
STAGING = ".rsync-partial/staged"  # below the target's root: the manifest skips `.rsync-partial`, rsync resumes there
SOURCE = "/proc/self/fd/"  # the source's rsync reads `FD/NAME` below it: the directories `send` holds open
PIN_BASE = 10  # the first descriptor a held directory gets (`weights` numbers them from here, the same every time)
MAX_PINS = 1 << 16  # directories one stream may hold
CHANGED = 65  # `send`: the source's files are not what the listing checked
BAD_INPUT = 64  # `send`: instructions or a command it does not take
INTERVAL = 0.25  # `receive`: seconds between its looks for files that arrived (as the page-cache bound's passes)
# rsync options that make it follow a link, or carry one: never in a `send` (the first words of the short forms)
FOLLOWING = ("-L", "--copy-links", "--copy-unsafe-links", "-k", "--copy-dirlinks", "-K", "--keep-dirlinks", "-l",
             "--links", "-a", "--archive")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _name(name: str) -> str:
    """`name` when it is one path component, else ValueError."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a name: {name!r}")
    return name


def parent_fd(root_fd: int, parts: list[str], make: bool = True) -> int:
    """An fd of the directory `parts` below `root_fd`, walked without following any link (each made 0755 when
    missing, with `make`)."""
    fd = os.dup(root_fd)
    for name in parts:
        try:
            nxt = os.open(_name(name), DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not make:
                os.close(fd)
                raise
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            finally:
                os.close(fd)
        except BaseException:
            os.close(fd)
            raise
        else:
            os.close(fd)
        fd = nxt
    return fd


def _not_a_directory(fd: int, name: str) -> None:
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            raise IsADirectoryError("a directory is there")
    except FileNotFoundError:
        pass


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
            _not_a_directory(fd, name)
        temp = name + TEMP_SUFFIX
        try:
            os.unlink(temp, dir_fd=fd)
        except FileNotFoundError:
            pass
        os.symlink(value, temp, dir_fd=fd)
        os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


def _pairs(data: bytes) -> list[tuple[str, str]]:
    fields = data.split(b"\0")
    return [(fields[i].decode(), fields[i + 1].decode()) for i in range(0, len(fields) - 1, 2)]


def links(root: str, pairs: list[tuple[str, str]]) -> int:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    failed = 0
    for path, value in pairs:
        try:
            make(root_fd, path, value)
        except (OSError, ValueError) as exc:
            failed += 1
            print(f"{path} -> {value}: {exc}", file=sys.stderr)
    print(f"made {len(pairs) - failed}")
    return 1 if failed else 0


# -- the target: the staging directory, then each file moved into place -----------------------------------------

def _clear(fd: int, depth: int) -> int:
    """Remove every link and special file below the directory `fd` (`depth` levels), never following one."""
    removed = 0
    with os.scandir(fd) as entries:
        for entry in list(entries):
            if entry.is_symlink() or not (entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False)):
                os.unlink(entry.name, dir_fd=fd)
                removed += 1
            elif entry.is_dir(follow_symlinks=False) and depth > 0:
                sub = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                try:
                    removed += _clear(sub, depth - 1)
                finally:
                    os.close(sub)
    return removed


def _read_pairs(fd: int) -> list[tuple[str, str]]:
    """`receive`'s stdin: a line with the byte count, then that many bytes of `STAGED\\0PATH\\0` pairs (the rest
    of stdin is the lifeline)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk or len(line) > 20:
            raise ValueError("no byte count on stdin")
        line += chunk
    left, data = int(line), b""
    while len(data) < left:
        chunk = os.read(fd, left - len(data))
        if not chunk:
            raise ValueError("stdin ended inside the pairs")
        data += chunk
    return _pairs(data)


def _place(top: int, root_fd: int, staged: str, path: str, again: bool) -> None:
    where, name = staged.split("/") if staged.count("/") == 1 else ("", "")
    *dirs, last = path.split("/")
    for part in (where, name, *dirs, last):
        _name(part)
    held = os.open(where, DIR_FLAGS, dir_fd=top)
    try:
        try:
            st = os.stat(name, dir_fd=held, follow_symlinks=False)
        except FileNotFoundError:
            raise FileNotFoundError("it did not arrive") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("what arrived is not a regular file")
        mode = os.fstat(held).st_mode
        if mode & 0o700 != 0o700:  # rsync gave it the source directory's mode: a file must leave it
            os.fchmod(held, stat.S_IMODE(mode) | 0o700)
        fd = parent_fd(root_fd, dirs)
        try:
            _not_a_directory(fd, last)
            if again:  # the same file at another path too: this one gets a link to it
                temp = last + TEMP_SUFFIX
                try:
                    os.unlink(temp, dir_fd=fd)
                except FileNotFoundError:
                    pass
                os.link(name, temp, src_dir_fd=held, dst_dir_fd=fd, follow_symlinks=False)
                os.replace(temp, last, src_dir_fd=fd, dst_dir_fd=fd)
            else:
                os.replace(name, last, src_dir_fd=held, dst_dir_fd=fd)
        finally:
            os.close(fd)
    finally:
        os.close(held)


class Arrivals:
    """The files expected below STAGING, each moved to its path(s) once rsync renamed it in (complete: rsync writes
    `.NAME.XXXXXX` and renames it to NAME only when the whole file arrived and checked)."""

    def __init__(self, top: int, root_fd: int, pairs: list[tuple[str, str]]):
        self.top, self.root_fd = top, root_fd
        self.expected: dict[str, list[str]] = {}
        for staged, path in pairs:
            self.expected.setdefault(staged, []).append(path)
        self.placed = 0
        self.failed: list[str] = []

    def look(self, final: bool = False) -> None:
        """Move what arrived; with `final`, each file still missing is a failure."""
        for folder in sorted({staged.split("/", 1)[0] for staged in self.expected}):
            try:
                held = os.open(folder, DIR_FLAGS, dir_fd=self.top)
                try:
                    with os.scandir(held) as entries:
                        here = {entry.name for entry in entries}
                finally:
                    os.close(held)
            except (OSError, ValueError):
                here = set()
            for staged in [s for s in self.expected if s.split("/", 1)[0] == folder]:
                if staged.split("/", 1)[-1] in here or final:
                    self._move(staged)

    def _move(self, staged: str) -> None:
        paths = self.expected.pop(staged)
        for i, path in enumerate(paths):
            try:
                _place(self.top, self.root_fd, staged, path, i < len(paths) - 1)
                self.placed += 1
            except (OSError, ValueError) as exc:
                self.failed.append(f"{path} (copied as {STAGING}/{staged}): {exc}")


def _tidy(top: int) -> None:
    """Remove the staging directories left empty (partial data stays for the resume)."""
    with os.scandir(top) as entries:
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    for name in names:
        try:
            held = os.open(name, DIR_FLAGS, dir_fd=top)
        except OSError:
            continue
        try:
            os.rmdir(".rsync-partial", dir_fd=held)
        except OSError:
            pass
        finally:
            os.close(held)
        try:
            os.rmdir(name, dir_fd=top)
        except OSError:
            pass


def receive(root: str, lifetime: float) -> int:
    """Beside the copy on the target: STAGING made and cleared, `ready`, then every INTERVAL each file that arrived
    moved to its path, until the lifeline closes (or `lifetime` passed): a last look, `placed N`, exit 1 naming
    each file that did not arrive or could not be placed."""
    try:
        pairs = _read_pairs(0)
        os.makedirs(root, exist_ok=True)  # the root as configured, as `mkdir -p` made it
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        top = parent_fd(root_fd, STAGING.split("/"))
        removed = _clear(top, 3)
        for folder in sorted({staged.split("/", 1)[0] for staged, _ in pairs}):
            os.close(parent_fd(top, [folder]))
    except (OSError, ValueError) as exc:
        print(f"{root}/{STAGING}: {exc} (a link or a file on the way? remove it)", file=sys.stderr)
        return 1
    if removed:
        print(f"removed {removed} link(s) or special file(s) below {STAGING}", file=sys.stderr)
    print("ready", flush=True)
    arrivals = Arrivals(top, root_fd, pairs)
    end = time.monotonic() + lifetime
    while time.monotonic() < end:  # until the lifeline closes: rsync sets its directories' times at its end
        if arrivals.expected:
            arrivals.look()
        ready, _, _ = select.select([0], [], [], INTERVAL)
        if ready and not os.read(0, 4096):
            break
    arrivals.look(final=True)
    _tidy(top)
    for line in arrivals.failed[:20]:
        print(line, file=sys.stderr)
    if len(arrivals.failed) > 20:
        print(f"and {len(arrivals.failed) - 20} more", file=sys.stderr)
    print(f"placed {arrivals.placed}", flush=True)
    return 1 if arrivals.failed else 0


# -- the source: hold what was checked, then become rsync ---------------------------------------------------------

class BadInput(Exception):
    pass


def _instructions(data: bytes) -> tuple[dict[int, tuple[str, str]], list[tuple[int, str, int]]]:
    """The held directories {FD: (ROOT, DIR)} and the files [(FD, NAME, SIZE)] of `send`'s instructions."""
    fields = [f.decode() for f in data.split(b"\0")]
    if fields[-1] == "":
        fields.pop()
    if len(fields) % 4:
        raise BadInput("not records of four fields")
    pins: dict[int, tuple[str, str]] = {}
    files: list[tuple[int, str, int]] = []
    for i in range(0, len(fields), 4):
        kind, number, first, second = fields[i:i + 4]
        if not number.isdigit() or not PIN_BASE <= int(number) < PIN_BASE + MAX_PINS:
            raise BadInput(f"not a descriptor for a directory: {number!r}")
        try:
            _take_record(kind, number, first, second, pins, files)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    return pins, files


def _take_record(kind: str, number: str, first: str, second: str, pins: dict[int, tuple[str, str]],
                 files: list[tuple[int, str, int]]) -> None:
    """One record into `pins` (P: a directory, each of its names checked) or `files` (F: a file in a directory
    pinned before); anything else is not a record."""
    fd = int(number)
    if kind == "P" and first.startswith("/") and fd not in pins:
        for part in first[1:].split("/") + (second.split("/") if second else []):
            _name(part)
        pins[fd] = (first, second)
    elif kind == "F" and fd in pins and second.isdigit():
        files.append((fd, _name(first), int(second)))
    else:
        raise BadInput(f"not a record: {kind!r} {number} {first!r} {second!r}")


def _hold(pins: dict[int, tuple[str, str]]) -> tuple[dict[int, int], list[str]]:
    """Each directory opened (at a descriptor above every FD), or why not: no link followed from `/` down."""
    top = max(pins) + 1
    roots: dict[str, int] = {}
    held: dict[int, int] = {}
    problems = []
    try:
        for number, (root, below) in sorted(pins.items()):
            where = root + (f"/{below}" if below else "")
            try:
                if root not in roots:
                    slash = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        roots[root] = parent_fd(slash, root[1:].split("/"), make=False)
                    finally:
                        os.close(slash)
                fd = parent_fd(roots[root], below.split("/") if below else [], make=False)
            except OSError as exc:
                problems.append(f"{where}: {exc.strerror or exc} (a link there now, or gone: changed since it was "
                                "listed)")
                continue
            held[number] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top)
            os.close(fd)
    finally:
        for fd in roots.values():
            os.close(fd)
    return held, problems


def _check(held: dict[int, int], pins: dict[int, tuple[str, str]], files: list[tuple[int, str, int]]) -> list[str]:
    problems = []
    for number, name, size in files:
        if number not in held:
            continue
        root, below = pins[number]
        where = f"{root}/{below + '/' if below else ''}{name}"
        try:
            st = os.stat(name, dir_fd=held[number], follow_symlinks=False)
        except OSError as exc:
            problems.append(f"{where}: {exc.strerror or exc} (changed since it was listed)")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{where}: no longer a regular file (a link now?) though the listing checked one")
        elif st.st_size != size:
            problems.append(f"{where}: {st.st_size} bytes, the listing checked {size}")
    return problems


def _files_from(command: list[str]) -> str:
    given = [word.split("=", 1)[1] for word in command if word.startswith("--files-from=")]
    if len(given) != 1 or not given[0]:
        raise BadInput("the rsync command must name one --files-from")
    return given[0]


def _write_list(path: str, files: list[tuple[int, str, int]]) -> None:
    """rsync's list, `FD/NAME` NUL-separated, under its name by a rename (never written through a link there)."""
    fd, temp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".send-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(f"{n}/{name}".encode() + b"\0" for n, name, _ in files))
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def _room(descriptors: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < descriptors:
        if hard != resource.RLIM_INFINITY and hard < descriptors:
            raise BadInput(f"{descriptors} open files needed to hold the directories; this node allows {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, hard))


def send(instructions: str, command: list[str]) -> int:
    """Check, hold, write rsync's list, exec rsync; returns only when it did not exec."""
    try:
        if not command or command[0] != "rsync" or any(w in FOLLOWING for w in command) or len(command) < 3 \
                or command[-2] != SOURCE:
            raise BadInput(f"not a stream's rsync (from {SOURCE}, no option that follows or carries a link)")
        with open(instructions, "rb") as f:
            pins, files = _instructions(f.read())
        if not files:
            raise BadInput("no file to send")
        listing = _files_from(command)
        _room(2 * (max(pins) + 1) + 64)
    except (BadInput, OSError) as exc:
        print(f"send: {exc}", file=sys.stderr)
        return BAD_INPUT
    held, problems = _hold(pins)
    problems += _check(held, pins, files)
    if problems:
        shown = problems[:10] + ([f"and {len(problems) - 10} more"] if len(problems) > 10 else [])
        print("\n".join(shown), file=sys.stderr)
        print(f"the source's tree changed since it was listed: {len(problems)} file(s) or directories differ; "
              "nothing of this stream was sent", file=sys.stderr)
        return CHANGED
    _write_list(listing, files)
    for number, fd in held.items():
        os.dup2(fd, number)  # inheritable: rsync reads through it
        os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(command[0], command)
    return BAD_INPUT  # not reached


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "send" and len(argv) >= 3:
        return send(argv[1], argv[2:])
    if mode == "receive" and len(argv) == 3:
        return receive(argv[1], float(argv[2]))
    if len(argv) == 1:
        return links(argv[0], _pairs(sys.stdin.buffer.read()))
    print("usage: ROOT | receive ROOT LIFETIME | send INSTRUCTIONS rsync ARGS...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
