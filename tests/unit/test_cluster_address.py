"""A Ray cluster address that nothing answers at is a config error at once (Ray itself retries it for minutes),
naming the key it came from; a listening address and ``auto`` pass through to Ray."""

from __future__ import annotations

import socket

import pytest

from dhp.errors import ConfigError
from dhp.runtime.cluster import check_reachable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_nothing_answers_at_is_a_config_error(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = _free_port()  # closed again: connections are refused
    with pytest.raises(ConfigError, match=rf"runtime.ray_address=127.0.0.1:{port}: no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match="ray://127.0.0.1"):
        check_reachable(f"ray://127.0.0.1:{port}")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"RAY_ADDRESS=127.0.0.1:{port}: .*unset RAY_ADDRESS"):
        check_reachable(f"127.0.0.1:{port}")


def test_a_listening_address_and_auto_pass():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
    check_reachable("auto")  # Ray's to resolve
