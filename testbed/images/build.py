"""Build the testbed images locally, with no registry: `vllm-standin:latest` and `cotenant-standin:latest`.

The root filesystem is assembled from this machine (Debian's /usr/bin/python3.11 + the stdlib it needs + the
shared libraries ldd lists, real bash and busybox-static for sh/sleep/cat/ps/..., the stand-in programs as
/usr/local/bin/{vllm,ray,cotenant}) into one deterministic layer tar, and written as a `docker save`-format archive
(manifest.json + config + layer) that `docker load` takes. Everything is deterministic (fixed timestamps, sorted
entries), so the same inputs give the same image ids on every engine: the reconciler compares image ids across
nodes, and building into head and worker separately yields the same id, as a pulled image would. The two images
share the layer and differ only by their config (labels, default command), so their ids differ.

Cache: the archive is kept under $SPARK_TESTBED_IMAGE_CACHE (default /var/cache/spark-testbed/images) keyed by a
hash of the inputs; an engine that already has the expected image id is not touched.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import TypedDict

BUILDER_VERSION = "3"
EPOCH = 1735689600  # 2025-01-01T00:00:00Z, mtime of generated files
CREATED = "2025-01-01T00:00:00Z"
LABEL_NS = "org.spark-testbed"
STANDIN_DIR = Path(__file__).resolve().parent.parent / "standin"
PYTHON = "/usr/bin/python3.11"
STDLIB = "/usr/lib/python3.11"
STDLIB_SKIP_DIRS = {
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "distutils",
    "config-3.11-x86_64-linux-gnu", "site-packages", "dist-packages", "venv", "__phello__", "sqlite3", "curses",
    "dbm",
}
DYNLOAD_SKIP_PREFIXES = ("_dbm", "_gdbm", "_sqlite3", "_curses", "readline", "nis", "_tkinter", "_test", "xxlimited",
                         "_ctypes_test", "_xxtestfuzz", "xxsubtype")
HOST_BINARIES = {"/usr/bin/bash": "bash", "/usr/bin/sleep": "sleep", "/usr/bin/env": "env"}
BUSYBOX_CANDIDATES = ("/usr/bin/busybox", "/bin/busybox")
PROGRAMS = {"vllm": "vllm_standin", "ray": "ray_standin", "cotenant": "cotenant"}
ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
    "HOME=/root",
    "HF_HOME=/root/.cache/huggingface",
]
class ImageSpec(TypedDict):
    """What differs between the locally built images: the stand-in kind (a label) and the default command."""

    kind: str
    cmd: list[str]


IMAGES: dict[str, ImageSpec] = {
    "vllm-standin:latest": {"kind": "vllm", "cmd": ["/bin/sh"]},
    "cotenant-standin:latest": {"kind": "cotenant", "cmd": ["cotenant", "--port", "8000", "--hold-mb", "64",
                                                             "--label", "cotenant"]},
}


class BuildError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ rootfs


def _ldd(paths: list[str]) -> set[str]:
    libs: set[str] = set()
    for chunk in range(0, len(paths), 50):
        res = subprocess.run(["ldd", *paths[chunk:chunk + 50]], capture_output=True, text=True, check=False)
        for line in res.stdout.splitlines():
            line = line.strip()
            if "=>" in line:
                target = line.split("=>", 1)[1].split("(")[0].strip()
                if target.startswith("/"):
                    libs.add(target)
            elif line.startswith("/") and "(" in line:
                libs.add(line.split("(")[0].strip())
    return libs


def _lib_dest(path: str) -> str:
    """Where a library goes in the merged-/usr rootfs: the real directory, under the name ldd used."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _stdlib_files() -> list[tuple[str, str]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(STDLIB):
        rel = os.path.relpath(dirpath, STDLIB)
        top = rel.split(os.sep)[0]
        if top in STDLIB_SKIP_DIRS:
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not (rel == "." and d in STDLIB_SKIP_DIRS) and d != "tests")
        for f in sorted(filenames):
            src = os.path.join(dirpath, f)
            if rel == "lib-dynload" and f.startswith(DYNLOAD_SKIP_PREFIXES):
                continue
            if "__pycache__" in rel and (".opt-" in f or f.split(".")[0] in STDLIB_SKIP_DIRS):
                continue
            if not os.path.exists(src):  # dangling symlink
                continue
            out.append((src, os.path.join(STDLIB, rel, f).replace("/./", "/")))
    return out


def _host_copies() -> tuple[list[tuple[str, str]], str]:
    """(src, dest) of the host files the image copies (python, its stdlib, the tools, their libraries) and the
    busybox binary; raises BuildError naming the package when one is missing."""
    for p in [PYTHON, *HOST_BINARIES]:
        if not os.path.exists(p):
            raise BuildError(f"{p} missing: apt-get install -y python3.11-minimal bash coreutils")
    busybox = next((b for b in BUSYBOX_CANDIDATES if os.path.exists(b)), None)
    if not busybox:
        raise BuildError("busybox missing: apt-get install -y busybox-static")
    copies: list[tuple[str, str]] = [(PYTHON, PYTHON)]
    copies += _stdlib_files()
    for src, name in HOST_BINARIES.items():
        copies.append((src, f"/usr/bin/{name}"))
    copies.append((busybox, "/usr/bin/busybox"))
    elf = [PYTHON, *HOST_BINARIES] + [s for s, _ in copies if s.endswith(".so")]
    for lib in sorted(_ldd(elf)):
        copies.append((os.path.realpath(lib), _lib_dest(lib)))
    return copies, busybox


def _generated_files() -> list[tuple[str, bytes, int]]:
    """(dest, content, mode): the stand-in sources, a wrapper per program, and the few /etc files."""
    gen: list[tuple[str, bytes, int]] = []
    for src in sorted(STANDIN_DIR.glob("*.py")):
        if src.name == "__init__.py":
            continue
        gen.append((f"/usr/local/lib/standin/{src.name}", src.read_bytes(), 0o644))
    for prog, module in PROGRAMS.items():
        wrapper = (f"#!{PYTHON}\nimport sys\nsys.path.insert(0, '/usr/local/lib/standin')\n"
                   f"sys.argv[0] = '{prog}'\nfrom {module} import main\nsys.exit(main())\n")
        gen.append((f"/usr/local/bin/{prog}", wrapper.encode(), 0o755))
    gen += [
        ("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n", 0o644),
        ("/etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644),
        ("/etc/os-release", b'PRETTY_NAME="spark-testbed stand-in (Debian-derived)"\nID=spark-testbed\n', 0o644),
        ("/etc/nsswitch.conf", b"passwd: files\ngroup: files\nhosts: files dns\n", 0o644),
    ]
    return gen


def _links(busybox: str, taken: set[str]) -> list[tuple[str, str]]:
    """(dest, target): the usr-merge links, python3, and a link per busybox applet no other file provides."""
    links: list[tuple[str, str]] = [
        ("/bin", "usr/bin"), ("/sbin", "usr/sbin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64"),
        ("/usr/bin/python3", "python3.11"), ("/usr/bin/python", "python3.11"),
    ]
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    have = taken | {d for d, _ in links}
    for a in applets:
        if a in ("busybox", "[[") or "/" in a:
            continue
        dest = f"/usr/bin/{a}"
        if dest not in have:
            links.append((dest, "busybox"))
            have.add(dest)
    return links


def _inputs_hash(copies: list[tuple[str, str]], gen: list[tuple[str, bytes, int]],
                 links: list[tuple[str, str]], header: str = f"builder {BUILDER_VERSION}\n",
                 trailer: bytes | None = None) -> str:
    """Cheap: stat for host files, content for our own sources. `header`/`trailer` say which image family it is
    (default: the stand-ins', whose trailer is IMAGES and ENV)."""
    h = hashlib.sha256(header.encode())
    for src, dest in copies:
        st = os.stat(src)
        h.update(f"{src}\0{dest}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}\n".encode())
    for dest, content, mode in gen:
        h.update(f"{dest}\0{mode}\0".encode() + hashlib.sha256(content).digest())
    for dest, target in links:
        h.update(f"L{dest}\0{target}\n".encode())
    h.update(json.dumps(IMAGES, sort_keys=True).encode() + json.dumps(ENV).encode() if trailer is None else trailer)
    return h.hexdigest()


def _inputs() -> tuple[list[tuple[str, str]], list[tuple[str, bytes, int]], list[tuple[str, str]], str]:
    """(host files to copy as (src, dest)), (generated files (dest, content, mode)), (symlinks (dest, target)),
    and a hash of all inputs (cheap: stat for host files, content for our own sources)."""
    copies, busybox = _host_copies()
    gen = _generated_files()
    links = _links(busybox, {d for _, d in copies} | {d for d, _, _ in gen})
    return copies, gen, links, _inputs_hash(copies, gen, links)


def _tarinfo(name: str, kind: bytes, mode: int, mtime: int, size: int = 0, linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name.lstrip("/"))
    ti.type = kind
    ti.mode = mode
    ti.mtime = mtime
    ti.size = size
    ti.linkname = linkname
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def _write_layer(path: Path, copies: list[tuple[str, str]], gen: list[tuple[str, bytes, int]],
                 links: list[tuple[str, str]]) -> str:
    """Write the layer tar deterministically; return its sha256 (the diff_id)."""
    # dest -> (kind, what, mode, mtime): what is the host path ("file"), the content ("data") or the target ("link")
    entries: dict[str, tuple[str, str | bytes, int, int]] = {}
    dirs = {"/tmp": 0o1777, "/root": 0o700, "/proc": 0o555, "/sys": 0o555, "/dev": 0o755, "/etc": 0o755,
            "/run": 0o755, "/var": 0o755, "/var/tmp": 0o1777, "/usr/sbin": 0o755, "/usr/lib64": 0o755,
            "/root/.cache": 0o755, "/root/.cache/huggingface": 0o755, "/root/.cache/huggingface/hub": 0o755,
            "/models": 0o755}
    for src, dest in copies:
        st = os.stat(src)
        entries[dest] = ("file", src, stat.S_IMODE(st.st_mode), int(st.st_mtime))
    for dest, content, mode in gen:
        entries[dest] = ("data", content, mode, EPOCH)
    for dest, target in links:
        entries[dest] = ("link", target, 0o777, EPOCH)
    for dest in list(entries):
        d = os.path.dirname(dest)
        while d not in ("/", ""):
            dirs.setdefault(d, 0o755)
            d = os.path.dirname(d)
    for lk in ("/bin", "/sbin", "/lib", "/lib64"):
        dirs.pop(lk, None)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for d in sorted(dirs):
            tar.addfile(_tarinfo(d, tarfile.DIRTYPE, dirs[d], EPOCH))
        for dest in sorted(entries):
            kind, what, mode, mtime = entries[dest]
            if isinstance(what, bytes):      # "data", and only it, carries the content itself
                tar.addfile(_tarinfo(dest, tarfile.REGTYPE, mode, mtime, len(what)), io.BytesIO(what))
            elif kind == "link":
                tar.addfile(_tarinfo(dest, tarfile.SYMTYPE, 0o777, mtime, linkname=what))
            else:
                with open(what, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    tar.addfile(_tarinfo(dest, tarfile.REGTYPE, mode, mtime, size), f)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _config(ref: str, diff_id: str, content: str) -> bytes:
    spec = IMAGES[ref]
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "created": CREATED,
        "config": {
            "Env": ENV,
            "Cmd": spec["cmd"],
            "WorkingDir": "/",
            "Labels": {
                f"{LABEL_NS}.image": ref.split(":")[0],
                f"{LABEL_NS}.kind": spec["kind"],
                f"{LABEL_NS}.content": content,
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created": CREATED, "created_by": f"spark-testbed images builder v{BUILDER_VERSION} ({ref})"}],
    }
    return json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()


def cache_dir() -> Path:
    return Path(os.environ.get("SPARK_TESTBED_IMAGE_CACHE") or "/var/cache/spark-testbed/images")


def archive(names: list[str] | None = None) -> tuple[Path, dict[str, str]]:
    """Build (or reuse from the cache) a `docker load` archive holding the given images.
    Returns (archive path, {image ref: expected image id 'sha256:...'})."""
    names = list(names or IMAGES)
    for n in names:
        if n not in IMAGES:
            raise ValueError(f"unknown image {n!r}; known: {sorted(IMAGES)}")
    copies, gen, links, content = _inputs()
    cdir = cache_dir()
    cdir.mkdir(parents=True, exist_ok=True)
    prefix = f"standin-{content[:20]}-"
    key = prefix + hashlib.sha256(",".join(sorted(names)).encode()).hexdigest()[:8]
    out = cdir / f"{key}.tar"
    meta = cdir / f"{key}.json"
    if out.exists() and meta.exists():
        return out, json.loads(meta.read_text())
    for old in cdir.glob("standin-*"):  # archives of other inputs are stale
        if not old.name.startswith(prefix):
            old.unlink()
    with tempfile.TemporaryDirectory(dir=cdir) as tmp:
        layer = Path(tmp) / "layer.tar"
        diff_id = _write_layer(layer, copies, gen, links)
        ids: dict[str, str] = {}
        manifest = []
        configs = {}
        for n in sorted(names):
            cfg = _config(n, diff_id, content)
            cid = hashlib.sha256(cfg).hexdigest()
            ids[n] = f"sha256:{cid}"
            configs[f"{cid}.json"] = cfg
            manifest.append({"Config": f"{cid}.json", "RepoTags": [n], "Layers": [f"{diff_id}/layer.tar"]})
        part = Path(tmp) / "out.tar"
        with tarfile.open(part, "w", format=tarfile.GNU_FORMAT) as tar:
            def add(name: str, data: bytes) -> None:
                tar.addfile(_tarinfo(name, tarfile.REGTYPE, 0o644, EPOCH, len(data)), io.BytesIO(data))

            tar.addfile(_tarinfo(diff_id, tarfile.DIRTYPE, 0o755, EPOCH))
            add(f"{diff_id}/VERSION", b"1.0")
            with open(layer, "rb") as f:
                tar.addfile(_tarinfo(f"{diff_id}/layer.tar", tarfile.REGTYPE, 0o644, EPOCH, layer.stat().st_size), f)
            for name, data in sorted(configs.items()):
                add(name, data)
            add("manifest.json", json.dumps(manifest).encode())
        os.replace(part, out)
        meta.write_text(json.dumps(ids, indent=1))
    return out, ids


# ------------------------------------------------------------------------------------------------ docker


def _docker_bin() -> str:
    for cand in (shutil.which("docker"), "/usr/bin/docker", "/usr/local/bin/docker"):
        if cand and os.path.exists(cand):
            return cand
    raise BuildError("no docker CLI found (apt-get install -y docker.io)")


def _docker(docker_host: str, *args: str, check: bool = True,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DOCKER_HOST=docker_host)
    res = subprocess.run([_docker_bin(), *args], env=env, capture_output=True, text=True, timeout=timeout,
                         check=False)
    if check and res.returncode != 0:
        raise BuildError(f"docker {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def image_id(docker_host: str, ref: str) -> str | None:
    res = _docker(docker_host, "image", "inspect", "--format", "{{.Id}}", ref, check=False, timeout=60)
    return res.stdout.strip() if res.returncode == 0 else None


def build(docker_host: str, names: list[str] | None = None) -> dict[str, str]:
    """Make sure the engine at docker_host ('unix:///...sock') has the images; return {ref: image id}.
    names: refs from IMAGES (default: all). Same inputs -> same ids on every engine; no work if already there."""
    path, ids = archive(names)
    if all(image_id(docker_host, ref) == want for ref, want in ids.items()):
        return ids
    _docker(docker_host, "load", "-i", str(path))
    got = {ref: image_id(docker_host, ref) for ref in ids}
    bad = {r: g for r, g in got.items() if g != ids[r]}
    if bad:
        raise BuildError(f"loaded images have unexpected ids: {bad} (wanted {ids})")
    return ids
