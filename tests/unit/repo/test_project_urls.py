"""One place for the project's address: pyproject.toml's [project.urls]. Every absolute link to the project in the
operator's files (the systemd units, the alert rules' runbook_url, the Grafana dashboard and provisioning, the
sample desired state), the docs and the README starts with exactly that base, and every `BASE/blob/main/PATH#anchor`
(or `/tree/main/PATH`) names a file (a directory) of this tree and, for Markdown, a heading it has."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

from tests.unit.repo.test_monitoring import github_anchor

ROOT = Path(__file__).resolve().parents[3]
# The top-level systemd/, monitoring/ and desired-state/ are symlinks into reconciler/files (followed below).
SCANNED = ["systemd", "monitoring", "desired-state", "docs", "README.md"]
URL = re.compile(r"https?://[^\s\"'<>`()\[\]{}|\\]+")
# Addresses on the operator's own machines and placeholders: never the project's, whatever their path says.
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "host.docker.internal", "head", "host", "node"}


def base() -> str:
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    source = urls["Source"].rstrip("/")
    for name, url in urls.items():
        assert url == source or url.startswith(source + "/"), f"project.urls.{name} is not under Source ({source})"
    return source


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        assert path.exists(), f"{name} is gone: update SCANNED"
        if path.is_file():
            files.append(path)
            continue
        for dirpath, _dirs, names in os.walk(path, followlinks=True):
            files += [Path(dirpath) / n for n in names]
    return sorted(files)


def project_links() -> list[tuple[Path, str]]:
    links = []
    for path in scanned_files():
        for url in URL.findall(path.read_text(errors="replace")):
            url = url.rstrip(".,;:")
            host = (urlsplit(url).hostname or "").lower()
            if host in LOCAL_HOSTS or host.isupper() or "spark-reconciler" not in url.lower():
                continue
            links.append((path, url))
    return links


def markdown_anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            anchors.add(github_anchor(m.group(1)))
    return anchors


def test_the_scan_follows_the_links_into_the_package():
    files = {p.resolve() for p in scanned_files()}
    for shipped in ("systemd/reconciler.service", "monitoring/alerts.yaml", "monitoring/grafana/dashboard.json",
                    "examples/cluster.yaml"):
        assert (ROOT / "reconciler" / "files" / shipped).resolve() in files


def test_every_project_link_starts_with_the_one_base_of_pyproject():
    prefix = base()
    links = project_links()
    # The unit's Documentation=, 15 runbook_urls in alerts.yaml, 15 in the Grafana alerting, the dashboard's link.
    assert len(links) >= 30, links
    wrong = [f"{p.relative_to(ROOT)}: {u}" for p, u in links if u != prefix and not u.startswith(prefix + "/")]
    assert not wrong, f"not under project.urls ({prefix}):\n" + "\n".join(wrong)


def test_every_blob_and_tree_link_names_a_path_of_this_tree_and_its_heading():
    prefix = base()
    checked, broken = 0, []
    urls = [u for _p, u in project_links()]
    urls += list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"].values())
    for url in urls:
        m = re.match(re.escape(prefix) + r"/(blob|tree)/main/([^#?]+)(?:#(.+))?$", url)
        if not m:
            continue
        kind, rel, anchor = m.groups()
        target = ROOT / rel
        checked += 1
        if not (target.is_file() if kind == "blob" else target.is_dir()):
            broken.append(f"{url}: no {'file' if kind == 'blob' else 'directory'} {rel}")
        elif anchor and target.suffix == ".md" and anchor not in markdown_anchors(target):
            broken.append(f"{url}: no heading #{anchor} in {rel}")
    assert checked >= 30
    assert not broken, "\n".join(broken)
