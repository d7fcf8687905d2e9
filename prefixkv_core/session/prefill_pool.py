"""Several conversations' first-turn prefills in one forward: the shared prefill of every comparison that starts
now, when their prompts have the same length and layout (the same prompt on same-sized images, or any question in
the query-agnostic mode, where every prompt before the question is the image block).

A first turn takes a ticket once its prompt is encoded (`PrefillPool.waiting`) and asks for its prefill from the
model's thread (`prefill`). The first ticket to ask takes every waiting ticket it can share a forward with, runs
one batched prefill (`runner.prefill` over the stacked prompts; each row's statistics are its own, as every row
attends to its own tokens only) and hands each its row: its cache, statistics and logits, as a prefill of its own
would have made them. The others find theirs done when their turn reaches the model.

A session made but not yet started (`expect`, for at most `expect_s`) and a turn that encodes its prompt
(`coming`) are on their way: a turn about to queue its prefill waits up to `gather_s` for those (on its own
thread, never holding the model), so visitors who press Compare together share one forward. What cannot share
(another length or layout, a family whose prefill reads 3-D positions or pixels, statistics that cannot share one
pass) runs alone, as before.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..decoding import runner
from ..decoding.vision_tower import TurnImage
from ..kv.attention import StatRequest
from ..policies import Policy

GATHER_S = 0.1  # how long a turn about to prefill waits for turns that are still encoding their prompts
EXPECT_S = 1.0  # a session made this recently and not yet started counts as on its way
MAX_TOKENS = 4096  # a shared forward's rows together at most this many tokens (a longer prompt prefills alone)


@dataclass(eq=False)
class PrefillTicket:
    """One first turn's shared prefill: its prompt (before any held-back question), the image through the tower
    (None: a prompt without one), and the policies whose statistics it records."""

    ids: torch.Tensor  # [1, N]
    is_image: torch.Tensor  # [1, N] bool
    image: TurnImage | None
    vision: object  # the prompt's image tensors as the processor made them (None: no image)
    policies: list[Policy]
    result: runner.Prefill | None = None
    error: BaseException | None = None
    taken: bool = False  # in a group's forward (done, or running now)
    # runs the rest of its turn's prefill job at once (on the model's thread), once its row is done: the turns
    # that shared a forward then decode together (set by the session; None: its job runs in its own turn)
    finish: Callable[[], None] | None = None
    arrive: Callable[[], None] | None = None  # tells the steps that its turn is about to decode (set by the session)
    request: StatRequest = field(init=False)

    def __post_init__(self):
        n = self.ids.shape[1]
        self.request = StatRequest.union([StatRequest(colsum=True)] + [p.prefill_stats(n) for p in self.policies])

    def shares_with(self, other: "PrefillTicket", request: StatRequest | None = None) -> bool:
        """Whether one forward can run both prompts: same length and layout, the image's embeddings either way, and
        statistics one pass records for both (`request`: what the forward records already, if more than ours)."""
        if self.ids.shape != other.ids.shape or not torch.equal(self.is_image, other.is_image):
            return False
        if (self.image is None) != (other.image is None):
            return False
        return joint_request(request or self.request, other.request) is not None


def joint_request(a: StatRequest, b: StatRequest) -> StatRequest | None:
    """One request recording what both ask for; None when one pass cannot (e.g. two probe-query subsets)."""
    try:
        return StatRequest.union([a, b])
    except ValueError:
        return None


class PrefillPool:
    """The first-turn prefills waiting for the model, grouped into shared forwards (thread-safe)."""

    def __init__(self, model_fn: Callable, num_layers: int, device: torch.device, gather_s: float = GATHER_S,
                 max_tokens: int = MAX_TOKENS, batchable: bool = True):
        self.model_fn = model_fn  # () -> the model (looked up when a forward runs)
        self.num_layers = num_layers
        self.device = device
        self.gather_s = gather_s
        self.max_tokens = max_tokens
        self.batchable = batchable  # False: every prefill alone (a family whose prefill reads 3-D positions)
        self._cond = threading.Condition()
        self.expect_s = EXPECT_S
        self._coming = 0  # turns encoding their prompts, whose tickets are on their way
        self._expected: "weakref.WeakKeyDictionary[object, float]" = weakref.WeakKeyDictionary()  # session -> made at
        self._waiting: list[PrefillTicket] = []
        self.forwards = collections.Counter()  # prompts in a forward -> how many forwards ran them (the reports')
        self.gathers = 0  # turns that waited for others still encoding

    # -- the turn's side ------------------------------------------------------------------------------------------
    def expect(self, session: object) -> None:
        """A session was made: its first turn will likely start in a moment (the app makes the session, then runs
        it on a thread of its own). Counted as on its way for `expect_s` at most, or until its turn starts."""
        with self._cond:
            self._expected[session] = time.monotonic()

    @contextlib.contextmanager
    def coming(self, session: object = None) -> Iterator[None]:
        """Around encoding a first turn's prompt: the turns about to prefill wait a little for it."""
        with self._cond:
            self._expected.pop(session, None)
            self._coming += 1
        try:
            yield
        finally:
            with self._cond:
                self._coming -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def waiting(self, ticket: PrefillTicket) -> Iterator[None]:
        """While the turn's prefill job is queued and runs: other turns' forwards may take the ticket. First waits up
        to `gather_s` for the turns still encoding (so visitors arriving together share one forward)."""
        with self._cond:
            self._waiting.append(ticket)
            self._cond.notify_all()
            deadline = time.monotonic() + self.gather_s
            if self.batchable and self._on_their_way():
                self.gathers += 1
            while self.batchable and self._on_their_way() and not ticket.taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        try:
            yield
        finally:
            with self._cond:
                if ticket in self._waiting:
                    self._waiting.remove(ticket)

    def _on_their_way(self) -> int:
        """(With the lock held.) Turns encoding now, and sessions made recently whose turns have not started."""
        fresh = time.monotonic() - self.expect_s
        return self._coming + sum(made > fresh for made in self._expected.values())

    def waiting_count(self) -> int:
        """Tickets waiting for a forward now (tests, reports)."""
        with self._cond:
            return sum(not t.taken for t in self._waiting)

    # -- the model thread's side ------------------------------------------------------------------------------------
    def prefill(self, ticket: PrefillTicket) -> runner.Prefill:
        """The ticket's prefill (on the model's thread): done already by another turn's forward, or run now with
        every waiting ticket that can share it."""
        with self._cond:
            group = [] if ticket.taken else self._group(ticket)
        if group:
            self._run(group)
            served = [m for m in group if m.result is not None]
            for member in served:  # every turn served is about to decode: the first to step waits for the others
                if member.arrive is not None:
                    member.arrive()
            for member in served:  # the other turns' prefill jobs now, before any step
                if member is not ticket and member.finish is not None:
                    member.finish()
        if ticket.error is not None:
            raise ticket.error
        if ticket.result is None:  # its group's forward failed as a whole: its own, alone
            self._run([ticket])
            if ticket.error is not None:
                raise ticket.error
        result, ticket.result = ticket.result, None  # handed over: the pool keeps nothing
        return result

    def _group(self, ticket: PrefillTicket) -> list[PrefillTicket]:
        """(With the lock held.) The ticket and the waiting tickets it can share a forward with, all marked taken."""
        group = [ticket]
        if self.batchable:
            tokens, request = ticket.ids.shape[1], ticket.request
            for other in self._waiting:
                if other is ticket or other.taken or not ticket.shares_with(other, request):
                    continue
                if tokens + other.ids.shape[1] > self.max_tokens:
                    break
                group.append(other)
                tokens += other.ids.shape[1]
                request = joint_request(request, other.request)
        for member in group:
            member.taken = True
            if member in self._waiting:
                self._waiting.remove(member)
        return group

    def _run(self, group: list[PrefillTicket]) -> None:
        """One forward over the group's prompts; each ticket gets its row (or the error, when alone)."""
        model = self.model_fn()
        try:
            policies = [p for t in group for p in t.policies]
            if len(group) == 1:
                only = group[0]
                only.result = runner.prefill(model, only.ids, only.is_image, only.vision, only.policies,
                                             self.num_layers, self.device, only.image)
                self.forwards[1] += 1
                return
            t0 = runner.now(self.device)  # the rows' tower passes count in the forward's time, as alone
            ids = torch.cat([t.ids for t in group])
            is_image = torch.cat([t.is_image for t in group])
            with torch.inference_mode():
                embeds = (torch.cat([t.image.prompt_embeds(t.ids, t.is_image) for t in group])
                          if group[0].image is not None else None)
            shared = runner.prefill(model, ids, is_image, None, policies, self.num_layers, self.device,
                                    inputs_embeds=embeds)
            seconds = runner.now(self.device) - t0
            self.forwards[len(group)] += 1
        except Exception as exc:  # noqa: BLE001 - alone: the turn's error; together: each runs alone instead
            if len(group) == 1:
                group[0].error = exc
            else:
                for member in group:
                    member.taken, member.result = True, None
            return
        for r, (member, cache) in enumerate(zip(group, shared.cache.split_rows())):
            stats = {layer: {name: value[r:r + 1] for name, value in s.items()} for layer, s in shared.stats.items()}
            member.result = runner.Prefill(cache, stats, shared.logits[r:r + 1], shared.prompt_len, seconds)
