"""The lossy link's TCP relay, on loopback (the namespace and netem need root and a netem kernel)."""

from __future__ import annotations

import socket
import threading

from benchmarks.load_netem import Impairment, Relay


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_relay_carries_bytes_both_ways_and_stops():
    srv, port = _echo_server()
    relay = Relay("127.0.0.1", ("127.0.0.1", port))
    try:
        relay_port = relay.start()
        assert relay_port != port
        for _ in range(2):  # a second connection after the first closed
            with socket.create_connection(("127.0.0.1", relay_port), timeout=5) as c:
                payload = b"x" * 200_000
                c.sendall(payload)
                got = b""
                while len(got) < len(payload):
                    got += c.recv(65536)
                assert got == payload.upper()
    finally:
        relay.stop()
        srv.close()
    try:
        socket.create_connection(("127.0.0.1", relay_port), timeout=1).close()
        raise AssertionError("the relay still listens after stop()")
    except OSError:
        pass


def test_netem_arguments():
    assert Impairment(1.5, 20, 3).netem_args() == ["netem", "loss", "1.5%", "delay", "20ms", "3ms"]
