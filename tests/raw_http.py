"""Raw-socket helpers for the tests that send HTTP byte by byte to a server on 127.0.0.1."""

from __future__ import annotations

import socket


def connect(srv, timeout: float = 5.0) -> socket.socket:
    """A TCP connection to the test server ``srv`` (its ``port``)."""
    return socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)


def read_to_close(s: socket.socket, within: float) -> bytes | None:
    """Everything the server sends until it closes the connection, or ``None`` if it has not closed it within
    ``within`` seconds."""
    s.settimeout(within)
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return b"".join(chunks)
