"""`ssh.fallback_hosts`: the path to a node falls back to its other addresses in order, only when the address
before gave no path; the host key is checked under `host` whatever the path (reconciler/edge/ssh/session.py)."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from reconciler.core.spec import Ssh
from reconciler.edge.ssh import session as ssh_session
from reconciler.edge.ssh.errors import Unreachable


def session(monkeypatch, answering: set[str], **ssh: object) -> tuple[ssh_session.Session, list[str]]:
    tried: list[str] = []

    def tcp(host: str, port: int, timeout: float) -> socket.socket:
        tried.append(host)
        if host not in answering:
            raise ConnectionRefusedError(111, "Connection refused")
        return socket.socket()

    monkeypatch.setattr(ssh_session, "_tcp", tcp)
    return ssh_session.Session("worker", Ssh(host="192.168.200.13", known_hosts="/kh", **ssh)), tried


def test_the_first_address_that_answers_is_the_path(monkeypatch):
    s, tried = session(monkeypatch, {"192.168.201.13"}, fallback_hosts=["192.168.201.13", "10.0.0.13"])
    s._path().close()
    assert tried == ["192.168.200.13", "192.168.201.13"], "in order, and no further once one answered"


def test_host_answering_never_tries_a_fallback(monkeypatch):
    s, tried = session(monkeypatch, {"192.168.200.13", "192.168.201.13"}, fallback_hosts=["192.168.201.13"])
    s._path().close()
    assert tried == ["192.168.200.13"]


def test_no_address_answering_says_each(monkeypatch):
    s, tried = session(monkeypatch, set(), fallback_hosts=["192.168.201.13"])
    with pytest.raises(Unreachable) as caught:
        s._path()
    assert tried == ["192.168.200.13", "192.168.201.13"]
    assert caught.value.message == ("no address answered: 192.168.200.13:22: [Errno 111] Connection refused; "
                                    "192.168.201.13:22: [Errno 111] Connection refused")


@pytest.mark.parametrize("fallbacks", [["192.168.200.13"], ["10.0.0.1", "10.0.0.1"]])
def test_a_fallback_repeating_an_address_is_refused(fallbacks):
    with pytest.raises(ValidationError, match="fallback_hosts must name addresses other than"):
        Ssh(host="192.168.200.13", known_hosts="/kh", fallback_hosts=fallbacks)
