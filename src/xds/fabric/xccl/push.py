"""Push exchanges over NPU-Direct URMA: the building block of A2E and E2A (SPEC 5.3-5.4).

A source die pushes one block per destination straight into the destination's managed area
with DMA (URMA: an AIV only issues descriptors; no UBuf, no MTE2), then writes the
destination's metadata field (eventID, row count), ordered after the data. A destination
collects a block from every source it expects: the metadata of all of them is its barrier.

Costs per source: the issuing AIVs (one per DMA queue) spend ``meta_issue_ns`` of scalar work
per destination on the descriptor and again on the metadata write; each DMA queue pays the DMA
start-up once and then streams its descriptors at link rate, starting them in order (none
before the queue is up), sharing the source's egress and each destination's ingress with
every other transfer (:mod:`xds.fabric.ports`).
"""

from __future__ import annotations

import anyio
import msgspec
import numpy as np

from ...errors import ConfigError, ProtocolError
from ...hw import collective_efficiency
from ...runtime import now_ns, sleep_until_ns, waiting_for
from ..memory import Direction
from ..ports import finish_ns
from ..ub import UBFabric


class Block(msgspec.Struct):
    """Rows pushed from one die to another: count, bytes (bytes mode) and side information."""

    rows: int
    data: bytes | None
    side: np.ndarray


class PushExchange:
    """Blocks and metadata of push exchanges over one fabric, keyed by exchange name.

    Two tiers: ``protocol`` posts every block's arrival and every metadata write as a timed
    event and destinations poll their metadata fields; ``collective`` computes the same times
    with the same ports but records them, and a destination sleeps until the last metadata it
    needs (no per-block events).
    """

    def __init__(self, fabric: UBFabric, names: tuple[str, ...], *, tier: str = "protocol"):
        if tier not in ("protocol", "collective"):
            raise ConfigError(f"unknown tier {tier!r}", field="tier")
        self.fabric = fabric
        self.tier = tier
        self._slot = {name: i for i, name in enumerate(names)}
        self._fields = fabric.reserve_collective_fields(2 * len(names))  # x parity
        self._blocks: dict[tuple[str, int, int, int], Block] = {}
        self.meta_writes: dict[tuple[str, int], int] = {}  # (name, src) -> count, for tests
        # collective tier: (name, src, dst, event) -> (metadata visible at, block or None,
        # when the source pushed)
        self._arrivals: dict[tuple[str, int, int, int], tuple[int, Block | None, int]] = {}
        self._pushed: dict[tuple[str, int], anyio.Event] = {}  # (name, src): a push happened
        self._unread: dict[tuple[str, int, int, int], int] = {}
        """collective tier: (name, src, dst, parity) -> the eventID of an arrival not read yet."""
        self._seen: dict[tuple[str, int, int, int], int] = {}
        """(name, src, dst, parity) -> the eventID ``dst`` last read there."""

    def start_idle(self) -> None:
        """A later run on the fabric: no exchange of an earlier timeline is in progress."""
        self._blocks.clear()
        self._arrivals.clear()
        self._pushed.clear()
        self._seen.clear()
        self._unread.clear()

    def _field_index(self, name: str, parity: int) -> int:
        return self._fields + 2 * self._slot[name] + parity

    async def push(
        self,
        name: str,
        src: int,
        event_id: int,
        blocks: dict[int, Block],
        notify: list[int],
        row_bytes: int,
        *,
        lanes: int,
    ) -> int:
        """Push ``blocks`` (destination die -> block) from ``src``; write metadata to every die
        in ``notify`` (a zero count where there is no block). Returns when the last metadata
        write has been issued."""
        fabric = self.fabric
        e = fabric.engines
        parity = event_id & 1
        field = self._field_index(name, parity)
        collective = self.tier == "collective"
        lanes = max(1, min(lanes, len(notify))) if notify else 1
        fan_out = sum(1 for d, b in blocks.items() if b.rows and d != src)
        efficiency = collective_efficiency(e, fan_out)
        t0 = now_ns()
        queue_free = [t0] * lanes  # when each issuing AIV is free
        dma_begun: list[int | None] = [None] * lanes  # when each DMA queue began its last
        last_issue = t0  # descriptor (None: not started yet; the first pays the start-up)
        for i, dst in enumerate(notify):
            lane = i % lanes
            block = blocks.get(dst)
            issue = queue_free[lane] + e.meta_issue_ns  # descriptor
            has_rows = block is not None and block.rows > 0
            if has_rows:
                ports, link_bw, latency = fabric._link_ports(src, dst)
                # a DMA queue starts its descriptors in order, streaming them once it is up
                begun = dma_begun[lane]
                begin = issue + e.dma_startup_ns if begun is None else max(issue, begun)
                dma_begun[lane] = begin
                nbytes = block.rows * row_bytes
                end = finish_ns(
                    begin, nbytes, link_bw * efficiency, ports, now_ns=t0, efficiency=efficiency
                )
                fabric.stats.remote_ops += 1
                fabric.stats.remote_bytes += nbytes
                visible = end + latency
                queue_free[lane] = issue + e.meta_issue_ns  # the metadata write
                meta_at = max(visible, fabric.meta_visible_ns(src, dst, queue_free[lane]))
                if not collective:
                    fabric.post(visible, self._deposit, name, src, dst, parity, block)
            else:
                queue_free[lane] = issue
                meta_at = fabric.meta_visible_ns(src, dst, issue)
            if collective:
                self._arrivals[(name, src, dst, event_id)] = (
                    meta_at,
                    block if has_rows else None,
                    t0,
                )
                self._unread[(name, src, dst, parity)] = event_id
            else:
                fabric.post_meta(
                    meta_at,
                    dst,
                    src,
                    field,
                    Direction.COLL,
                    issued_by=(src, t0),
                    event_id=event_id,
                    chunk_id=block.rows if block is not None else 0,
                )
            last_issue = max(last_issue, queue_free[lane])
        self.meta_writes[(name, src)] = self.meta_writes.get((name, src), 0) + len(notify)
        if collective:
            pushed = self._pushed.pop((name, src), None)
            if pushed is not None:
                pushed.set()
        await sleep_until_ns(last_issue)
        return last_issue

    def _deposit(self, name: str, src: int, dst: int, parity: int, block: Block) -> None:
        key = (name, src, dst, parity)
        if key in self._blocks:
            raise ProtocolError(
                f"{name}: die {src} overwrote its block at die {dst} before it was collected"
            )
        self._blocks[key] = block

    async def collect(
        self, name: str, dst: int, event_id: int, sources: list[int]
    ) -> dict[int, Block]:
        """Wait for every source's metadata for ``event_id``; return their blocks.

        A source's field holding a *new* write of another eventID (not the one this die last
        read there) means the dies disagree on the eventID: a :class:`ProtocolError` naming
        both, rather than a wait that never ends. Nothing is taken until every source's
        metadata is in, so a collect cancelled while waiting can be retried; one collecting an
        eventID it already read from a source is a ProtocolError (the field still holds it)."""
        parity = event_id & 1
        for src in sources:
            if self._seen.get((name, src, dst, parity)) == event_id:
                raise ProtocolError(
                    f"{name}: die {dst} collects eventID {event_id} from die {src} again after "
                    f"reading it: that metadata field still holds eventID {event_id}, so the "
                    "wait would pass on the old exchange's metadata; give each exchange a new "
                    "eventID"
                )
        if self.tier == "collective":
            out = await self._collect_recorded(name, dst, event_id, sources)
            for src in sources:
                self._seen[(name, src, dst, parity)] = event_id
            return out
        field_index = self._field_index(name, parity)
        mem = self.fabric.memory(dst)
        fields = []
        for src in sources:
            field = mem.meta(src, field_index, Direction.COLL)
            last = self._seen.get((name, src, dst, parity), field.event_id)
            while field.event_id != event_id:
                if field.event_id != last:
                    self._disagree(name, src, dst, field.event_id, event_id)
                with waiting_for(
                    lambda s=src, f=field: (
                        f"{name} eventID {event_id}: die {dst} waits for die "
                        f"{s}'s metadata (that field holds eventID {f.event_id})"
                    )
                ):
                    await field.changed()
            fields.append((src, field))
        await anyio.lowlevel.checkpoint()
        out: dict[int, Block] = {}
        for src, field in fields:
            self._seen[(name, src, dst, parity)] = event_id
            if field.chunk_id:
                block = self._blocks.pop((name, src, dst, parity), None)
                if block is None or block.rows != field.chunk_id:
                    raise ProtocolError(f"{name}: metadata from die {src} visible before its data")
                out[src] = block
        return out

    @staticmethod
    def _disagree(name: str, src: int, dst: int, written: int, expected: int) -> None:
        raise ProtocolError(
            f"{name}: die {src} wrote eventID {written} where die {dst} expects {expected} "
            f"(the dies disagree on the eventID, or die {dst} skipped eventID {written})"
        )

    async def _collect_recorded(
        self, name: str, dst: int, event_id: int, sources: list[int]
    ) -> dict[int, Block]:
        out: dict[int, Block] = {}
        ready = now_ns()
        taken = []  # the arrivals read: they leave only once this die has them (a collect
        # cancelled before that leaves them for a retry, as the protocol tier's fields do)
        parity = event_id & 1
        for src in sources:
            key = (name, src, dst, event_id)
            taken.append(key)
            while key not in self._arrivals:  # that source has not pushed yet
                other = self._unread.get((name, src, dst, parity))
                if other is not None and other != event_id:  # raised when the protocol
                    # tier's die would see that metadata
                    await sleep_until_ns(self._arrivals[(name, src, dst, other)][0])
                    self._disagree(name, src, dst, other, event_id)
                pushed = self._pushed.setdefault((name, src), anyio.Event())
                with waiting_for(
                    f"{name} eventID {event_id}: die {dst} waits for die {src} to push"
                ):
                    await pushed.wait()
            meta_at, block, pushed_at = self._arrivals[key]
            if self.fabric.failures.failed_by(src, pushed_at):  # it failed at that very
                # instant: nothing it issued lands (as in the protocol tier); wait until the
                # group's failure handling stops this die
                with waiting_for(f"{name} eventID {event_id}: die {dst} waits for die {src}"):
                    await anyio.Event().wait()
            ready = max(ready, meta_at)
            if block is not None:
                out[src] = block
        await sleep_until_ns(ready)
        for key in taken:
            del self._arrivals[key]
            unread = (name, key[1], dst, parity)
            if self._unread.get(unread) == event_id:
                del self._unread[unread]
        return out
