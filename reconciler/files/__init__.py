"""The operator's files, shipped in the wheel: the systemd units, the environment file template, the Prometheus
alert rules and an Alertmanager example, the Grafana dashboard and its provisioning, the sample desired state, the
recipes `reconciler init` composes (docs/recipes.md).

This package is their one place; the top-level systemd/, monitoring/, desired-state/ and recipes/ of the source
tree are relative symlinks into it. `reconciler print NAME` writes one to stdout (docs/cli.md), e.g.
`reconciler print unit | sudo tee /etc/systemd/system/spark-reconciler.service`.
"""

from __future__ import annotations

from importlib import resources

# name for `reconciler print` -> (path inside this package, what it is and where it goes)
SHIPPED: dict[str, tuple[str, str]] = {
    "unit": ("systemd/reconciler.service",
             "the daemon's systemd unit: /etc/systemd/system/spark-reconciler.service"),
    "socket": ("systemd/reconciler.socket",
               "its listener socket: /etc/systemd/system/spark-reconciler.socket"),
    "verify-service": ("systemd/reconciler-verify.service",
                       "the weekly verification: /etc/systemd/system/spark-reconciler-verify.service"),
    "verify-timer": ("systemd/reconciler-verify.timer",
                     "its timer: /etc/systemd/system/spark-reconciler-verify.timer"),
    "environment": ("systemd/environment.example",
                    "the secrets' environment file: /etc/spark-reconciler/environment (root, 0600)"),
    "example": ("examples/cluster.yaml",
                "a sample desired state to edit: /etc/spark-reconciler/cluster.yaml"),
    "alerts": ("monitoring/alerts.yaml",
               "the Prometheus alert rules (rule_files:)"),
    "alertmanager": ("monitoring/alertmanager.yaml",
                     "an Alertmanager route and inhibit rules to merge into alertmanager.yml"),
    "dashboard": ("monitoring/grafana/dashboard.json",
                  "the Grafana dashboard"),
    "grafana-datasource": ("monitoring/grafana/provisioning/datasources/prometheus.yaml",
                           "Grafana provisioning: the Prometheus data source"),
    "grafana-dashboards": ("monitoring/grafana/provisioning/dashboards/spark-reconciler.yaml",
                           "Grafana provisioning: the dashboard provider"),
    "grafana-alerting": ("monitoring/grafana/provisioning/alerting/spark-reconciler.yaml",
                         "Grafana provisioning: the alert rules for Grafana's own alerting"),
}


def read(name: str) -> str:
    """The text of the shipped file `name` (a key of SHIPPED)."""
    path = SHIPPED[name][0]
    return resources.files(__name__).joinpath(path).read_text(encoding="utf-8")


#: The folder of the recipes: one deployment each, a YAML file named after the recipe (reconciler.core.recipes).
RECIPES = "recipes"


def recipes() -> dict[str, str]:
    """Every shipped recipe's text by name (its file's name without `.yaml`), in name order: what `reconciler init`
    lists and composes. Read here, so the core that composes them stays free of file I/O."""
    folder = resources.files(__name__).joinpath(RECIPES)
    entries = sorted((entry for entry in folder.iterdir() if entry.name.endswith(".yaml")), key=lambda e: e.name)
    return {entry.name.removesuffix(".yaml"): entry.read_text(encoding="utf-8") for entry in entries}
