"""Issue 35: every series about one deployment carries its name (`deployment`), and `reconciler_deployment_info`
says what each deployment in force serves, so dashboards and alerts join on the name (monitoring/, checked by
tests/unit/repo/test_monitoring.py) and a version serving several deployments needs no relabelling.

Read back from the registry Prometheus scrapes, after the publisher wrote them as the controller does: the
observation sets the serving gauges, `roles` (each publish, with the desired state in force) the info gauge and the
removal of what is no longer in force.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from reconciler.core.spec import SINGLE, Desired
from reconciler.loop import metrics
from reconciler.loop.reasons import Reason
from reconciler.loop.status import StatusPublisher, endpoint


def series(name: str) -> list[dict[str, str]]:
    """The label sets of `name` a scrape gets now."""
    return [s.labels for family in metrics.REGISTRY.collect() for s in family.samples if s.name == name]


def deployments_of(name: str) -> set[str]:
    return {labels["deployment"] for labels in series(name)}


SERVING = [g._name for g in metrics.PER_DEPLOYMENT]


@pytest.fixture(autouse=True)
def no_deployment_before_or_after() -> Iterator[None]:
    """The registry is the process's: start and end with no deployment in force, whatever other tests left."""
    metrics.set_deployments([])
    yield
    metrics.set_deployments([])


@pytest.fixture
def publisher(tmp_path) -> StatusPublisher:
    return StatusPublisher(tmp_path / "cluster.yaml")


def renamed(desired: Desired, name: str, **serving: object) -> Desired:
    one = desired.deployment
    return desired.model_copy(update={"deployments": [one.model_copy(update={
        "name": name, "serving": one.serving.model_copy(update=serving)})]})


def test_every_serving_series_carries_the_deployment_s_name(desired, seen, publisher):
    """A file of the single form is the deployment `default`; the probe's verdicts are exported under it."""
    assert desired.deployment.name == SINGLE == "default"
    StatusPublisher.observation(desired, seen, {})
    publisher.roles(desired)
    for name in SERVING:
        assert deployments_of(name) == {"default"}, name
    assert metrics.REGISTRY.get_sample_value("reconciler_serving_healthy", {"deployment": "default"}) == 1
    assert metrics.REGISTRY.get_sample_value("reconciler_serving_health_timeout_seconds",
                                             {"deployment": "default"}) == desired.serving.health_timeout


def test_the_info_gauge_names_model_served_name_and_endpoint(desired, publisher):
    publisher.roles(desired)
    [info] = series("reconciler_deployment_info")
    assert info == {"deployment": "default", "model": desired.model.id, "served_name": desired.served_name,
                    "endpoint": endpoint(desired)}
    assert metrics.REGISTRY.get_sample_value("reconciler_deployment_info", info) == 1
    [line] = [x for x in generate_latest(metrics.REGISTRY).decode().splitlines()
              if x.startswith("reconciler_deployment_info{")]
    assert 'deployment="default"' in line and f'model="{desired.model.id}"' in line and line.endswith(" 1.0")


def test_a_deployment_renamed_by_an_edit_leaves_every_series(desired, seen, publisher):
    """The old name's series go at the first publish with the new file in force (a stale `default` would keep
    ServingUnhealthy judging a deployment that no longer exists), the new name's stay."""
    StatusPublisher.observation(desired, seen, {})
    publisher.roles(desired)
    chat = renamed(desired, "chat")
    StatusPublisher.observation(chat, seen, {})
    publisher.roles(chat)
    for name in [*SERVING, "reconciler_deployment_info"]:
        assert deployments_of(name) == {"chat"}, name
    assert 'deployment="default"' not in generate_latest(metrics.REGISTRY).decode()


def test_an_observation_after_the_last_publish_of_a_name_still_leaves(desired, seen, publisher):
    """The removal reads what the gauges export, not what the publisher remembers: a serving series set under a
    name never published (an observation racing an edit) goes at the next publish too."""
    StatusPublisher.observation(renamed(desired, "old"), seen, {})
    publisher.roles(desired)
    for name in SERVING:
        assert deployments_of(name) == set(), name  # observed under `old`, which is not in force
    StatusPublisher.observation(desired, seen, {})
    assert deployments_of("reconciler_serving_busy") == {"default"}


def test_a_new_model_under_the_same_name_replaces_the_info_series(desired, publisher):
    publisher.roles(desired)
    other = desired.with_deployment(model=desired.model.model_copy(update={"id": "Qwen/Qwen3-0.6B"}))
    publisher.roles(other)
    assert [info["model"] for info in series("reconciler_deployment_info")] == ["Qwen/Qwen3-0.6B"]


def test_several_deployments_have_one_info_series_each(desired, publisher):
    """The file's list, whether this version serves it or not: the label is ready for the version that does."""
    one = desired.deployment
    two = one.model_copy(update={"name": "embed", "serving": one.serving.model_copy(update={"port": 8001})})
    both = desired.model_copy(update={"deployments": [one, two]})
    publisher.roles(both)
    assert {(i["deployment"], i["endpoint"].rsplit(":", 1)[1]) for i in series("reconciler_deployment_info")} == \
        {("default", f"{one.serving.port}/v1"), ("embed", "8001/v1")}
    publisher.roles(desired)
    assert deployments_of("reconciler_deployment_info") == {"default"}


@pytest.mark.parametrize(("bind", "host", "url"), [
    ("0.0.0.0", "10.0.0.1", "http://10.0.0.1:8123/v1"),            # serves other machines: the head's address
    ("0.0.0.0", "spark-head.lan", "http://spark-head.lan:8123/v1"),
    ("0.0.0.0", "fd00::1", "http://[fd00::1]:8123/v1"),           # an IPv6 literal in brackets
    ("127.0.0.1", "10.0.0.1", "http://127.0.0.1:8123/v1"),          # loopback: only the head itself can ask
])
def test_the_endpoint_is_where_a_client_reaches_the_api(desired, bind, host, url):
    head = desired.head
    moved = desired.model_copy(update={"nodes": [
        n.model_copy(update={"ssh": n.ssh.model_copy(update={"host": host})}) if n is head else n
        for n in desired.nodes]})
    served = moved.with_deployment(serving=moved.serving.model_copy(update={"host": bind, "port": 8123}))
    assert endpoint(served) == url


def test_the_daemon_exports_the_deployment_in_force_and_drops_the_old_name_on_an_edit(desired_path, tmp_path,
                                                                                      converged):
    """Through the controller, as the daemon runs: each reconcile's observation and publish. The sample file of the
    single form is `default`; the same file as a list naming its deployment `chat` replaces it at the reconcile
    that reads the edit."""
    import yaml

    from tests.unit.loop.test_controller_loop import Gate, Script, _controller

    gate = Gate()
    c, _ = _controller(desired_path, tmp_path, Script(converged), gate)
    try:
        c.reconcile({Reason("start")})
        for name in [*SERVING, "reconciler_deployment_info"]:
            assert deployments_of(name) == {"default"}, name
        doc = yaml.safe_load(desired_path.read_text())
        doc["deployments"] = [{"name": "chat", "model": doc.pop("model"), "serving": doc.pop("serving")}]
        desired_path.write_text(yaml.safe_dump(doc, sort_keys=False) + "...\n")  # the end marker a save must have
        c.reconcile({Reason("file")})
        assert c.desired is not None and c.desired.deployment.name == "chat"
        for name in [*SERVING, "reconciler_deployment_info"]:
            assert deployments_of(name) == {"chat"}, name
    finally:
        gate.release.set()
        assert c.operations.join(20)
