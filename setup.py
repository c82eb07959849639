"""Build hooks only; everything else is in pyproject.toml. Two of them: the git revision, and a fresh build directory.

Records the git revision the package is built from in `reconciler/_revision_build.py` (`reconciler --version`
shows it; reconciler/_revision.py reads it): into the wheel's build directory when building from a checkout, and
into the sdist's tree so a wheel built from the sdist keeps it. The file never appears in the source tree. Built
from a tree without `.git` (and not from such an sdist), the wheel has no such file: the revision is "unknown".
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
TARGET = Path("reconciler") / "_revision_build.py"


def git_revision() -> str | None:
    """reconciler._revision.from_git for this tree, loaded by path: setup.py cannot import the package (its
    dependencies are not installed at build time), and that module imports none of them."""
    spec = importlib.util.spec_from_file_location("_revision", HERE / "reconciler" / "_revision.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.from_git(HERE)


def write_revision(root: Path) -> None:
    revision = git_revision()
    if revision is None:
        return
    target = root / TARGET
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f'"""Written by setup.py at build time."""\n\nREVISION = "{revision}"\n')


class BuildPyWithRevision(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install runs from the checkout: _revision asks git itself
            write_revision(Path(self.build_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        target = str(Path(self.build_lib) / TARGET)
        if not self.editable_mode and git_revision() is not None and target not in outputs:
            outputs.append(target)
        return outputs


class SdistWithRevision(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        write_revision(Path(base_dir))


# A fresh build directory for every build, removed when the build process ends: no build/ in the checkout, and no
# file left there by an earlier build (a module since removed) can end up in the wheel.
BUILD_BASE = tempfile.mkdtemp(prefix="spark-reconciler-build-")
atexit.register(shutil.rmtree, BUILD_BASE, True)

setup(cmdclass={"build_py": BuildPyWithRevision, "sdist": SdistWithRevision},
      options={"build": {"build_base": BUILD_BASE}})
