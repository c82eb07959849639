"""Issue 33, item 4: `reconciler verify` asks the running daemon, and only who can read its status key may.

The listener's side: `POST /verify` is refused (401, nothing started) without the HMAC of the daemon's status key,
with another key's, or sent a second time (its challenge is spent), and a challenge is good for CHALLENGE_LIFE only.
The command's side (reconciler/edge/daemon_client.py) against the real listener, controller and loop (fakes for the
nodes): the result comes back and decides the exit code; no daemon, a key it cannot read, another daemon's file, a
daemon that forgets or stops answering each end in their own way.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from reconciler.core.exits import Exit
from reconciler.edge import daemon_client as client
from reconciler.loop.daemon import Daemon
from reconciler.loop.reasons import Reason
from reconciler.loop.server import CHALLENGE_LIFE, CHALLENGES, Challenges, make_status_key, serve
from testbed.proc import free_port
from tests.unit.loop.test_controller_loop import WORKER, Gate, Script
from tests.unit.loop.test_verify_daemon import MATCH, FakeVerify, controller

KEY = b"k" * 64


def post(url: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


class Handler:
    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, doc):
        self.calls.append(doc)
        return 202, {"id": "r1", "pid": 1}


@pytest.fixture
def listener():
    started = []

    def start(key=KEY, handler=None, status=lambda: {"phase": "Converged"}):
        server = serve("127.0.0.1:0", status, key=key, verify=handler)
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()


def signed(url: str, key: bytes = KEY, **fields) -> tuple[bytes, dict]:
    _, answer = post(f"{url}/verify/challenge")
    body = json.dumps({"challenge": answer["challenge"], "file": "/etc/c.yaml", "repair": True, "node": None,
                       **fields}).encode()
    return body, {client.PROOF_HEADER: client.request_proof(key, body), "Content-Type": "application/json"}


def test_a_request_without_the_keys_proof_is_refused_and_starts_nothing(listener):
    handler = Handler()
    url = listener(handler=handler)
    body, _ = signed(url)
    code, answer = post(f"{url}/verify", body, {"Content-Type": "application/json"})
    assert code == 401 and "status key" in answer["error"]
    body, headers = signed(url, key=b"another key, not the daemon's")
    assert post(f"{url}/verify", body, headers)[0] == 401
    assert handler.calls == []


def test_a_request_heard_once_cannot_be_sent_again(listener):
    handler = Handler()
    url = listener(handler=handler)
    body, headers = signed(url)
    assert post(f"{url}/verify", body, headers) == (202, {"id": "r1", "pid": 1})
    code, answer = post(f"{url}/verify", body, headers)
    assert code == 401 and "spent" in answer["error"]
    assert len(handler.calls) == 1 and handler.calls[0]["repair"] is True


def test_a_challenge_the_daemon_did_not_issue_is_refused(listener):
    handler = Handler()
    url = listener(handler=handler)
    body = json.dumps({"challenge": "0" * 32, "file": "/etc/c.yaml", "repair": True, "node": None}).encode()
    assert post(f"{url}/verify", body, {client.PROOF_HEADER: client.request_proof(KEY, body)})[0] == 401
    assert handler.calls == []


def test_a_challenge_is_good_once_and_for_its_life_only():
    now = [0.0]
    challenges = Challenges(clock=lambda: now[0])
    first, late = challenges.issue(), challenges.issue()
    assert challenges.take(first) and not challenges.take(first)
    now[0] = CHALLENGE_LIFE + 1
    assert not challenges.take(late), "expired"
    kept = [challenges.issue() for _ in range(CHALLENGES + 1)]
    assert not challenges.take(kept[0]) and challenges.take(kept[-1]), "a flood forgets the oldest only"
    assert not challenges.take(None) and not challenges.take(["x"])


def test_only_post_and_only_a_daemon_with_a_key(listener):
    url = listener(key=None, handler=Handler())
    with pytest.raises(urllib.error.HTTPError) as got:
        urllib.request.urlopen(f"{url}/verify", timeout=5)
    assert got.value.code == 405
    body = json.dumps({"challenge": "x"}).encode()
    assert post(f"{url}/verify", body)[0] == 503, "no key (a read-only state dir): nobody can prove anything"


# -- the command's side, against the real listener, controller and loop ------------------------------------------


@pytest.fixture
def daemon(desired_path, tmp_path, converged):
    """A daemon's controller, loop and listener (fakes for the nodes), its state dir holding its status key."""
    made = []

    def start(*verify_results):
        c, _ = controller(desired_path, tmp_path, Script(converged), Gate(), FakeVerify(*verify_results))
        state = tmp_path / "state"
        c.reload()  # as Daemon.run: the desired state is read before the listener answers
        d = Daemon(desired_path, state, controller=c)
        d.requests = c.requests  # one queue of triggers, as when the daemon makes its controller
        server = serve("127.0.0.1:0", lambda: c.status, key=make_status_key(state), verify=c.verify_request)
        loop = threading.Thread(target=d._loop, daemon=True)
        loop.start()
        made.append((d, server, loop))
        return c, f"http://127.0.0.1:{server.server_address[1]}", state

    yield start
    for d, server, loop in made:
        d.stop.set()
        d.requests.request(Reason("signal"))
        loop.join(10)
        server.shutdown()


def test_the_daemons_result_decides_the_exit_code(daemon, desired_path):
    c, url, state = daemon(MATCH)
    said: list[str] = []
    results = client.verify_by_daemon(url, state, str(desired_path), repair=True, only=None, say=said.append,
                               sleep=lambda s: None)
    assert [r["outcome"] for r in results] == ["match"] and client.exit_code(results) == Exit.OK
    assert any("accepted by the daemon" in line for line in said)
    assert c.status["verifyRequests"][-1]["repair"] is True


def test_files_that_differ_exit_2(daemon, desired_path):
    differ = {**MATCH, "outcome": "differ", "mismatched": ["blobs/x"], "repaired": ["blobs/x"]}
    _, url, state = daemon(differ)
    results = client.verify_by_daemon(url, state, str(desired_path), repair=True, only=WORKER, sleep=lambda s: None)
    assert client.exit_code(results) == Exit.CHANGES and results[0]["repaired"] == ["blobs/x"]


def test_who_cannot_read_the_key_cannot_have_the_daemon_verify(daemon, desired_path, tmp_path):
    c, url, _state = daemon(MATCH)
    with pytest.raises(client.Failed) as got:
        client.verify_by_daemon(url, tmp_path / "not-the-state-dir", str(desired_path), repair=True, only=None)
    assert got.value.code == Exit.ERROR and "status key" in got.value.message
    assert c.status["verifyRequests"] == [], "nothing was asked"


def test_another_daemons_file_is_held_and_a_repair_it_does_not_enforce_is_declined(daemon, desired_path):
    _, url, state = daemon(MATCH)
    copy = desired_path.with_name("copy.yaml")
    copy.write_text(desired_path.read_text())
    with pytest.raises(client.Failed) as got:
        client.verify_by_daemon(url, state, str(copy), repair=True, only=None)
    assert got.value.code == Exit.HELD and str(desired_path) in got.value.message
    desired_path.write_text(desired_path.read_text().replace("paused: false", "paused: true"))
    c, url, state = daemon(MATCH)
    with pytest.raises(client.Declined):
        client.verify_by_daemon(url, state, str(desired_path), repair=True, only=None)


def test_no_daemon_listening_means_verify_here():
    with pytest.raises(client.NoDaemon):
        client.verify_by_daemon(f"http://127.0.0.1:{free_port()}", Path("/nonexistent"), "c.yaml", repair=True,
                                only=None)


def test_a_daemon_that_forgets_the_request_or_never_answers_in_time(listener, tmp_path):
    (tmp_path / "status.key").write_bytes(KEY)

    def status(records):
        def doc():
            return {"phase": "Converged", "verifyRequests": records}
        return doc

    url = listener(handler=Handler(), status=status([]))
    with pytest.raises(client.Failed) as got:
        client.verify_by_daemon(url, tmp_path, "c.yaml", repair=False, only=None, sleep=lambda s: None)
    assert got.value.code == Exit.ERROR and "no longer knows verify request r1" in got.value.message
    url = listener(handler=Handler(), status=status([{"id": "r1", "state": "pending", "waiting": "x"}]))
    with pytest.raises(client.Failed) as got:
        client.verify_by_daemon(url, tmp_path, "c.yaml", repair=False, only=None, wait=0, sleep=lambda s: None)
    assert got.value.code == Exit.ERROR and "deadline" in got.value.message


def test_a_daemon_that_stops_answering_while_it_verifies_is_unreachable(tmp_path):
    (tmp_path / "status.key").write_bytes(KEY)
    server = serve("127.0.0.1:0", lambda: {"phase": "Converged", "verifyRequests": [{"id": "r1", "state": "pending"}]},
                   key=KEY, verify=Handler())
    now = [0.0]

    def sleep(seconds):
        server.shutdown()  # gone after the first look
        now[0] += seconds

    with pytest.raises(client.Failed) as got:
        client.verify_by_daemon(f"http://127.0.0.1:{server.server_address[1]}", tmp_path, "c.yaml", repair=False,
                         only=None, sleep=sleep, monotonic=lambda: now[0])
    assert got.value.code == Exit.UNREACHABLE and now[0] >= client.LOST_AFTER


def test_an_answer_without_the_daemons_proof_is_not_believed(listener, tmp_path):
    (tmp_path / "status.key").write_bytes(KEY)
    url = listener(key=b"a squatter's own key", handler=Handler(),
                   status=lambda: {"phase": "Converged", "verifyRequests": [{"id": "r1", "state": "done",
                                                                             "results": []}]})
    with pytest.raises(client.Failed) as got:
        client.verify_by_daemon(url, tmp_path, "c.yaml", repair=False, only=None, sleep=lambda s: None)
    assert got.value.code == Exit.ERROR and "proof" in got.value.message
