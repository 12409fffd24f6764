"""systemd's readiness protocol without a dependency: one datagram to $NOTIFY_SOCKET.

READY=1 once the model is loaded, warmed up and the socket listens (Type=notify units start
their dependents then); STOPPING=1 when SIGTERM starts the drain. Outside systemd (no
NOTIFY_SOCKET) every call is a no-op returning False.
"""

from __future__ import annotations

import logging
import socket

from outrider import env

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1", "STOPPING=1", "STATUS=draining") to systemd; True when
    sent. A leading '@' in the socket path names an abstract-namespace socket."""
    path = env.notify_socket()
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as e:  # systemd gone or the path wrong: readiness is advisory, keep serving
        log.warning("sd_notify %r to %r failed: %s", state, path, e)
        return False
    return True
