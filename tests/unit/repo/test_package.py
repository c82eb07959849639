"""The package an operator installs (docs/operations.md): the wheel is built from this tree by its own build system,
installed into a fresh venv with the pinned dependencies, and used the way the runbook does: `--version` names the
git revision, `print example` validates, the printed units pass `systemd-analyze verify`, every shipped file is the
tree's file (contents, not links).

No network: pip runs with --no-index from the wheelhouse `make wheelhouse` fills (the pinned runtime wheels of
constraints.txt and the build backend; `make unit` and `make test` make it), and with the machine's pip
configuration switched off (PIP_CONFIG_FILE=/dev/null), so nothing but the wheelhouse can be reached. About 30 s.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from reconciler import files
from reconciler._revision import from_git

REPO = Path(__file__).resolve().parents[3]
WHEELHOUSE = Path(os.environ.get("WHEELHOUSE", REPO / ".venv" / "wheelhouse"))  # the Makefile exports it
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# The unit's ExecStart names the venv the runbook makes: `python3 -m venv /opt/spark-reconciler`.
INSTALL_PREFIX = "/opt/spark-reconciler"
PIP_ENV = {**os.environ, "PIP_CONFIG_FILE": "/dev/null", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}


def sh(*argv: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
       stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env or PIP_ENV, input=stdin, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, f"{argv}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def build_wheel(source: Path, out: Path) -> Path:
    """`pip wheel` of a source tree, its build backend from the wheelhouse (build isolation, as an operator's)."""
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, source)
    (wheel,) = out.glob("spark_reconciler-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(venv, wheel): the wheel built from this checkout, installed as the runbook does (`pip install -c ...`)."""
    assert (WHEELHOUSE / ".complete").exists(), f"no wheelhouse at {WHEELHOUSE}: `make wheelhouse` fills it"
    tmp = tmp_path_factory.mktemp("package")
    had_build = (REPO / "build").exists()
    wheel = build_wheel(REPO, tmp / "dist")
    # setup.py builds in a fresh temporary directory: nothing stale from an earlier build, nothing left in the tree
    assert had_build or not (REPO / "build").exists()
    venv = tmp / "spark-reconciler"
    sh(sys.executable, "-m", "venv", venv)
    sh(venv / "bin" / "pip", "install", "-q", "-c", REPO / "constraints.txt", wheel)
    return venv, wheel


def test_version_names_the_revision_the_wheel_was_built_from(installed):
    venv, _wheel = installed
    revision = from_git(REPO)
    assert revision, "this test runs in a git checkout"
    out = sh(venv / "bin" / "reconciler", "--version").stdout.strip()
    assert out == f"reconciler, version {PROJECT['version']} (git {revision})"


def test_the_wheel_carries_the_files_contents_and_the_license(installed):
    _venv, wheel = installed
    with zipfile.ZipFile(wheel) as whl:
        entries = {i.filename: i for i in whl.infolist()}
        for _name, (path, _what) in files.SHIPPED.items():
            info = entries[f"reconciler/files/{path}"]
            assert not stat.S_ISLNK(info.external_attr >> 16), f"{path} is a symlink in the wheel"
            assert whl.read(info).decode() == (REPO / "reconciler" / "files" / path).read_text()
        metadata = whl.read(f"spark_reconciler-{PROJECT['version']}.dist-info/METADATA").decode()
        license_text = whl.read(f"spark_reconciler-{PROJECT['version']}.dist-info/licenses/LICENSE").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert license_text == (REPO / "LICENSE").read_text()
    for name, url in PROJECT["urls"].items():
        assert f"Project-URL: {name}, {url}" in metadata.splitlines()
    # the testbed, the benchmarks and the tests stay in the source tree
    assert not {n.split("/")[0] for n in entries} & {"testbed", "bench", "tests"}


def test_print_writes_every_shipped_file_as_in_the_tree(installed):
    venv, _wheel = installed
    listing = sh(venv / "bin" / "reconciler", "print").stdout
    for name, (path, _what) in files.SHIPPED.items():
        assert listing.count(f"\n{name} ") + listing.startswith(f"{name} ") == 1, listing
        assert sh(venv / "bin" / "reconciler", "print", name).stdout == \
            (REPO / "reconciler" / "files" / path).read_text(), name
    # the old top-level paths are links to the same files (one place per file)
    for top, shipped in (("systemd/reconciler.service", "systemd/reconciler.service"),
                         ("monitoring/alerts.yaml", "monitoring/alerts.yaml"),
                         ("monitoring/grafana/dashboard.json", "monitoring/grafana/dashboard.json"),
                         ("desired-state/cluster.yaml", "examples/cluster.yaml")):
        assert (REPO / top).resolve() == (REPO / "reconciler" / "files" / shipped).resolve()
    bad = subprocess.run([venv / "bin" / "reconciler", "print", "nonesuch"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 1 and "unit" in bad.stderr and not bad.stdout


def test_the_printed_example_validates(installed, tmp_path):
    venv, _wheel = installed
    example = tmp_path / "cluster.yaml"
    example.write_text(sh(venv / "bin" / "reconciler", "print", "example").stdout)
    out = sh(venv / "bin" / "reconciler", "validate", example, cwd=tmp_path,
             env={**PIP_ENV, "VLLM_API_KEY": "sk-test"}).stdout  # the example declares it; validate checks secrets
    assert out.strip() == f"{example}: valid"


def test_the_printed_units_pass_systemd_analyze_verify(installed, tmp_path):
    """The units name /opt/spark-reconciler/bin/reconciler, the venv the runbook makes. verify insists that ExecStart
    exists, so each unit is verified as printed except for that prefix, which becomes this test's venv: the same
    layout (`python -m venv PREFIX` then pip), where the path is checked to be the installed console script."""
    venv, _wheel = installed
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze comes with systemd (testbed/install-deps.sh)"
    exe = venv / "bin" / "reconciler"
    assert exe.is_file() and os.access(exe, os.X_OK)
    units = {"unit": "spark-reconciler.service", "socket": "spark-reconciler.socket",
             "verify-service": "spark-reconciler-verify.service", "verify-timer": "spark-reconciler-verify.timer"}
    for name, unit in units.items():
        text = sh(venv / "bin" / "reconciler", "print", name).stdout
        if name in ("unit", "verify-service"):
            exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
            assert exec_start.startswith(f"ExecStart={INSTALL_PREFIX}/bin/reconciler "), exec_start
        (tmp_path / unit).write_text(text.replace(f"{INSTALL_PREFIX}/", f"{venv}/"))
    result = subprocess.run([analyze, "verify", *(str(tmp_path / u) for u in units.values())], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_a_wheel_built_without_git_says_unknown(installed, tmp_path):
    """A tree without .git (an unpacked tarball): the build records nothing and --version says so."""
    venv, _wheel = installed
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "reconciler", src / "reconciler",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "_revision_build.py"))
    wheel = build_wheel(src, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as whl:
        assert "reconciler/_revision_build.py" not in whl.namelist()
    target = tmp_path / "site"
    sh(venv / "bin" / "pip", "install", "-q", "--no-deps", "--target", target, wheel)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = sh(venv / "bin" / "python", "-c", "from reconciler.cli import main; main()", "--version", env=env,
             cwd=tmp_path)  # not the checkout's cwd: `-c` puts the cwd first on sys.path
    assert out.stdout.strip() == f"reconciler, version {PROJECT['version']} (git unknown)"
