"""XCCL point-to-point send/receive: the eight-step protocol of SPEC 3.3 over the UB fabric.

A message of ``nbytes`` is cut into chunks (at most one MTE operation, or one DMA descriptor,
each); chunk ``j`` goes to lane ``j mod lanes`` (an AIV for MTE, a DMA queue for DMA) and
occupies ring slot ``(base + j) mod ring_slots`` of the pair's managed ring at the receiver.

Sender lane ``a``, per chunk (steps 1-3): wait until the slot's previous chunk has been
consumed (its lane's ``ack`` credit, read from the sender's own metadata, has passed it), move
the chunk app -> remote managed slot (MTE2 load / MTE3 store, ping-pong; or DMA), then write the
receiver's tailPtr for lane ``a`` (cumulative bytes), ordered after the data (R1).

Receiver lane ``a`` (steps 5-7): wait until its tailPtr covers the next chunk, check the eventID
(R3), copy managed slot -> app, then write the cumulative consumed bytes into the sender's
``ack`` for lane ``a`` (a streaming credit, SPEC 3.5). When every lane is done it writes the
final ACK: the eventID echoed into the sender's lane-0 field with the message's sequence number
in ``chunkID``. The sender returns when it sees that ACK (steps 4, 8).

Messages larger than the ring flow through it: a sender lane blocks on credits while the
receiver drains. Sync mode holds the AIVs from launch to return; async mode releases them once
the data has moved and does not hold them while waiting for the ACK.

Cancellation. A send or receive cancelled in the middle of a message *abandons* its pair: the
pair is poisoned (every later operation on it raises :class:`ProtocolError`) and the peer is
told with an abort notice, a metadata write ordered after every write already posted on the pair
(so it never overtakes in-flight data, tailPtrs or credits). A peer blocked on the abandoned
message (a sender waiting for credits or the final ACK, a receiver waiting for a tailPtr) wakes
on it and raises the same error. :meth:`P2P.reset_pair` re-initialises the pair once every
write posted on it has landed (real in-flight writes still arrive after a cancel); operations on
the pair wait until then.

Die failure. :meth:`P2P.fail_die` stops a die (fail-stop): from that instant it issues no
chunk, credit or ACK, and every pair it belongs to is poisoned. Its peers learn of it as of an
abort notice (once the writes already in flight have landed, ``detect_ns`` later if the caller
models a slower detection): a peer blocked on a message from or to it, or starting one, raises
:class:`~xds.errors.DieFailure`; the failed die's own operations raise it as soon as they
next look. A message that had fully arrived before the failure still completes.
:meth:`P2P.repair_die` brings the die back and re-initialises its pairs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import msgspec

from ...errors import ConfigError, ProtocolError
from ...runtime import emit, now_ns, sleep_ns, sleep_until_ns, waiting_for
from ...runtime.sync import task_group_raising_single
from .. import checks
from ..failures import FailedDie
from ..memory import DieMemory, Direction
from ..ub import Engine, Transfer, UBFabric
from . import args
from .aiv import AivPool
from .monitor import P2PMonitor

NACK = 1 << 31
"""Set in the final ACK's flags when the receiver rejected the message."""


class AppBuffer(msgspec.Struct, frozen=True):
    """A range of a die's application region: what send and receive move."""

    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        for name in ("offset", "nbytes"):
            value = getattr(self, name)
            if not checks.is_integer(value) or value < 0:
                raise ConfigError(
                    f"AppBuffer.{name} must be a non-negative integer, got {value!r}",
                    field=f"AppBuffer.{name}",
                )
            msgspec.structs.force_setattr(self, name, int(value))  # numpy integers too


class Message(msgspec.Struct):
    """The out-of-band descriptor both engines agree on (size, lanes), posted by the sender."""

    event_id: int
    nbytes: int
    n_aiv: int
    engine: str
    lanes: int
    base: int
    seq: int
    chunks: list[int]
    offsets: list[int]
    data: bytes | None


class _Pair:
    """State of one (sender, receiver) pair, kept by each side's kernel."""

    def __init__(self, src: int, dst: int, ring_slots: int):
        self.src = src
        self.dst = dst
        self.send_lock = anyio.Lock()
        self.recv_lock = anyio.Lock()
        self.next_chunk = 0
        self.seq = 0
        self.published: dict[int, int] = {}
        self.consumed: dict[int, int] = {}
        self.slot_owner: list[tuple[int, int] | None] = [None] * ring_slots
        self.slot_last = [-1] * ring_slots  # last chunk issued into each slot
        self.issued = anyio.Event()  # set whenever a chunk is issued
        self.posted: deque[Message] = deque()
        self.posted_event = anyio.Event()
        self.poisoned: str | None = None
        self.aborted = False  # the abort notice of a poisoning has reached the peer
        self.quiescent_ns = 0  # when the latest write posted on the pair becomes visible
        self.ready: anyio.Event | None = None  # set when a deferred re-initialisation is done
        self.ready_ns = 0  # when that re-initialisation happens

    def posted_until(self, visible_ns: int) -> None:
        """Record a write posted on the pair's behalf that becomes visible at ``visible_ns``."""
        if visible_ns > self.quiescent_ns:
            self.quiescent_ns = visible_ns

    async def wait_ready(self, who: str) -> None:
        """Wait until a deferred re-initialisation (:meth:`P2P.reset_pair`) has happened."""
        if self.ready is not None:
            with waiting_for(
                f"{who}: the pair's re-initialisation (reset_pair) at t={self.ready_ns} ns"
            ):
                await self.ready.wait()


@asynccontextmanager
async def _holding(lock: anyio.Lock, what: str) -> AsyncIterator[None]:
    """Hold ``lock``; a wait for it is labelled ``what`` in deadlock reports."""
    with waiting_for(what):
        await lock.acquire()
    try:
        yield
    finally:
        lock.release()


async def _acquire_aivs(pool: AivPool, n: int, who: str) -> None:
    with waiting_for(
        lambda: f"{who}: {n} AIVs of die {pool.die} ({pool.free} of {pool.total} free)"
    ):
        await pool.acquire(n)


class P2P:
    """The point-to-point protocol engine over one :class:`UBFabric`.

    A fabric has one (``fabric.p2p``, which every ``XCCL(fabric)`` uses): the pair state it
    keeps (sequence numbers, ring slots, credits) is what the rings and metadata in the
    fabric's memory reflect, its AIV pools are the dies' AIVs and its monitor watches every
    slot. Building a second one on a fabric is a :class:`~xds.errors.ConfigError`; build a
    variant (a subclass) before the fabric's first ``XCCL``.
    """

    def __init__(self, fabric: UBFabric, monitor: P2PMonitor | None = None):
        if not isinstance(fabric, UBFabric):
            raise ConfigError(f"must be a UBFabric, got {type(fabric).__name__}", field="fabric")
        if monitor is not None and not isinstance(monitor, P2PMonitor):
            raise ConfigError(
                f"must be a P2PMonitor, got {type(monitor).__name__}", field="monitor"
            )
        fabric._bind_p2p(self)
        self.fabric = fabric
        self.monitor = monitor or P2PMonitor()
        self._pairs: dict[tuple[int, int], _Pair] = {}
        self._aivs: dict[int, AivPool] = {}
        self._failed = fabric.failures
        fabric.failures.listen(self)
        self.last_posted: dict[tuple[str, int, int], Any] = {}
        """Per (op, die, peer): the latest operation any XCCL on the fabric posted (its
        ``Handle``), which the next one waits for: posting order across communicators."""

    def _restart(self) -> None:
        """A later run uses the fabric: re-initialise every pair (its task-bound state and
        the memory that reflects it) and take the AIVs back."""
        for src, dst in list(self._pairs):
            self._reinitialise(src, dst)
        self._pairs.clear()
        self._aivs.clear()
        self.last_posted.clear()

    # -- bookkeeping ---------------------------------------------------------------------------
    def pair(self, src: int, dst: int) -> _Pair:
        key = (src, dst)
        p = self._pairs.get(key)
        if p is None:
            p = self._pairs[key] = _Pair(src, dst, self.fabric.config.ring_slots)
        return p

    def aivs(self, die: int) -> AivPool:
        self.fabric._enter_run()  # a pool of an earlier run is not this run's
        pool = self._aivs.get(die)
        if pool is None:
            pool = self._aivs[die] = AivPool(die, self.fabric.pod.spec_of(die).aiv)
        return pool

    def layout(self, nbytes: int, n_aiv: int, engine: str, src: int = 0) -> tuple[int, list[int]]:
        """(lanes, chunk sizes) of a message sent by ``src``."""
        c = self.fabric.config
        if engine == "dma":
            lanes = min(n_aiv, self.fabric.pod.spec_of(src).dma_engines)
            size = c.dma_chunk_bytes
        else:
            lanes = n_aiv
            per_lane = -(-nbytes // n_aiv) if nbytes else 0
            size = min(c.mte_chunk_bytes, max(c.min_chunk_bytes, -(-per_lane // 32) * 32))
        chunks = [size] * (nbytes // size)
        if nbytes % size:
            chunks.append(nbytes % size)
        return lanes, chunks

    # -- validation ----------------------------------------------------------------------------
    def _check(
        self,
        die: object,
        peer: object,
        buf: object,
        event_id: object,
        n_aiv: object,
        engine: object,
        *,
        fields: tuple[str, str] = ("src", "dst"),
    ) -> tuple[int, int, AppBuffer, int, int, Engine]:
        """The arguments of a send (``fields`` names ``die`` and ``peer`` as the call spells
        them: ``("src", "dst")``) or a receive (``("dst", "src")``), checked and as plain ints.
        Notes the run using the fabric first (a later run starts it idle)."""
        self.fabric._enter_run()
        pod = self.fabric.pod
        die = checks.die(pod, die, fields[0])
        peer = checks.die(pod, peer, fields[1])
        if die == peer:
            raise ProtocolError(f"die {die} cannot send to itself over XCCL point-to-point")
        if not isinstance(buf, AppBuffer):  # (an AppBuffer checked its fields when built)
            raise ConfigError(f"must be an AppBuffer, got {buf!r}", field="buf")
        self.fabric._check_range(buf.offset, buf.nbytes, "buf", fields=("buf.offset", "buf.nbytes"))
        event = args.event_id(event_id)
        aivs = self.fabric._check_aivs(die, n_aiv, field="n_aiv")
        mover: Engine = checks.engine(engine)  # type: ignore[assignment]
        return die, peer, buf, event, aivs, mover

    # -- send ------------------------------------------------------------------------------------
    async def send(
        self,
        src: int,
        dst: int,
        buf: AppBuffer,
        event_id: int,
        *,
        n_aiv: int = 2,
        engine: Engine = "mte",
        hold_aivs: bool = True,
        posted_ns: int | None = None,
    ) -> int:
        """Send ``buf`` of ``src`` to ``dst``; return the completion time (ns). ``posted_ns``:
        when an async caller posted it (its latency counts from there)."""
        src, dst, buf, event_id, n_aiv, engine = self._check(
            src, dst, buf, event_id, n_aiv, engine, fields=("src", "dst")
        )
        # end to end, as P037 measures: queueing for the pair and AIVs counts
        start = now_ns() if posted_ns is None else posted_ns
        pair = self.pair(src, dst)
        who = f"send eventID {event_id}, die {src} -> die {dst}"
        async with _holding(
            pair.send_lock, f"{who}: the previous send on this pair to finish (one at a time)"
        ):
            await pair.wait_ready(who)
            await self._check_alive(pair, src, who)
            if pair.poisoned:
                raise ProtocolError(pair.poisoned)
            pool = self.aivs(src)
            await _acquire_aivs(pool, n_aiv, who)
            held = True
            try:
                await sleep_ns(self.fabric.engines.kernel_launch_ns)
                await self._check_alive(pair, src, who)  # it may have failed meanwhile
                lanes, chunks = self.layout(buf.nbytes, n_aiv, engine, src)
                data = None
                if self.fabric.mode == "bytes":
                    data = bytes(self.fabric.memory(src).app[buf.offset : buf.offset + buf.nbytes])
                offsets = [0] * len(chunks)
                for j in range(1, len(chunks)):
                    offsets[j] = offsets[j - 1] + chunks[j - 1]
                msg = Message(
                    event_id,
                    buf.nbytes,
                    n_aiv,
                    engine,
                    lanes,
                    pair.next_chunk,
                    pair.seq,
                    chunks,
                    offsets,
                    data,
                )
                pair.next_chunk += len(chunks)
                pair.seq += 1
                pair.posted.append(msg)
                pair.posted_event.set()
                try:
                    async with task_group_raising_single() as tg:
                        for lane in range(min(lanes, len(chunks))):
                            tg.start_soon(
                                self._send_lane,
                                pair,
                                msg,
                                lane,
                                name=f"xccl send {src}->{dst} lane {lane}",
                            )
                    if not hold_aivs:
                        pool.release(n_aiv)
                        held = False
                    await self._await_final_ack(pair, msg)
                except anyio.get_cancelled_exc_class():
                    self._abandon(
                        pair,
                        f"pair {src}->{dst} was abandoned by a cancelled send (eventID "
                        f"{event_id}): its ring holds an unfinished message",
                        writer=src,
                    )
                    raise
            finally:
                if held:
                    pool.release(n_aiv)
        end = now_ns()
        emit(
            "xccl",
            "send",
            src=src,
            dst=dst,
            event_id=event_id,
            nbytes=buf.nbytes,
            n_aiv=n_aiv,
            engine=engine,
            latency_ns=end - start,
        )
        return end

    async def _send_lane(self, pair: _Pair, msg: Message, lane: int) -> None:
        fabric = self.fabric
        src, dst = pair.src, pair.dst
        ring_slots = fabric.config.ring_slots
        sender_mem = fabric.memory(src)
        first = True
        published = pair.published.get(lane, 0)
        for j in range(lane, len(msg.chunks), msg.lanes):
            if pair.aborted or src in self._failed:
                return  # abandoned, or this die failed: send() reports it
            size = msg.chunks[j]
            chunk = msg.base + j
            slot = chunk % ring_slots
            # Lanes run concurrently: a slot's chunks must be issued in chunk order, so wait
            # until the slot's previous chunk (one ring earlier) has been issued by its lane.
            previous = chunk - ring_slots
            while previous >= 0 and pair.slot_last[slot] < previous:
                if pair.aborted or src in self._failed:
                    return
                with waiting_for(
                    f"send eventID {msg.event_id}, die {src} -> die {dst}: ring slot {slot} "
                    f"until this sender's lanes have issued chunk {previous}"
                ):
                    await pair.issued.wait()
            owner = pair.slot_owner[slot]
            if owner is not None:  # R2: wait for the credit of the slot's previous chunk
                field = sender_mem.meta(dst, owner[0], Direction.TX)
                while field.ack < owner[1]:
                    if pair.aborted or src in self._failed:
                        return
                    with waiting_for(
                        lambda f=field, o=owner, s=slot: (
                            f"send eventID {msg.event_id}, die {src} -> die {dst}: credit for "
                            f"ring slot {s} (the receiver has ACKed {f.ack} bytes on lane "
                            f"{o[0]}; the slot is free at {o[1]}; R2)"
                        )
                    ):
                        await field.changed()
            await self.delay("sender", pair, lane)
            if src in self._failed:
                return  # failed while this lane waited: it issues nothing more
            start = now_ns()
            if msg.engine == "dma":
                t = (
                    fabric.dma_transfer(src, dst, size, start_ns=start)
                    if first
                    else self._dma_next(src, dst, size, start)
                )
            else:
                t = fabric.mte_transfer(src, dst, size, start_ns=start, fill=first)
            published += size
            pair.published[lane] = published
            pair.slot_owner[slot] = (lane, published)
            pair.slot_last[slot] = chunk
            issued, pair.issued = pair.issued, anyio.Event()
            issued.set()
            offset = msg.offsets[j]
            data = msg.data[offset : offset + size] if msg.data is not None else None
            fabric.post(t.visible_ns, self._chunk_visible, pair, lane, slot, chunk, size, data)
            pair.posted_until(t.visible_ns)
            self._post_tail(pair, msg, lane, chunk, published, t)
            await sleep_until_ns(t.end_ns)
            first = False

    def _dma_next(self, src: int, dst: int, size: int, start: int) -> Transfer:
        """A chained DMA descriptor: its start-up overlaps the previous one's transfer."""
        ports, link_bw, latency = self.fabric._link_ports(src, dst)
        from ..ports import finish_ns

        end = finish_ns(start, size, link_bw, ports, now_ns=start)
        self.fabric.stats.remote_ops += 1
        self.fabric.stats.remote_bytes += size
        return Transfer(start, end, end + latency)

    def tail_visible_ns(self, t: Transfer) -> int:
        """When the tailPtr written after a chunk becomes visible: after the chunk's data (R1)
        and one metadata write after the store completes."""
        return max(t.visible_ns, t.end_ns + self.fabric.engines.meta_write_ns)

    def ack_visible_ns(self, pair: _Pair, issued_ns: int) -> int:
        """When a credit or ACK the receiver writes back to the sender becomes visible."""
        return self.fabric.meta_visible_ns(pair.dst, pair.src, issued_ns)

    def _post_tail(
        self, pair: _Pair, msg: Message, lane: int, chunk: int, published: int, t: Transfer
    ) -> None:
        when = self.tail_visible_ns(t)
        pair.posted_until(when)
        self.fabric.post(when, self.monitor.tail_visible, pair.src, pair.dst, lane, published)
        self.fabric.post_meta(
            when,
            pair.dst,
            pair.src,
            lane,
            Direction.RX,
            event_id=msg.event_id,
            chunk_id=chunk & 0xFFFFFFFF,
            flags=msg.n_aiv,
            tail_ptr=published,
        )

    def _chunk_visible(
        self, pair: _Pair, lane: int, slot: int, chunk: int, size: int, data: bytes | None
    ) -> None:
        self.monitor.data_visible(pair.src, pair.dst, lane, slot, chunk, size)
        if data is not None:
            ring_slot = self.fabric.memory(pair.dst).slot(pair.src, slot)
            ring_slot[:size] = data

    async def _await_final_ack(self, pair: _Pair, msg: Message) -> None:
        field = self.fabric.memory(pair.src).meta(pair.dst, 0, Direction.TX)
        want = msg.seq & 0xFFFFFFFF
        while not (
            field.chunk_id == want
            and field.flags & 0x1
            and (field.event_id == msg.event_id or field.flags & NACK)
        ):
            if pair.aborted or pair.src in self._failed:  # no ACK will come, or be seen
                raise self._pair_error(
                    pair, f"die {pair.src} sending eventID {msg.event_id} to {pair.dst}", pair.src
                )
            with waiting_for(
                f"send eventID {msg.event_id}, die {pair.src} -> die {pair.dst}: the receiver's "
                "final ACK (step 8; has the receiver posted a receive for this message?)"
            ):
                await field.changed()
        if field.flags & NACK:
            raise ProtocolError(
                f"receiver {pair.dst} rejected message eventID {msg.event_id} from {pair.src} "
                "(eventID or size mismatch)"
            )

    # -- receive ---------------------------------------------------------------------------------
    async def receive(
        self,
        dst: int,
        src: int,
        buf: AppBuffer,
        event_id: int,
        *,
        n_aiv: int = 2,
        engine: Engine = "mte",
        hold_aivs: bool = True,
        posted_ns: int | None = None,
    ) -> int:
        """Receive the next message from ``src`` into ``buf`` of ``dst``; return the time.
        ``posted_ns``: when an async caller posted it (its latency counts from there)."""
        dst, src, buf, event_id, n_aiv, engine = self._check(
            dst, src, buf, event_id, n_aiv, engine, fields=("dst", "src")
        )
        start = now_ns() if posted_ns is None else posted_ns
        pair = self.pair(src, dst)
        who = f"receive eventID {event_id} at die {dst} from die {src}"
        async with _holding(
            pair.recv_lock, f"{who}: the previous receive on this pair to finish (one at a time)"
        ):
            await pair.wait_ready(who)
            await self._check_alive(pair, dst, who)
            if pair.poisoned:
                raise ProtocolError(pair.poisoned)
            pool = self.aivs(dst)
            if not hold_aivs:  # async mode: no AIV is held while waiting for the sender
                await self._await_descriptor(pair)
            await _acquire_aivs(pool, n_aiv, who)
            held = True
            try:
                await sleep_ns(self.fabric.engines.kernel_launch_ns)
                await self._await_descriptor(pair)  # rendezvous with the sender's descriptor
                await self._check_alive(pair, dst, who)  # it may have failed meanwhile
                msg = pair.posted.popleft()
                problems: list[str] = []
                if msg.event_id != event_id:  # R3 (also for messages without chunks)
                    problems.append(
                        f"eventID mismatch: expected {event_id}, the sender wrote {msg.event_id}"
                    )
                if msg.nbytes != buf.nbytes:
                    problems.append(
                        f"receive buffer is {buf.nbytes} bytes but the message is {msg.nbytes}"
                    )
                if msg.engine != engine or msg.n_aiv != n_aiv:
                    problems.append(
                        f"receiver uses {engine}/{n_aiv} AIVs but the sender used "
                        f"{msg.engine}/{msg.n_aiv}"
                    )
                consumed_before = sum(pair.consumed.values())
                try:
                    async with task_group_raising_single() as tg:
                        for lane in range(min(msg.lanes, len(msg.chunks))):
                            tg.start_soon(
                                self._receive_lane,
                                pair,
                                msg,
                                lane,
                                buf,
                                event_id,
                                problems,
                                name=f"xccl receive {src}->{dst} lane {lane}",
                            )
                except anyio.get_cancelled_exc_class():
                    self._abandon(
                        pair,
                        f"pair {src}->{dst} was abandoned by a cancelled receive (eventID "
                        f"{event_id}) in the middle of a message",
                        writer=dst,
                    )
                    raise
                incomplete = sum(pair.consumed.values()) - consumed_before < msg.nbytes
                if dst in self._failed or (pair.aborted and incomplete):
                    # this die failed (it copies nothing more and writes no final ACK), or the
                    # sender abandoned the message before all of it arrived
                    raise self._pair_error(
                        pair, f"die {dst} receiving eventID {event_id} from {src}", dst
                    )
                if not hold_aivs:
                    pool.release(n_aiv)
                    held = False
                flags = 0x1 | (NACK if problems else 0)
                ack_ns = self.ack_visible_ns(pair, now_ns())
                pair.posted_until(ack_ns)
                self.fabric.post_meta(
                    ack_ns,
                    src,
                    dst,
                    0,
                    Direction.TX,
                    event_id=event_id,
                    chunk_id=msg.seq & 0xFFFFFFFF,
                    flags=flags,
                )
            finally:
                if held:
                    pool.release(n_aiv)
        if problems:
            raise ProtocolError(
                f"die {dst} receiving from {src}: " + "; ".join(dict.fromkeys(problems))
            )
        end = now_ns()
        emit(
            "xccl",
            "receive",
            src=src,
            dst=dst,
            event_id=event_id,
            nbytes=buf.nbytes,
            latency_ns=end - start,
        )
        return end

    async def _await_descriptor(self, pair: _Pair) -> None:
        while not pair.posted:
            if pair.aborted or pair.dst in self._failed:  # no send will come, or be taken
                raise self._pair_error(
                    pair, f"receive at die {pair.dst} from die {pair.src}", pair.dst
                )
            pair.posted_event = anyio.Event()
            with waiting_for(
                f"receive at die {pair.dst} from die {pair.src}: a send from die {pair.src} "
                "(none is posted on this pair)"
            ):
                await pair.posted_event.wait()

    # -- cancellation and recovery ---------------------------------------------------------------
    def _abandon(self, pair: _Pair, reason: str, *, writer: int) -> None:
        """A send or receive was cancelled in the middle of a message: poison the pair (later
        operations raise ``reason``) and post the abort notice that wakes a peer blocked on the
        message. The notice is a metadata write from ``writer`` to its peer, ordered after
        every write already posted on the pair, so the peer first sees whatever was in flight.
        """
        if pair.poisoned is not None:
            return  # already abandoned (both sides cancelled together): one notice is enough
        pair.poisoned = (
            f"{reason}; call xccl.reset_pair({pair.src}, {pair.dst}) to re-initialise the pair"
        )
        peer = pair.dst if writer == pair.src else pair.src
        when = max(self.fabric.meta_visible_ns(writer, peer, now_ns()), pair.quiescent_ns)
        pair.posted_until(when)
        self.fabric.stats.meta_writes += 1
        self.fabric.post(when, self._abort_visible, pair)

    def _abort_visible(self, pair: _Pair) -> None:
        """The abort notice lands: wake every task of the pair blocked on the abandoned message
        (they see ``pair.aborted`` and give up)."""
        pair.aborted = True
        self._wake(pair)

    def _wake(self, pair: _Pair) -> None:
        """Wake every task blocked on the pair (credits, ACKs, tailPtrs, ring order and a
        receiver waiting for a descriptor) to look at the pair's state again."""
        pair.posted_event.set()
        for die, peer, direction in (
            (pair.src, pair.dst, Direction.TX),  # credits and the final ACK (sender side)
            (pair.dst, pair.src, Direction.RX),  # tailPtrs (receiver side)
        ):
            mem = self.fabric.memory(die)
            for key, field in list(mem._meta.items()):
                if key[0] == peer and key[2] == direction:
                    field.notify()
        issued, pair.issued = pair.issued, anyio.Event()
        issued.set()

    def reset_pair(self, src: int, dst: int) -> int:
        """Re-initialise the pair ``src -> dst`` after an abandoned (cancelled or timed-out)
        transfer: drop its ring contents, descriptors, credits and poisoning on both sides (what
        re-establishing the pair's managed ring and metadata does). The pair ``dst -> src`` is
        not touched.

        Writes the abandoned transfer already posted (ring data, tailPtrs, credits, ACKs) still
        land at their modelled visibility times, so the re-initialisation happens once the last
        of them is visible. This call returns at once with that virtual time (``now_ns()`` if
        nothing is in flight); a ``send`` or ``receive`` on the pair started before then waits
        for it, so it never sees a stale write.

        Call it only when no send or receive on the pair is running (a peer still blocked on
        the abandoned message fails with :class:`ProtocolError` shortly after the cancel);
        otherwise it raises :class:`ProtocolError`.
        """
        self.fabric._enter_run()
        src = checks.die(self.fabric.pod, src, "src")
        dst = checks.die(self.fabric.pod, dst, "dst")
        if src == dst:
            raise ConfigError(f"a pair joins two dies, got src = dst = {src}", field="dst")
        key = (src, dst)
        old = self._pairs.get(key)
        if old is not None and (old.send_lock.locked() or old.recv_lock.locked()):
            raise ProtocolError(
                f"pair {src}->{dst} has a transfer in progress; reset it only when no send or "
                "receive on it is running"
            )
        now = now_ns()
        when = now if old is None else max(now, old.quiescent_ns, old.ready_ns)
        new = self._pairs[key] = _Pair(src, dst, self.fabric.config.ring_slots)
        new.ready_ns = when
        if when <= now:
            self._reinitialise(src, dst)
        else:
            new.ready = anyio.Event()
            self.fabric.post(when, self._deferred_reinitialise, new)
        return when

    # -- die failure ---------------------------------------------------------------------------
    def fail_die(self, die: int, *, detect_ns: int = 0) -> None:
        """Fail ``die`` now (fail-stop; see the module docstring). It issues nothing more (a
        chunk already being moved still lands) and its own operations raise
        :class:`~xds.errors.DieFailure` as soon as they next look; a peer learns of it
        one metadata latency after the failure, plus ``detect_ns`` (a slower detection, e.g.
        by heartbeat), and never before the writes already in flight on their pair have
        landed: from then on its operations with the die raise ``DieFailure``. The failure is
        the fabric's (``fabric.failures``): collective groups on it see it too.
        """
        self.fabric._enter_run()
        die = checks.die(self.fabric.pod, die, "die")
        detect_ns = checks.integer(detect_ns, "detect_ns")
        self._failed.fail(die, detect_ns)  # tells every listener: this engine, the groups

    def die_failed(self, failure: FailedDie) -> None:
        """Poison every pair of the failed die; its peers see the abort once they know."""
        die = failure.die
        for (src, dst), pair in sorted(self._pairs.items()):
            if die not in (src, dst):
                continue
            peer = dst if src == die else src
            if pair.poisoned is None:
                pair.poisoned = failure.describe()
                when = max(self._failed.known_ns(failure, peer), pair.quiescent_ns)
                pair.posted_until(when)
                self.fabric.post(when, self._abort_visible, pair)
            self._wake(pair)  # the failed die's own tasks stop now

    def repair_die(self, die: int) -> int:
        """Bring a failed die back: re-initialise every pair it belongs to (as
        :meth:`reset_pair`, each direction) and return when the last of them is ready. Its
        application region keeps its bytes. Raises :class:`ProtocolError` while an operation
        on one of its pairs is still running (its peers fail once they learn of the failure:
        repair after that). Collective groups with the die stay broken (see
        :mod:`xds.fabric.xccl.group_failure`)."""
        self.fabric._enter_run()
        die = checks.die(self.fabric.pod, die, "die")
        if die not in self._failed:
            raise ProtocolError(f"die {die} has not failed (xccl.fail_die fails it)")
        busy = [
            f"{src}->{dst}"
            for (src, dst), pair in sorted(self._pairs.items())
            if die in (src, dst) and (pair.send_lock.locked() or pair.recv_lock.locked())
        ]
        if busy:
            raise ProtocolError(
                f"die {die} cannot be repaired while operations on pair(s) {', '.join(busy)} "
                "are running; repair it once they have failed"
            )
        self._failed.repair(die)
        ready = now_ns()
        for src, dst in sorted(self._pairs):
            if die in (src, dst):
                ready = max(ready, self.reset_pair(src, dst))
        return ready

    def failed_dies(self) -> dict[int, int]:
        """The dies that have failed and not been repaired: die -> virtual time of failure."""
        self.fabric._enter_run()  # an earlier run's failures are not this run's
        return self._failed.failed()

    def _failure_of(self, pair: _Pair, die: int) -> tuple[FailedDie | None, int]:
        """The failure an operation of ``die`` on ``pair`` meets, and when ``die`` knows of it:
        its own failure first (known at once), else its peer's (None if neither failed)."""
        failure = self._failed.of(die) or self._failed.of(pair.dst if die == pair.src else pair.src)
        return failure, (self._failed.known_ns(failure, die) if failure is not None else 0)

    async def _check_alive(self, pair: _Pair, die: int, who: str) -> None:
        """Before an operation of ``die`` on ``pair`` starts: if either die has failed, raise
        :class:`DieFailure`, once ``die`` can know it (at once if ``die`` is the failed one)."""
        failure, known_ns = self._failure_of(pair, die)
        if failure is None:
            return
        if known_ns > now_ns():
            with waiting_for(f"{who}: (die {failure.die} has failed; learning of it)"):
                await sleep_until_ns(known_ns)
        raise failure.error(who)

    def _pair_error(self, pair: _Pair, who: str, die: int) -> ProtocolError:
        """The error an operation of ``die`` on an abandoned pair raises: :class:`DieFailure`
        for ``die``'s own failure, else for its peer's once ``die`` can know of it, else the
        pair's poisoning (a cancelled transfer)."""
        failure, known_ns = self._failure_of(pair, die)
        if failure is not None and known_ns <= now_ns():
            return failure.error(who)
        return ProtocolError(f"{who}: {pair.poisoned}")  # (an abort notice of a cancel woke it)

    def _deferred_reinitialise(self, pair: _Pair) -> None:
        self._reinitialise(pair.src, pair.dst)
        assert pair.ready is not None
        pair.ready.set()

    def _reinitialise(self, src: int, dst: int) -> None:
        """Clear the memory of pair ``src -> dst``: the receiver's ring and tailPtr fields, the
        sender's credit/ACK fields, and the monitor's view of the pair."""
        receiver, sender = self.fabric.memory(dst), self.fabric.memory(src)
        for key in [k for k in receiver._meta if k[0] == src and k[2] == Direction.RX]:
            del receiver._meta[key]
        for key in [k for k in sender._meta if k[0] == dst and k[2] == Direction.TX]:
            del sender._meta[key]
        for slot_key in [k for k in receiver._slots if k[0] == src]:
            del receiver._slots[slot_key]
        self.monitor.forget_pair(src, dst)

    async def _receive_lane(
        self,
        pair: _Pair,
        msg: Message,
        lane: int,
        buf: AppBuffer,
        event_id: int,
        problems: list[str],
    ) -> None:
        fabric = self.fabric
        src, dst = pair.src, pair.dst
        ring_slots = fabric.config.ring_slots
        mem: DieMemory = fabric.memory(dst)
        field = mem.meta(src, lane, Direction.RX)
        consumed = pair.consumed.get(lane, 0)
        first = True
        for j in range(lane, len(msg.chunks), msg.lanes):
            size = msg.chunks[j]
            chunk = msg.base + j
            slot = chunk % ring_slots
            if dst in self._failed:
                return  # this die failed: it copies nothing out; receive() reports it
            while field.tail_ptr < consumed + size:  # step 5: poll the local tailPtr
                if pair.aborted or dst in self._failed:
                    return  # the sender abandoned the message: receive() reports it
                with waiting_for(
                    lambda f=field, c=chunk, want=consumed + size: (
                        f"receive eventID "
                        f"{event_id} at die {dst} from die {src}: chunk {c} on lane {lane} "
                        f"(tailPtr {f.tail_ptr} < {want}; step 5)"
                    )
                ):
                    await field.changed()
            if field.event_id != event_id:  # R3
                problems.append(
                    f"eventID mismatch: expected {event_id}, the sender wrote {field.event_id}"
                )
            self.monitor.read_start(src, dst, slot, chunk)
            consumed += size
            self.before_copy_out(pair, lane, consumed)
            await self.delay("receiver", pair, lane)
            # the lane's share of the receiver's AIVs copies the chunk out (one on the MTE
            # path, where every AIV is a lane; on the DMA path the lanes follow the sender's
            # DMA engines, and the receiver's other AIVs help copy out)
            t = fabric.mte_transfer(
                dst, dst, size, start_ns=now_ns(), fill=first, aivs=max(1, msg.n_aiv // msg.lanes)
            )
            await sleep_until_ns(t.end_ns)
            if dst in self._failed:
                return  # failed during the copy: it posts no credit; receive() reports it
            if fabric.mode == "bytes" and not problems:
                offset = buf.offset + msg.offsets[j]
                mem.app[offset : offset + size] = mem.slot(src, slot)[:size]
            self.monitor.read_end(src, dst, slot, chunk)
            pair.consumed[lane] = consumed
            self.after_copy_out(pair, lane, consumed, t)
            pair.posted_until(self.ack_visible_ns(pair, now_ns()))  # the credit just posted
            first = False

    # Hooks a protocol variant may override (the tests keep deliberately broken ones).
    async def delay(self, side: str, pair: _Pair, lane: int) -> None:
        """Extra delay before a sender lane issues a chunk or a receiver lane copies one out.
        None in the model; tests override it with random delays to shake interleavings."""

    def before_copy_out(self, pair: _Pair, lane: int, consumed: int) -> None:
        """Called when a chunk's copy-out starts. The correct protocol does nothing here."""

    def after_copy_out(self, pair: _Pair, lane: int, consumed: int, t: Transfer) -> None:
        """Called when a chunk is copied out: publish the credit (R2: consume before ACK)."""
        self.fabric.post_meta(
            self.ack_visible_ns(pair, t.end_ns),
            pair.src,
            pair.dst,
            lane,
            Direction.TX,
            ack=consumed,
        )
