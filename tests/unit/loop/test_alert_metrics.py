"""The gauges the alerts of issue 33 judge by (monitoring/alerts.yaml, header): what the daemon exports for them.

- `reconciler_serving_health_timeout_seconds` and `reconciler_serving_started_timestamp_seconds`: Prometheus
  judges "a cold start within its health_timeout" from them (ReconcilerServingUnhealthy), joined on their label
  `deployment` (`default` for a file of the single form, as the fixture's);
- `reconciler_step_failures{kind,node}`: a failed await-health ends the allowance, so the restart after a cold
  start that timed out is not granted another one;
- `reconciler_node_role{node,role}`: an unreachable head pages once, not once more for each node behind it.

Read back from the registry Prometheus scrapes, after the publisher wrote them as the controller does.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from reconciler.core.spec import Retries
from reconciler.loop import metrics
from reconciler.loop.backoff import Backoff
from reconciler.loop.status import StatusPublisher


def value(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def publisher(tmp_path) -> StatusPublisher:
    return StatusPublisher(tmp_path / "cluster.yaml")


def with_head_container(desired, observed, **fields):
    head = observed.node(desired.head.name)
    containers = [c.model_copy(update=fields) if c.name == desired.serving.container_name else c
                  for c in head.containers]
    return observed.model_copy(update={"nodes": {**observed.nodes,
                                                 desired.head.name: head.model_copy(update={"containers":
                                                                                             containers})}})


def test_the_cold_start_allowance_is_exported(desired, seen):
    started = datetime(2026, 12, 6, 3, 0, 6, 123456, tzinfo=UTC)
    observed = with_head_container(desired, seen, started_at="2026-12-06T03:00:06.123456789Z")
    StatusPublisher.observation(desired, observed, {})
    assert desired.deployment.name == "default"
    assert value("reconciler_serving_health_timeout_seconds", deployment="default") == desired.serving.health_timeout
    assert value("reconciler_serving_started_timestamp_seconds", deployment="default") == \
        pytest.approx(started.timestamp())


def test_no_serving_container_running_is_a_start_time_of_0(desired, seen):
    """0 reads as started long ago: no allowance without a container that starts."""
    StatusPublisher.observation(desired, with_head_container(desired, seen, state="exited"), {})
    assert value("reconciler_serving_started_timestamp_seconds", deployment="default") == 0


def test_step_failures_count_until_the_step_succeeds(publisher):
    backoff = Backoff(Retries())
    for now in (0.0, 10.0):
        backoff.failed("await-health/head", "timed out after 600s", now)
    backoff.failed("stop-container/worker1/a", "x", 0.0)
    backoff.failed("stop-container/worker1/b", "x", 0.0)
    backoff.failed("stop-container/worker1/b", "x", 1.0)
    publisher.failures(backoff.failures())
    assert value("reconciler_step_failures", kind="await-health", node="head") == 2
    assert value("reconciler_step_failures", kind="stop-container", node="worker1") == 2  # the most of one kind
    backoff.succeeded("await-health/head")
    publisher.failures(backoff.failures())
    assert value("reconciler_step_failures", kind="await-health", node="head") == 0
    assert value("reconciler_step_failures", kind="stop-container", node="worker1") == 2


def test_node_roles_follow_the_desired_state(publisher, desired):
    publisher.roles(desired)
    assert {(n.name, n.role) for n in desired.nodes if value("reconciler_node_role", node=n.name, role=n.role) == 1} \
        == {(n.name, n.role) for n in desired.nodes}
    assert value("reconciler_node_role", node=desired.head.name, role="head") == 1
    fewer = desired.model_copy(update={"nodes": [n for n in desired.nodes if n.name != "worker3"]})
    publisher.roles(fewer)
    assert value("reconciler_node_role", node="worker3", role="worker") is None
