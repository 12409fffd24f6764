"""systemd's readiness and watchdog protocol without a dependency: datagrams to $NOTIFY_SOCKET.

READY=1 once the model is loaded, warmed up and the socket listens (Type=notify units start
their dependents then); STOPPING=1 when SIGTERM starts the drain; WATCHDOG=1 every half
WatchdogSec while the engine thread's heartbeat is fresh (Watchdog). Outside systemd (no
NOTIFY_SOCKET) every call is a no-op returning False.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

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


class Watchdog:
    """systemd's watchdog (WatchdogSec= in the unit): WATCHDOG=1 every `interval_s` while
    `fresh()` holds, nothing while it does not.

    `fresh` is AsyncEngine.is_responsive: the engine thread beat within its stall limit. A slow
    step whose layers keep beating keeps the pings going; a stuck engine thread stops them, and
    systemd kills and restarts the service WatchdogSec after the last one. tick() runs on the
    event loop (OutriderServer.on_tick, every 0.1 s), so a blocked event loop stops them too.
    """

    def __init__(
        self,
        interval_s: float,
        fresh: Callable[[], bool],
        send: Callable[[str], bool] = notify,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s, self.fresh, self.send, self.clock = interval_s, fresh, send, clock
        self._next = clock()  # the first tick pings
        self._stale = False

    @classmethod
    def from_env(cls, fresh: Callable[[], bool]) -> Watchdog | None:
        """A watchdog pinging every half WATCHDOG_USEC (sd_watchdog_enabled(3)'s advice), or
        None when systemd asks for none, or asks it of another process (WATCHDOG_PID)."""
        usec, pid = env.watchdog_usec(), env.watchdog_pid()
        if usec is None or (pid is not None and pid != os.getpid()):
            return None
        return cls(usec / 2e6, fresh)

    def tick(self) -> bool:
        """Ping if one is due and the engine is fresh; True when a ping was sent."""
        now = self.clock()
        if now < self._next:
            return False
        if not self.fresh():
            if not self._stale:
                log.error(
                    "the engine thread has stopped beating: watchdog pings stop, and systemd "
                    "restarts the service unless it recovers within WatchdogSec"
                )
            self._stale = True
            return False  # due again at the next tick: a recovery pings at once
        if self._stale:
            log.warning("the engine thread beats again: watchdog pings resume")
            self._stale = False
        self._next = now + self.interval_s
        return self.send("WATCHDOG=1")
