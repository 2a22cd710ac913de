"""RTC-DistFlow: the Prefill-to-Decode KV transfer service (SPEC 10.2, P098-P103).

After prefill, the Prefill DP master *registers* a transfer: metadata and KV block addresses
only, no data moves. The Decode DP later submits an async RECV, only once it has reserved
every KV block the request needs (a deferred RECV backpressures upstream and keeps the KV on
the prefill side). The transfer then moves the KV from each of the Prefill DP's ``tp`` ranks
(MLA keeps the latent cache on every TP rank; each rank sends its share of the layers) to the
single Decode die (TP = 1), and completes only when every rank part has landed (TP
synchronisation). Both sides learn of completion through their own DP's completion queue; the
Prefill DP frees its blocks only after dequeuing it.

Two tiers move the bytes:

* ``closed-form`` (default, for long replays): each rank part pays the DMA start-up and then
  streams at the link bandwidth through two ports, the sending die's egress and the receiving
  die's ingress: it takes the earliest time both are free for it, so transfers to the same
  decode die queue behind one another, and a port is held only while it carries bytes (a
  transfer waiting for a busy decode die does not hold up its prefill die's other
  transfers). The link is UB inside the pod and RoCE from attached 910B prefill servers
  (P104).
* ``xccl``: every rank part is a real XCCL point-to-point send/receive (size mode) on a
  :class:`~xds.fabric.UBFabric` holding the deployment's dies, with the 8-step protocol, ring
  credits and port contention of :mod:`xds.fabric.xccl`. It costs a few events per 32 KiB
  chunk, so it suits short replays; a test checks the two tiers agree.

Every registered transfer ends in exactly one terminal state (completed, failed or
cancelled); :meth:`DistFlow.check` verifies it.

Link probing (SPEC 11.1, P116): :meth:`DistFlow.probe` sends a dummy payload through the
pair's FIFO. It needs no KV slots, but it leaves the queue only after every transfer registered
before it has had its RECV posted, so a saturated Decode side (RECVs deferred) delays it, and
its bytes queue on the ports behind the transfers' bytes; a link that is down
(:meth:`DistFlow.link_down`, a silent stall rather than a transport error) does not take it, nor
any transfer whose RECV is posted; transfers on the wire freeze with what is left of them and
resume when the link comes back (closed form), or, moved by a mover of the user's or on the
``xccl`` tier, are cancelled and run again from the start.
:mod:`xds.serve.probe` classifies the outcome.
"""

from __future__ import annotations

import bisect
import enum
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..config import require_int
from ..errors import ConfigError, XdsError
from ..fabric.xccl import XCCL, AppBuffer
from ..fabric.xccl import args as xccl_args
from ..hw import EngineSpec, LinkSpec
from ..runtime import emit, now_ns, sleep_until_ns
from .policies import policy_name


class TransferState(enum.Enum):
    REGISTERED = "registered"
    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = {TransferState.COMPLETED, TransferState.FAILED, TransferState.CANCELLED}


class Transfer(msgspec.Struct):
    """One registered PD transfer (metadata only until a RECV is submitted)."""

    transfer_id: int
    request_id: int
    prefill_te: int
    prefill_dp: int
    kv_blocks: int
    kv_bytes: int
    state: TransferState = TransferState.REGISTERED
    registered_ns: int = 0
    recv_ns: int = -1
    done_ns: int = -1
    decode_dp: int = -1


class ProbeState(msgspec.Struct):
    """Where a link probe is: times are -1 until reached."""

    sent_ns: int = -1
    on_wire_ns: int = -1
    """When every transfer ahead of it in the pair's FIFO had its RECV posted."""
    expected_ns: int = -1
    """When the link took it: its delivery time behind the bytes already on the ports."""
    delivered_ns: int = -1


class Completion(msgspec.Struct, frozen=True):
    transfer_id: int
    request_id: int
    state: TransferState


def _one_error(exc: Exception) -> Exception:
    """``exc``, or, for a group of the same xds error raised in each of a mover's parallel
    tasks (every rank's ``send`` on the wrong tier, say), that error once."""
    if not isinstance(exc, ExceptionGroup):
        return exc
    leaves: list[BaseException] = []
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(reversed(e.exceptions))
        else:
            leaves.append(e)
    first = leaves[0]
    same = all(type(e) is type(first) and str(e) == str(first) for e in leaves)
    return first if same and isinstance(first, XdsError) else exc


class KVMove:
    """What a KV mover (:data:`KVMover`) gets: one transfer to move, its TP rank parts and
    where they go, and the pair's tier. ``transfer`` and ``flow`` are DistFlow's own records:
    read them; writing to them corrupts the replay's bookkeeping."""

    def __init__(self, flow: DistFlow, transfer: Transfer, decode_dp: int):
        self.flow = flow
        self.transfer = transfer
        self.decode_dp = decode_dp
        tp = flow.tp
        self.sources = [flow._prefill_die(transfer.prefill_dp, rank) for rank in range(tp)]
        """The prefill dies (fabric numbering) holding each TP rank's part."""
        self.destination = flow._decode_die(decode_dp)
        """The decode die (fabric numbering) receiving every part."""
        sizes = [transfer.kv_bytes // tp] * tp
        sizes[-1] += transfer.kv_bytes - sum(sizes)
        self.part_bytes = sizes
        """Bytes of each rank's part (they sum to ``transfer.kv_bytes``)."""
        self.xccl = flow.xccl
        """The XCCL of the ``xccl`` tier (None on the closed-form tier)."""
        self.tier: Literal["closed-form", "xccl"] = "closed-form" if flow.xccl is None else "xccl"
        """The pair's tier (``PDConfig.kv_transfer``): :meth:`book` moves the bytes on the
        closed-form tier, :meth:`send` on the ``xccl`` tier; a mover may serve both."""
        self.link = flow.link
        self.engines = flow.engines
        self.booked_until = 0
        """The latest landing time :meth:`book` gave (0: nothing booked)."""
        self.bookings: list[tuple[list[int], list[int]]] = []
        """What :meth:`book` booked: (prefill ports, each one's landing time) per call."""

    async def send(self, rank: int, nbytes: int, event: int) -> None:
        """``xccl`` tier: one XCCL point-to-point message of ``nbytes`` from rank ``rank``'s
        prefill die to the decode die (the 8-step protocol, size mode), with its share of the
        transfer's AIVs (``kv_aivs`` split over the TP ranks, so the ranks' parts move side
        by side into the decode die, as the closed form books them); returns when it has
        landed. ``event`` (>= 1) tags it; messages between the same two
        dies go one at a time, so each RECV matches its own SEND."""
        if self.xccl is None:
            raise ConfigError(
                "send() is the xccl tier's (kv_transfer = 'xccl', a fabric); on the closed-form "
                "tier move the bytes with book() (move.tier says which tier a mover is on)",
                field="kv_mover",
            )
        try:
            rank = require_int(rank, "rank", high=self.flow.tp - 1)
            nbytes = require_int(nbytes, "nbytes")
        except ConfigError as exc:
            raise ConfigError(f"send(): {exc.message}", field=exc.field) from None
        try:
            event = xccl_args.event_id(event)
        except ConfigError:
            raise ConfigError(
                f"send() takes an eventID in 1..2**64-1, got {event!r}", field="event"
            ) from None
        x, src, dst = self.xccl, self.sources[rank], self.destination
        buf = AppBuffer(0, nbytes)
        lock = self.flow._pair_locks.setdefault((src, dst), anyio.Lock())
        aivs = max(1, self.flow.aivs // self.flow.tp)
        async with lock, anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(x.send, src, dst, buf, event, n_aiv=aivs))
            # the Decode DP's RECV is async (SPEC 10.2): it takes the decode die's AIVs only once
            # the sender's message has arrived. A receive holding them while it waits could
            # deadlock with other transfers waiting for each other's dies' AIVs.
            receive = functools.partial(x.receive, n_aiv=aivs, hold_aivs=False)
            tg.start_soon(receive, dst, src, buf, event)

    def book(self, part_bytes: Sequence[float] | np.ndarray | float) -> int:
        """Closed form: book each rank's ``part_bytes`` (one size per TP rank, or one size for
        every rank) through its prefill die's egress port and the decode die's ingress port
        (ports other transfers share: each part takes the earliest time both are free for
        it). Returns the virtual time
        the last part lands: sleep until then to have moved them. Closed-form tier only (on
        the ``xccl`` tier the fabric's ports carry the bytes: :meth:`send`)."""
        if self.xccl is not None:
            raise ConfigError(
                "book() is the closed-form tier's; with kv_transfer = 'xccl' move the bytes "
                "with send(), which the fabric's ports carry",
                field="kv_mover",
            )
        tp = self.flow.tp
        try:
            sizes = np.asarray(part_bytes, dtype=np.float64)
        except (TypeError, ValueError):
            sizes = None
        if sizes is not None and sizes.ndim == 0:
            sizes = np.full(tp, float(sizes))
        if sizes is not None and sizes.shape != (tp,):
            sizes = None
        if sizes is None or not np.isfinite(sizes).all() or (sizes < 0).any():
            raise ConfigError(
                f"book() takes one non-negative size per TP rank ({tp}), or one for all",
                field="part_bytes",
            )
        srcs = self.flow._rank_ports(self.transfer.prefill_dp)
        ends = self.flow._book(srcs, self.decode_dp, sizes.tolist())
        self.bookings.append((srcs, ends))
        lands = max(ends, default=now_ns())
        self.booked_until = max(self.booked_until, lands)
        return lands


def _bookings(ports: dict[int, list[tuple[int, int]]], port: int, now: int):
    """``port``'s bookings (start, end) by start, without those already over at ``now``."""
    booked = ports.setdefault(port, [])
    if booked and booked[0][1] <= now:
        booked[:] = [b for b in booked if b[1] > now]
    return booked


def _earliest_free(calendars: Sequence[list[tuple[int, int]]], ready: int, held: int) -> int:
    """The earliest time from ``ready`` at which every calendar is free for ``held`` ns."""
    t = ready
    moved = True
    while moved:
        moved = False
        for booked in calendars:
            for start, end in booked:
                if start >= t + held:
                    break  # by start: the rest begin later still
                if end > t:  # overlaps [t, t + held): try after it
                    t, moved = end, True
    return t


def _cut(booked: list[tuple[int, int]], end: int, t: int) -> None:
    """The booking ending at ``end`` stops at ``t`` (dropped if it had not begun)."""
    for i, (start, stop) in enumerate(booked):
        if stop == end:
            if start < t:
                booked[i] = (start, t)
            else:
                del booked[i]
            return


KVMover = Callable[[KVMove], Awaitable[None]]
"""A KV-transfer protocol of your own: ``async def mover(move: KVMove) -> None`` moves one
transfer's bytes (on the ``xccl`` tier with :meth:`KVMove.send`; on the closed-form tier by
sleeping until :meth:`KVMove.book`'s time, or any cost you model) and returns when every part
has landed: returning before a time ``book`` gave is an error. DistFlow keeps the rest:
registration, the deferred RECV, the pair's FIFO, completion queues on both sides, transport
failures, and link stalls: before the move starts on both tiers, and on the closed-form tier
also during it (a link going down cancels the move; it runs again from the start, on fresh
bookings, when the link is back)."""


class DistFlow:
    """One DistFlow instance per (Prefill TE, Decode TE) pair (fault isolation, P102)."""

    @property
    def pair(self) -> str:
        """The (Prefill TE, Decode TE) pair this instance serves, as events name it."""
        return f"P{self.prefill_te}-D{self.decode_te}"

    def __init__(
        self,
        prefill_te: int,
        *,
        tp: int,
        link: LinkSpec,
        engines: EngineSpec,
        prefill_dps: int,
        decode_dps: int,
        ingress: dict[int, list[tuple[int, int]]] | None = None,
        egress: dict[int, list[tuple[int, int]]] | None = None,
        xccl: XCCL | None = None,
        prefill_die: Callable[[int, int], int] | None = None,
        decode_die: Callable[[int], int] | None = None,
        aivs: int = 48,
        decode_te: int = 0,
        mover: KVMover | None = None,
    ):
        self.prefill_te = prefill_te
        self.mover = mover
        """A KV-transfer protocol of your own (None: the tier's built-in one)."""
        self.decode_te = decode_te
        self.tp = tp
        self.link = link
        self.engines = engines
        self.transfers: dict[int, Transfer] = {}
        self._egress: dict[int, list[tuple[int, int]]] = egress if egress is not None else {}
        """Prefill die (index within the TE) -> its bookings ahead (start, end), by start;
        shared by the TE's instances."""
        self._ingress: dict[int, list[tuple[int, int]]] = ingress if ingress is not None else {}
        """Decode die -> its bookings ahead; shared by the instances of one Decode TE (same
        ports)."""
        self.prefill_cq = [_channel() for _ in range(prefill_dps)]
        """Per Prefill DP: its completion queue (send, receive)."""
        self.decode_cq = [_channel() for _ in range(decode_dps)]
        self._next_id = 0
        self.failed = False
        self.xccl = xccl
        """The XCCL of the ``xccl`` tier (None: closed form)."""
        self._prefill_die = prefill_die or (lambda dp, rank: dp * tp + rank)
        self._decode_die = decode_die or (lambda dp: dp)
        self.aivs = aivs
        self._pair_locks: dict[tuple[int, int], anyio.Lock] = {}
        """One message at a time per die pair, so each RECV matches its own SEND."""
        self.link_up = True
        """False while the link is down (:meth:`link_down`): nothing moves."""
        self._gate = anyio.Event()
        """Set while transfers may go: the link is up, or the pair was declared failed (then
        the stalled transfers end as failed at once)."""
        self._gate.set()
        self.declared_failed = False
        """Taken out of service by :meth:`declare_failed` (link probing)."""
        self.stalled = 0
        """Transfers whose RECV was posted, held by a downed link."""
        self._on_wire: dict[int, anyio.CancelScope] = {}
        """Transfers moving bytes (closed form): a link going down interrupts them."""
        self._awaiting_recv: set[int] = set()
        """Registered transfers whose RECV has not been posted (the pair's FIFO)."""
        self._posted = anyio.Event()
        """Set (and replaced) whenever a registered transfer gets its RECV or ends."""
        self._retired = False
        self._closed = False

    def register(self, request_id: int, prefill_dp: int, kv_blocks: int, kv_bytes: int) -> Transfer:
        """The Prefill DP master registers a transfer: metadata only (P098)."""
        t = Transfer(
            self._next_id,
            request_id,
            self.prefill_te,
            prefill_dp,
            kv_blocks,
            kv_bytes,
            registered_ns=now_ns(),
        )
        self._next_id += 1
        self.transfers[t.transfer_id] = t
        self._awaiting_recv.add(t.transfer_id)
        emit("distflow", "registered", transfer=t.transfer_id, request=request_id, pair=self.pair)
        return t

    async def recv(self, transfer: Transfer, decode_dp: int) -> None:
        """The Decode DP's async RECV (its KV blocks are already reserved): move every rank
        part, then post the completion to both sides' queues."""
        if transfer.state is not TransferState.REGISTERED:
            raise ConfigError(
                f"transfer {transfer.transfer_id} is {transfer.state.value}, not registered",
                field="transfer",
            )
        transfer.state = TransferState.IN_FLIGHT
        transfer.recv_ns = now_ns()
        transfer.decode_dp = decode_dp
        self._moved(transfer)
        emit("distflow", "recv", transfer=transfer.transfer_id, decode_dp=decode_dp, pair=self.pair)
        try:
            await self._move(transfer, decode_dp)
        finally:
            if transfer.state is TransferState.IN_FLIGHT:  # the request failed meanwhile
                self._on_wire.pop(transfer.transfer_id, None)
                transfer.state = TransferState.CANCELLED
                transfer.done_ns = now_ns()
                emit("distflow", "abandoned", transfer=transfer.transfer_id, pair=self.pair)
                self._close_if_drained()

    async def _move(self, transfer: Transfer, decode_dp: int) -> None:
        """Move the KV and post the completion (or stall, or fail). If the request's task is
        cancelled meanwhile (it failed elsewhere), :meth:`recv` ends the transfer cancelled
        without a completion: its owner frees the blocks itself."""
        if not self._gate.is_set() and not await self._stall(transfer):
            return  # a downed link stalled it, then the pair was declared failed
        if self.mover is not None or self.xccl is not None:
            if await self._interruptible_move(transfer, decode_dp):
                self._finish(
                    transfer, TransferState.FAILED if self.failed else TransferState.COMPLETED
                )
            return
        srcs = self._rank_ports(transfer.prefill_dp)
        parts = [transfer.kv_bytes / self.tp] * self.tp
        ends = self._book(srcs, decode_dp, parts)
        while True:  # on the wire; a link going down freezes what is left of it
            with anyio.CancelScope() as wire:
                self._on_wire[transfer.transfer_id] = wire
                await sleep_until_ns(max(ends))
            del self._on_wire[transfer.transfer_id]
            if not wire.cancelled_caught:
                break
            parts = self._unbook(srcs, decode_dp, parts, ends)  # the bytes not yet sent
            if not await self._stall(transfer):
                return
            # the rest goes through the ports again: a fresh DMA start-up, behind what others
            # booked meanwhile
            ends = self._book(srcs, decode_dp, parts)
        self._finish(transfer, TransferState.FAILED if self.failed else TransferState.COMPLETED)

    async def _stall(self, transfer: Transfer) -> bool:
        """Hold ``transfer`` while the link is down; True when it may go on, False if the pair
        was declared failed meanwhile (the transfer then ends failed: what was left never
        arrives)."""
        self.stalled += 1
        try:
            await self._gate.wait()
        finally:
            self.stalled -= 1
        if self.failed:
            self._finish(transfer, TransferState.FAILED)
            return False
        return True

    async def _interruptible_move(self, transfer: Transfer, decode_dp: int) -> bool:
        """A mover of the user's (either tier), or the ``xccl`` tier's one message per TP rank:
        a link going down cancels the move. What it booked on the closed-form ports is given
        back; on the ``xccl`` tier the die pairs it used are re-initialised
        (:meth:`~xds.fabric.xccl.XCCL.reset_pair`: the writes already in flight land first).
        The move runs again from the start when the link is back. False if the transfer ended
        here (declared failed while stalled)."""
        while True:
            move = KVMove(self, transfer, decode_dp)
            with anyio.CancelScope() as wire:
                self._on_wire[transfer.transfer_id] = wire
                if self.mover is not None:
                    await self._run_mover(move)
                else:
                    await self._xccl_parts(move)
            del self._on_wire[transfer.transfer_id]
            if not wire.cancel_called:  # (a mover that shielded itself and went on across a
                return True  # link that was down moved nothing: it runs again too)
            for srcs, ends in move.bookings:  # its bookings end here: the ports are free
                self._unbook(srcs, decode_dp, [0.0] * len(srcs), ends)
            if self.xccl is not None:  # every message on these pairs was cancelled with it
                for src in dict.fromkeys(move.sources):
                    self.xccl.reset_pair(src, move.destination)
            emit("distflow", "move-interrupted", transfer=transfer.transfer_id, pair=self.pair)
            if not await self._stall(transfer):
                return False

    async def _run_mover(self, move: KVMove) -> None:
        """Call the user's mover and check what it returns and when."""
        assert self.mover is not None
        moving = self.mover(move)
        if not inspect.isawaitable(moving):
            raise ConfigError(
                f"kv_mover {policy_name(self.mover)} returned {type(moving).__name__}, not an "
                "awaitable: write it as `async def mover(move): ...`",
                field="kv_mover",
            )
        try:
            await moving
        except anyio.get_cancelled_exc_class():
            # this replay's own cancellations (a failover, the serving limit) go on; one no
            # scope of ours asked for came from the mover itself
            await anyio.lowlevel.checkpoint_if_cancelled()
            raise ConfigError(
                f"kv_mover {policy_name(self.mover)} let a cancellation escape while moving "
                f"transfer {move.transfer.transfer_id} of request "
                f"{move.transfer.request_id!r}: a mover returns when the parts it booked have "
                "landed, or raises an error (xds cancels it when its TEs fail)",
                field="kv_mover",
            ) from None
        except Exception as caught:
            exc = _one_error(caught)
            exc.add_note(
                f"(raised by the kv_mover {policy_name(self.mover)} moving transfer "
                f"{move.transfer.transfer_id} of request {move.transfer.request_id!r} to decode "
                f"DP {move.decode_dp})"
            )
            if exc is caught:
                raise
            raise exc from None
        if now_ns() < move.booked_until:
            raise ConfigError(
                f"kv_mover {policy_name(self.mover)} returned at {now_ns()} ns, before the "
                f"parts it booked land ({move.booked_until} ns): "
                "`await sleep_until_ns(move.book(...))`",
                field="kv_mover",
            )

    def _rank_ports(self, prefill_dp: int) -> list[int]:
        """The egress ports (prefill dies within the TE) of ``prefill_dp``'s TP ranks."""
        return [prefill_dp * self.tp + rank for rank in range(self.tp)]

    def _book(self, srcs: list[int], decode_dp: int, parts: list[float]) -> list[int]:
        """Closed form: book ``parts[i]`` bytes from prefill die ``srcs[i]`` through its egress
        port and the decode die's ingress port, in order, after a DMA start-up: each part takes
        the earliest time both ports are free for it (a port is held only while it carries a
        part: a transfer waiting for a busy decode die leaves its prefill die's egress to
        others meanwhile); when each lands."""
        t0 = now_ns()
        ready = t0 + self.engines.dma_startup_ns
        ingress = _bookings(self._ingress, decode_dp, t0)
        ends = []
        for src, part in zip(srcs, parts, strict=True):
            egress = _bookings(self._egress, src, t0)
            held = self.link.latency_ns + round(part / self.link.bandwidth * 1e9)
            start = _earliest_free((egress, ingress), ready, held)
            bisect.insort(egress, (start, start + held))
            bisect.insort(ingress, (start, start + held))
            ends.append(start + held)
        return ends

    def _unbook(
        self, srcs: list[int], decode_dp: int, parts: list[float], ends: list[int]
    ) -> list[float]:
        """A link outage stops bookings ``ends`` of ``parts`` now: the ports they still hold
        (as the latest booking on them) are free from now; returns each part's bytes not yet
        sent (those sent already were in flight for the link latency)."""
        t = now_ns()
        bw = self.link.bandwidth
        left = []
        for src, part, end in zip(srcs, parts, ends, strict=True):
            _cut(self._egress.get(src, []), end, t)
            _cut(self._ingress.get(decode_dp, []), end, t)
            sending_ns = part / bw * 1e9
            left.append(max(0.0, min(sending_ns, end - self.link.latency_ns - t)) * bw / 1e9)
        return left

    def _through_ports(self, srcs: list[int], decode_dp: int, part: float) -> int:
        """Closed form: book ``part`` bytes from each prefill die in ``srcs`` through its
        egress port and the decode die's ingress port (:meth:`_book`); when the last part lands (TP
        synchronisation)."""
        return max([now_ns(), *self._book(srcs, decode_dp, [part] * len(srcs))])

    # -- link probing (SPEC 11.1) ----------------------------------------------------------------
    def link_down(self) -> None:
        """The pair's link fails silently: transfers and probes stall until it is restored
        (or the pair is declared failed)."""
        if self.link_up:
            self.link_up = False
            if not self.failed:
                self._gate = anyio.Event()
                for wire in self._on_wire.values():  # transfers on the wire freeze too
                    wire.cancel()
            emit("distflow", "link-down", pair=self.pair)

    def link_restore(self) -> None:
        if not self.link_up:
            self.link_up = True
            self._gate.set()
            emit("distflow", "link-restored", pair=self.pair)

    def fail_transfers(self) -> None:
        """A transport error: from now on every transfer ends failed (those stalled on a
        downed link at once)."""
        self.failed = True
        if not self.link_up:
            self._gate.set()

    def declare_failed(self) -> None:
        """Take the pair out of service (e.g. link probing found it down): transfers stalled
        on the link, and every later one, end as failed."""
        if not self.declared_failed:
            self.failed = self.declared_failed = True
            self._gate.set()
            emit("distflow", "declared-failed", pair=self.pair)

    def queued_before(self, transfer_id: int) -> int:
        """Transfers registered before ``transfer_id`` still waiting for their RECV."""
        return sum(t < transfer_id for t in self._awaiting_recv)

    async def probe(
        self, state: ProbeState, *, decode_dp: int = 0, prefill_dp: int = 0, nbytes: int = 64
    ) -> None:
        """Send a dummy payload of ``nbytes`` from prefill DP ``prefill_dp`` (its TP rank 0's
        die) to decode DP ``decode_dp`` through the pair's FIFO, queueing on both dies' ports
        behind their transfers; ``state`` tracks where it is (queued, on the wire, delivered)."""
        prefill_dp = require_int(prefill_dp, "prefill_dp", high=len(self.prefill_cq) - 1)
        decode_dp = require_int(decode_dp, "decode_dp", high=len(self.decode_cq) - 1)
        state.sent_ns = now_ns()
        behind = self._next_id  # every transfer registered so far is ahead of the probe
        while self.queued_before(behind):
            posted = self._posted
            await posted.wait()
        state.on_wire_ns = now_ns()
        while not self._gate.is_set():
            await self._gate.wait()
        if self.failed and not self.link_up:
            await anyio.sleep_forever()  # a failed link never delivers (the caller times out)
        state.expected_ns = self._through_ports(self._rank_ports(prefill_dp)[:1], decode_dp, nbytes)
        await sleep_until_ns(state.expected_ns)
        state.delivered_ns = now_ns()

    def _moved(self, transfer: Transfer) -> None:
        self._awaiting_recv.discard(transfer.transfer_id)
        self._posted.set()
        self._posted = anyio.Event()

    async def _xccl_parts(self, move: KVMove) -> None:
        """Every TP rank's part as an XCCL send/receive pair; returns when all have landed."""
        async with anyio.create_task_group() as tg:  # TP synchronisation
            for rank, nbytes in enumerate(move.part_bytes):
                tg.start_soon(move.send, rank, nbytes, move.transfer.transfer_id + 1)

    def withdraw(self, transfer: Transfer) -> None:
        """The request behind a registered transfer failed elsewhere and its owner freed the
        blocks itself: the transfer leaves the FIFO, cancelled, without a completion."""
        if transfer.state is TransferState.REGISTERED:
            self._moved(transfer)
            transfer.state = TransferState.CANCELLED
            transfer.done_ns = now_ns()
            emit("distflow", "withdrawn", transfer=transfer.transfer_id, pair=self.pair)
            self._close_if_drained()

    def retire(self) -> None:
        """A fresh instance replaced this one (a TE of the pair came back): nothing registers
        here any more, and once every transfer it holds has ended its completion queues close,
        ending the pollers that drain them."""
        self._retired = True
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        if not self._retired or self._closed:
            return
        if any(t.state not in TERMINAL for t in self.transfers.values()):
            return
        self._closed = True
        for send, _ in (*self.prefill_cq, *self.decode_cq):
            send.close()
        emit("distflow", "retired", pair=self.pair)

    def _finish(self, transfer: Transfer, state: TransferState) -> None:
        if transfer.state is TransferState.REGISTERED:
            self._moved(transfer)
        transfer.state = state
        transfer.done_ns = now_ns()
        done = Completion(transfer.transfer_id, transfer.request_id, state)
        self.prefill_cq[transfer.prefill_dp][0].send_nowait(done)
        if transfer.decode_dp >= 0:
            self.decode_cq[transfer.decode_dp][0].send_nowait(done)
        emit("distflow", state.value, transfer=transfer.transfer_id, pair=self.pair)
        self._close_if_drained()

    def check(self) -> None:
        """Every registered transfer ended in exactly one terminal state."""
        open_ = [t.transfer_id for t in self.transfers.values() if t.state not in TERMINAL]
        if open_:
            raise AssertionError(f"DistFlow {self.prefill_te}: transfers not ended: {open_[:10]}")


def _channel() -> tuple[MemoryObjectSendStream[Completion], MemoryObjectReceiveStream[Completion]]:
    return anyio.create_memory_object_stream[Completion](max_buffer_size=float("inf"))
