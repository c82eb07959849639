"""The generation store: which version of the desired state is enforced, and which one the cluster reached.

Kubernetes' generation/observedGeneration, for one file: a new valid content bumps `generation`; a converged
observation sets `observed_generation` to it. Both are kept in the state dir (one JSON file per desired-state
path, replaced atomically), so a daemon restart neither renumbers the same content nor makes Grafana's "since
last converged" read as 1970 until the first converged reconcile.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def path_key(path: Path) -> str:
    """A short stable name for a desired-state path (lock and state files live side by side per file)."""
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]


class GenerationStore:
    def __init__(self, state_dir: Path, path: Path) -> None:
        self.file = Path(state_dir) / f"state-{path_key(path)}.json"
        self.content_hash: str | None = None  # of the desired state in force (None: none loaded yet)
        self.generation = self.observed_generation = 0
        self.last_converged = 0.0
        self._stored_hash: str | None = None
        try:
            data = json.loads(self.file.read_text())
            self._stored_hash = data.get("hash")
            self.generation = int(data.get("generation", 0))
            self.observed_generation = int(data.get("observedGeneration", 0))
            self.last_converged = float(data.get("lastConverged") or 0.0)
        except (OSError, ValueError, TypeError, AttributeError):
            self.generation = self.observed_generation = 0
            self.last_converged = 0.0

    def take(self, digest: str) -> bool:
        """A valid content was loaded; True when it is a new generation. The content stored by the previous
        daemon keeps its number across a restart; anything else (an edit, or the first content ever) bumps."""
        if digest == self.content_hash:
            return False
        if self.content_hash is not None or digest != self._stored_hash or self.generation == 0:
            self.generation += 1
        self.content_hash = digest
        self.save()
        return True

    def converged(self, now: float) -> None:
        self.observed_generation = self.generation
        self.last_converged = now
        self.save()

    def save(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"hash": self.content_hash, "generation": self.generation,
                                   "observedGeneration": self.observed_generation,
                                   "lastConverged": self.last_converged}))
        tmp.replace(self.file)
