"""Which conversations keep their KV caches, and dropping them so that memory stays bounded however many
clients come and go.

Each browser tab or API client (one Gradio session) owns at most one comparison; its engine Session keeps
every method's cache so follow-ups can continue. The registry drops those caches (Session.release(): the
answers and charts stay, a follow-up then asks to run Compare again) when

* the client disconnects, Clear is pressed, or the owner starts a new comparison;
* it has not been used for `idle_s` seconds;
* more than `max_sessions` comparisons hold caches (least recently used first);
* a new run would push the caches of all comparisons over `cache_limit_bytes` (a run going counts what it may
  still reach: several users' runs go at once), or the process's resident
  memory is over `memory_limit_bytes` (idle ones are dropped first; if that is not enough the new run is
  refused with a message instead of exhausting the machine).

Releasing waits for the engine's lock, so drops not needed before the next run (a disconnect, an idle
timeout) happen on one background thread and never block a request handler.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from prefixkv_core.limits import MB, LimitError, Limits, process_memory_bytes, return_free_memory

log = logging.getLogger(__name__)

REASONS = {
    "idle": "this comparison was idle for {idle} and its caches were released",
    "lru": "this comparison's caches were released to make room for newer comparisons",
    "memory": "this comparison's caches were released because the server needed the memory",
    "closed": "the connection closed and this comparison's caches were released",
}


@dataclass
class _Entry:
    owner: str
    session: Any  # prefixkv_core.Session
    last_used: float
    busy: bool = False
    stop: Callable[[], None] | None = None  # cancels the owner's run, if one is going
    forget: Callable[[str | None], None] | None = None  # lets go of what the owner keeps beside (the reason)

    def dropped(self, reason: str | None) -> None:
        if self.forget is not None:
            self.forget(reason)


def _cache_bytes(session: Any) -> int:
    try:
        return int(session.cache_bytes())
    except Exception:  # noqa: BLE001 - a cache dropped while being summed: it no longer counts
        return 0


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} minutes" if seconds >= 60 else f"{seconds:g} seconds"


class SessionRegistry:
    """Bounded set of comparisons that hold KV caches (thread-safe)."""

    def __init__(self, limits: Limits, *, clock: Callable[[], float] = time.monotonic,
                 memory: Callable[[], int | None] = process_memory_bytes):
        self.limits = limits
        self.clock = clock
        self.memory = memory
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._releasing: dict[int, Any] = {}  # id -> session, dropped on the background thread soon
        self._reasons: OrderedDict[str, str] = OrderedDict()  # owner -> why its caches went (bounded)
        self._reserved: dict[str, int] = {}  # owner -> the cache bytes its run going may reach
        self._lock = threading.Lock()
        self._admitting = threading.Lock()  # one admission at a time: two runs never share the same room
        self._jobs: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self.released_count = 0
        self._thread = threading.Thread(target=_background, args=(weakref.ref(self), self._jobs, self._closed),
                                        name="prefixkv-release", daemon=True)
        self._thread.start()

    # -- reading -------------------------------------------------------------------------------------------
    def count(self) -> int:
        with self._lock:
            return len(self._entries)

    def held_bytes(self) -> int:
        """KV-cache bytes of every registered comparison, and of those still being released."""
        with self._lock:
            sessions = [e.session for e in self._entries.values()] + list(self._releasing.values())
        return sum(_cache_bytes(s) for s in sessions)

    def running(self) -> int:
        """Comparisons whose run is going now."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.busy)

    def owners(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def session_of(self, owner: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(owner)
        return entry.session if entry is not None else None

    def stats(self) -> dict[str, Any]:
        return {"sessions": self.count(), "held_bytes": self.held_bytes(), "released": self.released_count,
                "rss_bytes": self.memory()}

    def released_reason(self, owner: str) -> str | None:
        """Why `owner`'s caches were dropped, if the registry dropped them (for the follow-up message)."""
        with self._lock:
            return self._reasons.get(owner)

    # -- admitting a run -----------------------------------------------------------------------------------
    def reserve(self, owner: str, need_bytes: int, *, keep_own: bool = False) -> None:
        """Make room for a run of `owner` that may reach `need_bytes` of cache, or raise LimitError.

        A new comparison replaces the owner's previous one, whose caches go first; a follow-up
        (`keep_own`) keeps them, so they count towards the need. Runs in the request handler just before
        the engine starts, one admission at a time, so drops made here happen at once, on this thread; the
        room stays reserved until the run ends (`end`)."""
        with self._admitting:
            self._reserve(owner, need_bytes, keep_own)
            with self._lock:
                self._reserved[owner] = need_bytes

    def _reserve(self, owner: str, need_bytes: int, keep_own: bool) -> None:
        self.sweep()
        with self._lock:
            own = self._entries.get(owner)
            if own is not None and not keep_own:
                del self._entries[owner]
        if own is not None:
            if keep_own:
                need_bytes += _cache_bytes(own.session)
            else:
                self._release_now(own.session)
        limit = self.limits.cache_limit_bytes
        while limit is not None and self._held_by_others(owner) + need_bytes > limit:
            if not self._drop_lru(exclude=owner, reason="memory"):
                held = self._held_by_others(owner)
                raise LimitError(
                    f"the server is at its KV-cache limit ({held / MB:.0f} MB held by other comparisons, this run "
                    f"needs up to {need_bytes / MB:.0f} MB, the limit is {limit / MB:.0f} MB): try fewer methods "
                    "or fewer new tokens, or again in a minute")
        ceiling = self.limits.memory_limit_bytes
        if ceiling is None:
            return
        used = self.memory()
        while used is not None and used > ceiling and self._drop_lru(exclude=owner, reason="memory"):
            used = self.memory()
        if used is not None and used > ceiling:
            raise LimitError(f"the server is low on memory ({used / MB:.0f} MB in use, the limit is "
                             f"{ceiling / MB:.0f} MB): try again in a minute")

    def add(self, owner: str, session: Any, stop: Callable[[], None] | None = None,
            forget: Callable[[str | None], None] | None = None) -> None:
        """Register `owner`'s new comparison (its previous one is dropped), then enforce max_sessions.
        `stop` cancels its run (called when the owner disconnects mid-run); `forget(reason)` is called when
        the registry drops it, so the owner lets go of the session too (its image, its record of the turn)."""
        with self._lock:
            previous = self._entries.pop(owner, None)
            self._entries[owner] = _Entry(owner, session, self.clock(), busy=True, stop=stop, forget=forget)
            self._reasons.pop(owner, None)
        if previous is not None and previous.session is not session:
            self._schedule(previous.session)
        while self.count() > self.limits.max_sessions:
            if not self._drop_lru(exclude=owner, reason="lru", wait=False):
                break

    def begin(self, owner: str) -> None:
        """`owner`'s comparison is running (never dropped while it runs)."""
        self._mark(owner, busy=True)

    def end(self, owner: str) -> None:
        """`owner`'s run ended: most recently used from now; its caches count as they are."""
        with self._lock:
            self._reserved.pop(owner, None)
        self._mark(owner, busy=False)

    def _mark(self, owner: str, busy: bool) -> None:
        with self._lock:
            entry = self._entries.get(owner)
            if entry is not None:
                entry.busy = busy
                entry.last_used = self.clock()
                self._entries.move_to_end(owner)

    # -- dropping ------------------------------------------------------------------------------------------
    def release_owner(self, owner: str | None, reason: str | None = None) -> bool:
        """Drop `owner`'s caches in the background (disconnect, Clear). True if it held any."""
        if owner is None:
            return False
        with self._lock:
            entry = self._entries.pop(owner, None)
            self._reserved.pop(owner, None)
            if entry is not None and reason:
                self._remember(owner, reason)
        if entry is None:
            return False
        if entry.stop is not None:
            entry.stop()  # a run still going stops within a token; then the release gets the engine
        entry.dropped(reason)
        self._schedule(entry.session)
        return True

    def sweep(self) -> int:
        """Drop comparisons idle for longer than idle_s; returns how many."""
        cutoff = self.clock() - self.limits.idle_s
        with self._lock:
            stale = [e for e in self._entries.values() if not e.busy and e.last_used < cutoff]
            for e in stale:
                del self._entries[e.owner]
                self._remember(e.owner, "idle")
        for e in stale:
            e.dropped("idle")
            self._schedule(e.session)
        if stale:
            log.info("released the caches of %d idle comparison(s)", len(stale))
        return len(stale)

    def close(self) -> None:
        """Drop everything now and stop the background thread."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for e in entries:
            self._release_now(e.session)
        self._closed.set()
        self._jobs.put(None)

    def _held_by_others(self, owner: str) -> int:
        """Cache bytes of the other comparisons: what they hold, or what a run going may still reach."""
        with self._lock:
            others = [(e.session, self._reserved.get(o, 0) if e.busy else 0) for o, e in self._entries.items()
                      if o != owner]
            others += [(s, 0) for s in self._releasing.values()]
            admitted = sum(need for o, need in self._reserved.items() if o != owner and o not in self._entries)
        return admitted + sum(max(_cache_bytes(s), need) for s, need in others)

    def _drop_lru(self, exclude: str, reason: str, wait: bool = True) -> bool:
        with self._lock:
            victim = next((e for o, e in self._entries.items() if o != exclude and not e.busy), None)
            if victim is None:
                return False
            del self._entries[victim.owner]
            self._remember(victim.owner, reason)
        log.info("released the caches of a comparison (%s)", reason)
        victim.dropped(reason)
        if wait:
            self._release_now(victim.session)
        else:
            self._schedule(victim.session)
        return True

    def _remember(self, owner: str, reason: str) -> None:
        """Called with the lock held."""
        self._reasons[owner] = REASONS[reason].format(idle=_duration(self.limits.idle_s))
        while len(self._reasons) > 1000:
            self._reasons.popitem(last=False)

    def _schedule(self, session: Any) -> None:
        with self._lock:
            self._releasing[id(session)] = session
        self._jobs.put(session)

    def _release_now(self, session: Any) -> None:
        try:
            session.release()
        except Exception:  # noqa: BLE001 - a failed release must not take the server down
            log.exception("releasing a comparison's caches failed")
        finally:
            with self._lock:
                self._releasing.pop(id(session), None)
                self.released_count += 1
        return_free_memory()  # so the resident size the memory ceiling reads comes down too


def _background(ref: "weakref.ReferenceType[SessionRegistry]", jobs: queue.Queue, closed: threading.Event) -> None:
    """Releases scheduled sessions and sweeps idle ones; ends when the registry is closed or collected."""
    while not closed.is_set():
        registry = ref()
        if registry is None:
            return
        interval = min(30.0, max(0.05, registry.limits.idle_s / 4))
        del registry
        try:
            session = jobs.get(timeout=interval)
        except queue.Empty:
            session = None
        registry = ref()
        if registry is None or closed.is_set():
            return
        if session is not None:
            registry._release_now(session)
        else:
            registry.sweep()
        del registry
