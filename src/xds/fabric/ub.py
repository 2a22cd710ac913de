"""The UB fabric: every die's memory, reachable from every die, with modelled latency.

:class:`UBFabric` owns the pod's die memories (lazily created), the bandwidth ports that model
contention, and *posted writes*: a write issued at ``t`` becomes visible to readers only at its
modelled completion time; until then a reader sees the old bytes (SPEC 0.4, 1.3).

Costs come from :mod:`xds.hw` (SPEC 1.4, 3.7):

* **MTE2/MTE3** (through an AIV's unified buffer): start-up ``mte_startup_ns``; each AIV moves
  ``b_aiv`` B/s (:func:`xds.hw.aiv_mte_bandwidth`: HBM bandwidth / AIVs per die by default);
  load and store overlap (ping-pong), so only the first operation's start-up and load are
  exposed; at most half a UBuf per operation.
* **DMA/URMA**: start-up ``dma_startup_ns``; moves at link rate, needs no UBuf and no MTE.
* Either is capped by the link between the dies and shares each die's egress and ingress
  bandwidth with concurrent transfers (:mod:`xds.fabric.ports`); then the link's one-way latency.
* Local copies (same die) go through the die's HBM port (read + write).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from ..config import require_instance
from ..errors import ConfigError, ProtocolError
from ..hw import CloudMatrix384, LinkSpec, Network, aiv_mte_bandwidth
from ..runtime import Runtime, current_runtime, sleep_until_ns
from ..runtime.core import _current as _current_run
from . import checks
from .checks import ENGINES
from .config import FabricConfig, validated
from .failures import DieFailures
from .memory import DieMemory, Direction, MetaField
from .ports import Port, finish_ns

if TYPE_CHECKING:
    from .xccl.p2p import P2P

Engine = Literal["mte", "dma"]


class FabricStats(msgspec.Struct):
    """Counters of what moved over the fabric."""

    remote_ops: int = 0
    remote_bytes: int = 0
    local_ops: int = 0
    local_bytes: int = 0
    meta_writes: int = 0


class Transfer(msgspec.Struct, frozen=True):
    """Timing of one modelled transfer: the mover is busy until ``end_ns``; the bytes are
    visible at the destination from ``visible_ns``."""

    start_ns: int
    end_ns: int
    visible_ns: int


_PORT_NAMES = {net: (f"{net.value}.out", f"{net.value}.in") for net in Network}
"""Per network, the names of a die's egress and ingress ports on it."""

_META_DELAY: dict[tuple[object, object, tuple[int, ...]], np.ndarray] = {}


class UBFabric:
    """The pod's device memories and the UB fabric between them.

    A fabric may serve several ``xds.run`` calls (a module-scoped pytest fixture, say). Each
    run has its own timeline starting at 0, so the first use of the fabric in a later run
    starts it idle: the port bookings of the earlier timeline are dropped, every
    point-to-point pair is re-initialised (as :meth:`P2P.reset_pair` does: rings, tailPtrs,
    credits, sequence numbers, AIVs), the collective metadata fields are cleared (a group's
    next exchange never reads an earlier run's eventIDs; groups drop their exchange state) and
    every die is healthy again; application memory keeps its bytes, and writes the earlier run
    posted that had not landed when it ended never land.
    """

    def __init__(self, pod: CloudMatrix384, config: FabricConfig | None = None, **overrides: Any):
        require_instance(pod, CloudMatrix384, "pod")
        if config is not None:
            require_instance(config, FabricConfig, "config")
        config = config or FabricConfig()
        if overrides:
            unknown = sorted(set(overrides) - set(FabricConfig.__struct_fields__))
            if unknown:
                raise ConfigError(
                    f"unknown fabric parameter(s) {', '.join(unknown)}", field=unknown[0]
                )
            config = msgspec.structs.replace(config, **overrides)
        self.pod = pod
        # every die type present bounds the chunks and the region (attached 910B servers too)
        kinds = [pod.die_spec, *([pod.config.b_die] if pod.n_910b_dies else [])]
        self.config = validated(config, min(k.ubuf_bytes for k in kinds))
        hbm = min(k.hbm_bytes for k in kinds)
        if self.config.app_bytes > hbm:
            raise ConfigError(
                f"the application region ({self.config.app_bytes:,} bytes) exceeds a die's "
                f"HBM ({hbm:,} bytes)",
                field="fabric.app_bytes",
            )
        self.engines = pod.engines
        self.stats = FabricStats()
        self._memories: dict[int, DieMemory] = {}
        self._ports: dict[tuple[int, str], Port] = {}
        self._links: dict[tuple[int, int], tuple[tuple[Port, ...], float, int]] = {}
        self._workers: dict[int, tuple[int, float]] = {}
        self._link_specs: dict[Network, LinkSpec] = {}
        self._collective_fields = 0
        self._p2p: P2P | None = None
        self.failures = DieFailures(self)
        """The failed dies (``XCCL.fail_die``), seen by point-to-point and collectives."""
        self._run: weakref.ref[Runtime] | None = None
        self.run_epoch = 0
        """How many later runs have started on this fabric (each starts it idle)."""

    @property
    def p2p(self) -> P2P:
        """The fabric's point-to-point protocol: the state of every pair (sequence numbers,
        ring slots, credits) that the rings and metadata in the fabric's memory reflect, the
        dies' AIVs and the invariant monitor. Every ``XCCL(fabric)`` shares it. Created on
        first use (a plain :class:`~xds.fabric.xccl.P2P`) unless a ``P2P(fabric)`` (a
        variant, say) was built before."""
        if self._p2p is None:
            from .xccl.p2p import P2P

            P2P(self)  # binds itself
        assert self._p2p is not None
        return self._p2p

    def _bind_p2p(self, protocol: P2P) -> None:
        if self._p2p is not None:
            raise ConfigError(
                f"this fabric already has its point-to-point protocol "
                f"({type(self._p2p).__name__}, fabric.p2p): the pairs' rings, metadata and "
                "sequence numbers in its memory are that protocol's, so a fabric has one; "
                "build a P2P variant before the fabric's first XCCL, or use a new UBFabric",
                field="fabric",
            )
        self._p2p = protocol

    def _enter_run(self) -> None:
        """Note the run using the fabric; the first use in a later run starts it idle (see
        the class docstring). Outside a run (a cost query) it does nothing."""
        rt = _current_run.get()
        seen = self._run
        if rt is None or (seen is not None and seen() is rt):
            return
        if seen is not None:
            self._ports.clear()
            self._links.clear()
            for mem in self._memories.values():
                for key in [k for k in mem._meta if k[2] == Direction.COLL]:
                    del mem._meta[key]  # collective groups start over
                for field in mem._meta.values():
                    field._changed = None  # an event of the earlier run's loop; none waits
            self.run_epoch += 1
            self.failures.clear()
            if self._p2p is not None:
                self._p2p._restart()
        self._run = weakref.ref(rt)

    def reserve_collective_fields(self, n: int) -> int:
        """The first of ``n`` collective metadata fields (``Direction.COLL``) no other group
        on this fabric uses: each collective group signals in its own fields, as each XCCL
        communicator has its own managed area, so one group never reads another's eventIDs."""
        base = self._collective_fields
        self._collective_fields += n
        return base

    @property
    def mode(self) -> str:
        return self.config.payload_mode

    # -- memory ------------------------------------------------------------------------------
    def memory(self, die: int) -> DieMemory:
        """Device memory of ``die`` (created on first use)."""
        if type(die) is not int:
            die = checks.die(self.pod, die, "die")
        mem = self._memories.get(die)
        if mem is None:
            checks.die(self.pod, die, "die")
            c = self.config
            mem = self._memories[die] = DieMemory(
                die,
                mode=c.payload_mode,
                app_bytes=c.app_bytes,
                ring_slots=c.ring_slots,
                slot_bytes=c.slot_bytes,
            )
        return mem

    def read_local(self, die: int, offset: int, nbytes: int) -> bytes:
        """What ``die`` currently sees in its application region (bytes mode)."""
        mem = self.memory(die)
        offset, nbytes = self._check_range(offset, nbytes, "read")
        return bytes(mem.app[offset : offset + nbytes])

    def write_local(self, die: int, offset: int, data: bytes | memoryview) -> None:
        """Write ``die``'s own application region, instantly (the engine filling a tensor)."""
        mem = self.memory(die)
        raw = checks.data_bytes(data)
        offset, _ = self._check_range(offset, raw.nbytes, "write")
        mem.app[offset : offset + raw.nbytes] = raw

    # -- ports and costs -----------------------------------------------------------------------
    def port(self, die: int, name: str, bandwidth: float) -> Port:
        self._enter_run()
        return self._port(die, name, bandwidth)

    def _port(self, die: int, name: str, bandwidth: float) -> Port:
        """:meth:`port` once this run's use of the fabric is noted (:meth:`_enter_run`)."""
        key = (die, name)
        port = self._ports.get(key)
        if port is None:
            port = self._ports[key] = Port(f"die{die}.{name}", bandwidth)
        return port

    def _link_ports(self, src: int, dst: int) -> tuple[tuple[Port, ...], float, int]:
        """(ports crossed, link bandwidth, link latency) from ``src`` to ``dst`` (remembered
        per pair of valid die indices: the pod and the ports never change)."""
        self._enter_run()
        if type(src) is not int or type(dst) is not int:  # bools and the like: checked
            return self._link_ports_of(src, dst)
        hit = self._links.get((src, dst))
        if hit is None:
            hit = self._links[(src, dst)] = self._link_ports_of(src, dst)
        return hit

    def _mte_worker(self, die: int) -> tuple[int, float]:
        """(largest MTE operation in bytes, ``b_aiv``) of one AIV of ``die``: remembered per
        valid die index, since they depend on the die's spec and the engine costs alone (the
        pod never changes; a later run does not touch them). Other index types (numpy
        integers, bools) are checked every time, as :meth:`_link_ports` does."""
        cacheable = type(die) is int
        hit = self._workers.get(die) if cacheable else None
        if hit is None:
            worker = self.pod.spec_of(die)
            hit = (worker.mte_max_bytes, aiv_mte_bandwidth(self.engines, worker))
            if cacheable:
                self._workers[die] = hit
        return hit

    def _link_ports_of(self, src: int, dst: int) -> tuple[tuple[Port, ...], float, int]:
        """What :meth:`_link_ports` remembers (it has noted the run)."""
        net = self.pod.network_between(src, dst)
        if net is Network.LOCAL:
            hbm = self.pod.spec_of(src).hbm_bandwidth
            return (self._port(src, "hbm", hbm),), hbm, 0
        link = self._link_specs.get(net)
        if link is None:  # the pod's link table, looked up once per network
            link = self._link_specs[net] = self.pod.link(net)
        out_name, in_name = _PORT_NAMES[net]
        ports = (
            self._port(src, out_name, link.bandwidth),
            self._port(dst, in_name, link.bandwidth),
        )
        return ports, link.bandwidth, link.latency_ns

    def mte_transfer(
        self,
        src: int,
        dst: int,
        nbytes: int,
        *,
        start_ns: int,
        aivs: int = 1,
        op_bytes: int | None = None,
        fill: bool = True,
        aiv_die: int | None = None,
        efficiency: float = 1.0,
        now_ns: int | None = None,
    ) -> Transfer:
        """Cost of moving ``nbytes`` from ``src`` to ``dst`` with ``aivs`` AIVs' MTE2/MTE3.

        The ``aivs`` AIVs split the bytes evenly, each moving its share in operations of at
        most ``op_bytes`` (default: the fabric's MTE chunk, and no smaller than its minimum
        chunk, so a small transfer uses fewer AIVs rather than tinier operations). ``fill``
        marks the first operation of a pipeline: it pays the MTE start-up and one AIV's
        exposed MTE2 load of its first operation; later operations of the same AIV overlap
        both with the previous store (ping-pong). The ports are reserved: call this when the
        transfer is issued.
        ``aiv_die`` is the die whose AIVs do the work (default ``src``; a pull uses the
        reader's). ``efficiency`` scales the link bandwidth of a remote transfer (collective
        congestion, :func:`xds.hw.collective_efficiency`). ``now_ns`` is the current time
        when the transfer is planned ahead (default: ``start_ns``).
        """
        e = self.engines
        op = min(nbytes, op_bytes or self.config.mte_chunk_bytes)
        if op_bytes is None and aivs > 1:  # each AIV's first operation is its share at most
            share = -(-nbytes // aivs)
            op = min(op, max(self.config.min_chunk_bytes, -(-share // 32) * 32))
        if op and aivs > 1:  # AIVs beyond one operation's worth of bytes each do not speed
            # it up (counted as a fraction: cost rises with bytes); one AIV is never capped
            aivs = min(aivs, max(1.0, nbytes / op))
        limit, b_aiv = self._mte_worker(src if aiv_die is None else aiv_die)
        if op > limit:
            raise ProtocolError(
                f"an MTE operation moves at most half a UBuf ({limit} bytes), got {op}"
            )
        ports, link_bw, latency = self._link_ports(src, dst)
        now = start_ns if now_ns is None else now_ns
        begin = start_ns + (e.mte_startup_ns + op * 1e9 / b_aiv if fill else 0.0)
        if src == dst:  # a local copy reads and writes the same HBM
            rate = min(aivs * b_aiv, link_bw)
            end = finish_ns(begin, 2 * nbytes, 2 * rate, ports, now_ns=now)
            self.stats.local_ops += 1
            self.stats.local_bytes += nbytes
        else:
            rate = min(aivs * b_aiv, link_bw * efficiency)
            end = finish_ns(begin, nbytes, rate, ports, now_ns=now, efficiency=efficiency)
            self.stats.remote_ops += 1
            self.stats.remote_bytes += nbytes
        return Transfer(start_ns, end, end + latency)

    def dma_transfer(self, src: int, dst: int, nbytes: int, *, start_ns: int) -> Transfer:
        """Cost of a DMA/URMA copy of ``nbytes``: higher start-up, link rate, no UBuf."""
        ports, link_bw, latency = self._link_ports(src, dst)
        end = finish_ns(
            start_ns + self.engines.dma_startup_ns, nbytes, link_bw, ports, now_ns=start_ns
        )
        if src == dst:
            self.stats.local_ops += 1
            self.stats.local_bytes += nbytes
        else:
            self.stats.remote_ops += 1
            self.stats.remote_bytes += nbytes
        return Transfer(start_ns, end, end + latency)

    def transfer(
        self, src: int, dst: int, nbytes: int, *, engine: Engine, start_ns: int, aivs: int = 1
    ) -> Transfer:
        if engine == "mte":
            return self.mte_transfer(src, dst, nbytes, start_ns=start_ns, aivs=aivs)
        if engine == "dma":
            return self.dma_transfer(src, dst, nbytes, start_ns=start_ns)
        raise ConfigError(f"unknown engine {engine!r}; choose one of {ENGINES}", field="engine")

    # -- posted effects ------------------------------------------------------------------------
    def post(self, when_ns: int, callback: Callable[..., object], *args: Any) -> Any:
        """Apply ``callback(*args)`` at virtual time ``when_ns`` (a posted write's visibility)."""
        self._enter_run()
        return current_runtime().call_at_ns(when_ns, callback, *args)

    def meta_visible_ns(self, writer: int, owner: int, issued_ns: int) -> int:
        """When a metadata write issued by ``writer`` at ``issued_ns`` is visible at ``owner``:
        one metadata write (t_meta), and never before the link's one-way latency."""
        latency = 0 if writer == owner else self.pod.link_between(writer, owner).latency_ns
        return issued_ns + max(self.engines.meta_write_ns, latency)

    def meta_delay_ns(self, dies: list[int]) -> np.ndarray:
        """``[s, d]``: ``meta_visible_ns(dies[s], dies[d], t) - t``, read-only (a function of
        the pod and the engine costs alone: remembered per both and the die list)."""
        key = (self.pod.config, self.engines, tuple(dies))
        hit = _META_DELAY.get(key)
        if hit is None:
            if len(_META_DELAY) >= 64:
                _META_DELAY.clear()
            hit = np.array(
                [[self.meta_visible_ns(w, o, 0) for o in dies] for w in dies], dtype=np.int64
            )
            hit.flags.writeable = False
            _META_DELAY[key] = hit
        return hit

    def post_meta(
        self,
        when_ns: int,
        owner: int,
        peer: int,
        aiv: int,
        direction: Direction,
        *,
        issued_by: tuple[int, int] | None = None,
        **fields: int,
    ) -> None:
        """A metadata write into ``owner``'s field (``peer``, ``aiv``, ``direction``), visible
        at ``when_ns``. ``issued_by=(die, t_ns)``: the die that issues it and when; if that
        die has failed at or before ``t_ns`` (even later in the same instant, fail-stop), the
        write never lands."""
        field = self.memory(owner).meta(peer, aiv, direction)
        self.stats.meta_writes += 1
        if issued_by is None:
            self.post(when_ns, _apply_meta, field, fields)
        else:
            self.post(when_ns, self._apply_meta_unless_failed, field, fields, *issued_by)

    def _apply_meta_unless_failed(
        self, field: MetaField, fields: dict[str, int], writer: int, issued_ns: int
    ) -> None:
        if not self.failures.failed_by(writer, issued_ns):
            _apply_meta(field, fields)

    # -- the user-level remote access API --------------------------------------------------------
    def post_write(
        self,
        src: int,
        dst: int,
        offset: int,
        data: bytes | memoryview | int,
        *,
        engine: Engine = "mte",
        aivs: int = 1,
    ) -> Transfer:
        """Issue a write of ``data`` (bytes, or a byte count in size mode) into ``dst``'s
        application region at ``offset``; it becomes visible at the returned ``visible_ns``."""
        src = checks.die(self.pod, src, "src")
        dst = checks.die(self.pod, dst, "dst")
        nbytes, payload = self._payload(data)
        offset, _ = self._check_range(offset, nbytes, "write")
        engine = checks.engine(engine)  # type: ignore[assignment]
        aivs = self._check_aivs(src, aivs, field="aivs")
        self._enter_run()
        t = self.transfer(
            src, dst, nbytes, engine=engine, start_ns=current_runtime().now_ns(), aivs=aivs
        )
        if payload is not None:
            self.post(t.visible_ns, _apply_app, self.memory(dst), offset, bytes(payload))
        return t

    async def write(
        self,
        src: int,
        dst: int,
        offset: int,
        data: bytes | memoryview | int,
        *,
        engine: Engine = "mte",
        aivs: int = 1,
    ) -> Transfer:
        """Write remote memory and return once the write is visible at ``dst``."""
        t = self.post_write(src, dst, offset, data, engine=engine, aivs=aivs)
        await sleep_until_ns(t.visible_ns)
        return t

    async def read(
        self,
        reader: int,
        owner: int,
        offset: int,
        nbytes: int,
        *,
        engine: Engine = "mte",
        aivs: int = 1,
    ) -> bytes | int:
        """Read ``owner``'s application region from ``reader``. The bytes are those visible at
        ``owner`` when the request arrives (one link latency after issue); they reach the reader
        after the transfer. Returns the byte count in size mode."""
        reader = checks.die(self.pod, reader, "reader")
        owner = checks.die(self.pod, owner, "owner")
        offset, nbytes = self._check_range(offset, nbytes, "read")
        engine = checks.engine(engine)  # type: ignore[assignment]
        aivs = self._check_aivs(reader, aivs, field="aivs")
        self._enter_run()
        now = current_runtime().now_ns()
        _, _, latency = self._link_ports(reader, owner)
        snapshot: list[bytes] = []
        arrive = now + latency
        if self.mode == "bytes":
            mem = self.memory(owner)
            self.post(arrive, lambda: snapshot.append(bytes(mem.app[offset : offset + nbytes])))
        if engine == "mte":
            t = self.mte_transfer(owner, reader, nbytes, start_ns=arrive, aivs=aivs, aiv_die=reader)
        else:
            t = self.transfer(owner, reader, nbytes, engine=engine, start_ns=arrive)
        await sleep_until_ns(t.visible_ns)
        return snapshot[0] if self.mode == "bytes" else nbytes

    # -- checks --------------------------------------------------------------------------------
    def _payload(self, data: bytes | memoryview | int) -> tuple[int, memoryview | None]:
        """(byte count, the bytes to write in bytes mode) of a write's ``data``."""
        if checks.is_integer(data):
            if self.mode == "bytes":
                raise ConfigError(
                    "bytes payload mode needs real data, got a byte count", field="data"
                )
            return checks.integer(data, "data"), None
        raw = checks.data_bytes(data)
        return raw.nbytes, raw if self.mode == "bytes" else None

    def _check_range(
        self, offset: object, nbytes: object, what: str, *, fields: tuple[str, str] | None = None
    ) -> tuple[int, int]:
        """(offset, nbytes) of a range of the application region; ``fields`` names the two
        arguments (default ``offset``, ``nbytes``)."""
        return checks.byte_range(
            offset,
            nbytes,
            self.config.app_bytes,
            fields=fields or ("offset", "nbytes"),
            what=what,
        )

    def _check_aivs(self, die: int, aivs: object, *, field: str = "n_aiv") -> int:
        """A number of AIVs of ``die``, named ``field`` in the error."""
        return checks.aiv_count(self.pod, die, aivs, field)


def _apply_meta(field: MetaField, fields: dict[str, int]) -> None:
    for name, value in fields.items():
        setattr(field, name, value)
    field.notify()


def _apply_app(mem: DieMemory, offset: int, data: bytes) -> None:
    mem.app[offset : offset + len(data)] = data
