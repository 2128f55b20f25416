"""Sticky sessions: requests carrying one session id go to the workers its last request used
(its conversation's KV is there), while those workers are up and the session is fresh."""
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.errors import ConfigError
from pdserve.common.ids import WorkerId


@dataclass(frozen=True, slots=True)
class SessionRoute:
    decode: WorkerId
    prefill: WorkerId | None
    expires_at: float


class SessionAffinity:
    """At most `max_sessions` sessions, each forgotten `ttl_s` after its last request."""

    def __init__(self, ttl_s: float, max_sessions: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ConfigError("session_ttl_s", ttl_s, "must be > 0")
        self._ttl_s = ttl_s
        self._max_sessions = max_sessions
        self._clock = clock
        self._routes: OrderedDict[str, SessionRoute] = OrderedDict()

    def get(self, session_id: str) -> SessionRoute | None:
        route = self._routes.get(session_id)
        if route is not None and route.expires_at <= self._clock():
            del self._routes[session_id]
            return None
        return route

    def remember(self, session_id: str, decode: WorkerId, prefill: WorkerId | None) -> None:
        self._routes[session_id] = SessionRoute(decode, prefill, self._clock() + self._ttl_s)
        self._routes.move_to_end(session_id)
        while len(self._routes) > self._max_sessions:
            self._routes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._routes)
