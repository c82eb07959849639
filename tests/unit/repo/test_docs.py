"""The generated reference must match the models: a stale docs/desired-state.md fails here."""

from pathlib import Path

from reconciler.core.docgen import markdown

ROOT = Path(__file__).resolve().parents[3]


def test_desired_state_reference_is_current():
    on_disk = (ROOT / "docs" / "desired-state.md").read_text()
    assert on_disk == markdown(), "docs/desired-state.md is stale: run `make docs`"


def test_reference_documents_every_section():
    text = markdown()
    for section in ("## Desired", "## Node", "## Ssh", "## Fabric", "## Model", "## Serving", "## DockerOptions",
                    "## CoTenants", "## Policy", "## Timeouts", "## Retries", "## WeightsPolicy"):
        assert section in text
