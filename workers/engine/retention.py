"""Which cached block to evict next, in the device cache and in the host tier alike (issue #15).

Conversations come back: a chat or agent session's next turn reuses everything the last turn cached,
usually seconds to minutes later. Plain LRU evicts a live conversation's history as soon as enough
one-off traffic passes by. So evictable blocks fall into two classes:

1. sessionless or ended: the last request that used the block had no session hint, or its session has
   had no turn for `session_idle_s` seconds. Evicted first, least recently released first.
2. live session: the last request that used the block belonged to a session active within
   `session_idle_s`. Evicted only when class 1 is empty: the least recently active session first,
   least recently released first within it.

A session is active when one of its requests arrives or releases blocks (`touch`). Counters
`evicted_sessionless` / `evicted_live_session` count evictions per class.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Hashable, Iterator

Item = Hashable


class SessionAwareLRU:
    def __init__(self, session_idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.session_idle_s = session_idle_s
        self.clock = clock
        self._plain: OrderedDict[Item, None] = OrderedDict()  # class 1, first is evicted first
        self._live: dict[str, OrderedDict[Item, None]] = {}  # class 2: session -> its evictable items
        self._session_of: dict[Item, str] = {}
        self._last_seen: OrderedDict[str, float] = OrderedDict()  # sessions, least recently active first
        self.evicted_sessionless = 0
        self.evicted_live_session = 0

    def __len__(self) -> int:
        return len(self._plain) + len(self._session_of)

    def __contains__(self, item: Item) -> bool:
        return item in self._plain or item in self._session_of

    def __iter__(self) -> Iterator[Item]:
        yield from self._plain
        for items in self._live.values():
            yield from items

    def touch(self, session: str | None) -> None:
        """Marks `session` active now (a turn arrived or finished)."""
        if session is None:
            return
        self._expire()
        self._last_seen[session] = self.clock()
        self._last_seen.move_to_end(session)

    def session_of(self, item: Item) -> str | None:
        return self._session_of.get(item)

    def add(self, item: Item, session: str | None = None) -> None:
        """Makes `item` evictable as the most recently released one of its class."""
        self.discard(item)
        if session is not None and self._is_live(session):
            self._live.setdefault(session, OrderedDict())[item] = None
            self._session_of[item] = session
        else:
            self._plain[item] = None

    def discard(self, item: Item) -> None:
        """Takes `item` out (it is in use again, or gone)."""
        if self._plain.pop(item, 0) is None:
            return
        session = self._session_of.pop(item, None)
        if session is not None:
            items = self._live[session]
            del items[item]
            if not items:
                del self._live[session]

    def pop(self) -> tuple[Item, str | None]:
        """Removes and returns the next item to evict and the live session it belonged to (None if class 1)."""
        self._expire()
        if self._plain:
            item, _ = self._plain.popitem(last=False)
            self.evicted_sessionless += 1
            return item, None
        for session in self._last_seen:
            items = self._live.get(session)
            if items:
                item, _ = items.popitem(last=False)
                if not items:
                    del self._live[session]
                del self._session_of[item]
                self.evicted_live_session += 1
                return item, session
        raise KeyError("nothing to evict")

    def clear(self) -> None:
        self._plain.clear()
        self._live.clear()
        self._session_of.clear()

    def _is_live(self, session: str) -> bool:
        seen = self._last_seen.get(session)
        return seen is not None and seen >= self.clock() - self.session_idle_s

    def _expire(self) -> None:
        """Sessions idle for `session_idle_s`: forgotten, their items moved to the front of class 1."""
        horizon = self.clock() - self.session_idle_s
        while self._last_seen:
            session, seen = next(iter(self._last_seen.items()))
            if seen >= horizon:
                break
            del self._last_seen[session]
            for item in reversed(self._live.pop(session, OrderedDict())):
                del self._session_of[item]
                self._plain[item] = None
                self._plain.move_to_end(item, last=False)
