"""``private_head`` starts again, with fresh ports, when another process takes one of the ports
it found free before ``ray start`` binds it (seen in a clean-clone CI run: the GCS port was
taken, ``ray start`` exited, the test failed)."""

from __future__ import annotations

import socket

import pytest

import private_head as ph

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_a_head_whose_gcs_port_is_taken_starts_again_on_fresh_ports(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    calls = []
    real = ph.free_ports

    def first_with_a_taken_gcs_port(n: int) -> list[int]:
        ports = real(n)
        calls.append(ports)
        return [port] + ports[1:] if len(calls) == 1 else ports

    monkeypatch.setattr(ph, "free_ports", first_with_a_taken_gcs_port)
    try:
        with ph.private_head() as head:
            assert len(calls) == 2, "the first start lost its GCS port and was tried again"
            assert head.gcs_address != f"127.0.0.1:{port}"
            assert head.session_pids(), "the second start is up"
    finally:
        taken.close()
