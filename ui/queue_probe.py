"""Two facts about Gradio's queue that its public API does not offer, read without changing anything:
when the event now running joined the queue, and how many events of one client still wait.

Stop needs them to cancel a request that an API client queued (the browser marks its own clicks, an API
call cannot). They live on `Blocks._queue` in the pinned gradio (6.31); with another version both
answers degrade to "unknown" (None / 0) and Stop falls back to the browser's bookkeeping alone
(tests/test_security.py notices the change).
"""
from __future__ import annotations

from typing import Any


def _queue(blocks: Any):
    return getattr(blocks, "_queue", None)


def enqueued_at() -> float | None:
    """time.monotonic() at which the event this handler runs for joined the queue, or None (a direct call,
    an unqueued event, or a gradio without this bookkeeping)."""
    try:
        from gradio.context import LocalContext

        blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
        event = _queue(blocks).event_ids_to_events.get(event_id) if blocks and event_id else None
        value = getattr(event, "enqueue_time", None)
        return float(value) if value is not None else None
    except Exception:  # noqa: BLE001 - best effort by design
        return None


def waiting(blocks: Any, session_hash: str | None, concurrency_id: str) -> int:
    """Events of `session_hash` that wait (not yet started) in the queue of `concurrency_id`."""
    if not session_hash:
        return 0
    try:
        line = _queue(blocks).event_queue_per_concurrency_id.get(concurrency_id)
        return sum(1 for event in list(line.queue) if event.session_hash == session_hash) if line else 0
    except Exception:  # noqa: BLE001 - best effort by design
        return 0
