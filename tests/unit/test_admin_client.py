"""The admin clients re-send an idempotent call whose connection the server dropped (a keep-alive connection
closed just as it was re-used), and never re-send one that is not idempotent."""

from __future__ import annotations

import json
import socket
import struct
import threading

import httpx
import pytest

from serving.client import AdminError, RoutesClient


class DropFirst(threading.Thread):
    """A loopback HTTP server that resets its first `drops` connections without answering, then answers every
    request with `status` and `body`. Counts the connections it saw."""

    def __init__(self, drops: int, status: bytes = b"200 OK", body: bytes = b'{"routes": {}}'):
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.drops, self.connections = self.sock.getsockname()[1], drops, 0
        self.status, self.body = status, body

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.recv(65536)  # the request
                if self.connections <= self.drops:  # RST instead of an answer
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue
                conn.sendall(
                    b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (self.status, len(self.body), self.body)
                )

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def server(request):
    s = DropFirst(request.param)
    s.start()
    yield s
    s.close()


@pytest.mark.parametrize("server", [2], indirect=True)
def test_a_dropped_connection_under_a_read_is_retried(server) -> None:
    assert RoutesClient(f"http://127.0.0.1:{server.port}", "t", timeout_s=5).show().routes == {}
    assert server.connections == 3


@pytest.mark.parametrize("server", [3], indirect=True)
def test_a_read_gives_up_after_its_retries_with_the_transport_error(server) -> None:
    with pytest.raises(httpx.TransportError):
        RoutesClient(f"http://127.0.0.1:{server.port}", "t", timeout_s=5).show()
    assert server.connections == 3


@pytest.mark.parametrize("server", [1], indirect=True)
def test_a_route_change_that_is_not_idempotent_is_never_resent(server) -> None:
    with pytest.raises(httpx.TransportError):
        RoutesClient(f"http://127.0.0.1:{server.port}", "t", timeout_s=5).rollback("tab", reason="x")
    assert server.connections == 1


def test_an_error_answer_is_not_retried_and_names_the_service() -> None:
    server = DropFirst(0, b"404 Not Found", b'{"detail": "no such model"}')
    server.start()
    with pytest.raises(AdminError, match="gateway answered 404: no such model"):
        RoutesClient(f"http://127.0.0.1:{server.port}", "t", timeout_s=5).show()
    server.close()
    assert server.connections == 1


def test_route_guard_reads_the_table_file_when_the_gateway_does_not_answer(tmp_path):
    """What the supervisor must not unload: the versions the route table names (from the file a gateway that is
    down will route by again), else the serving version."""
    from serving.route_guard import RoutedVersion, RouteGuard, RoutesUnknown
    from serving.routes import ArmSpec, ModelRoutes, RouteTable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    guard = RouteGuard(dead, "t" * 16, tmp_path / "routes.json", timeout_s=2)
    assert guard.routed_versions("tab", serving_version=1) == {1}  # no table: the serving version only
    RouteTable(tmp_path / "routes.json").set(
        ModelRoutes(
            model="tab",
            arms=[ArmSpec(name="control", version=1, weight=0.8), ArmSpec(name="canary", version=3, weight=0.2)],
            updated_ms=0,
            updated_by="test",
            reason="",
        )
    )
    assert guard.routed_versions("tab", serving_version=1) == {1, 3}
    assert guard.routed_versions("other", serving_version=2) == {2}
    with pytest.raises(RoutedVersion, match=r"tab@v3 still gets traffic.*tidal route rollback tab"):
        guard.check_unload("tab", 3, "tab@v3", serving_version=1)
    guard.check_unload("tab", 2, "tab@v2", serving_version=1)  # not routed: allowed
    (tmp_path / "routes.json").write_text("{torn")
    with pytest.raises(RoutesUnknown, match="did not answer.*force"):
        guard.routed_versions("tab", serving_version=1)


def test_the_fleet_status_is_read_typed_and_an_answer_of_another_shape_is_refused() -> None:
    from pydantic import ValidationError

    from serving.client import FleetClient

    replica = {
        "name": "tab-0",
        "state": "ready",
        "url": "http://127.0.0.1:8100",
        "pid": 42,
        "base_version": 1,
        "served": {"tab@v1": 1, "tab@v3": 3},
        "restarts": 0,
        "last_error": "",
    }
    group = {
        "strategy": "lora",
        "base_version": 1,
        "serving_version": 1,
        "adapters": [3],
        "surge_versions": [],
        "desired_replicas": 1,
        "replicas": [replica],
    }
    status = {"ready": True, "error": None, "engine_flavor": "cpu", "runtime": "local", "models": {"tab": group}}
    server = DropFirst(0, body=json.dumps(status).encode())
    server.start()
    try:
        [r] = FleetClient(f"http://127.0.0.1:{server.port}", "t", timeout_s=5).replicas("tab")
        assert (r.state, r.served["tab@v3"], r.pid, r.pod) == ("ready", 3, 42, None)
        server.body = json.dumps({**status, "models": {"tab": {**group, "replicas": [{**replica, "state": "asleep"}]}}}).encode()
        with pytest.raises(ValidationError, match="state"):  # a state the fleet does not have: refused, not passed on
            FleetClient(f"http://127.0.0.1:{server.port}", "t", timeout_s=5).status()
    finally:
        server.close()
