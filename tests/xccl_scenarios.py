"""Random XCCL point-to-point scenarios and their checks (used by the property tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import numpy as np
from hypothesis import strategies as st

import xds
from xds.fabric import UBFabric
from xds.fabric.memory import Direction
from xds.fabric.xccl import P2P, XCCL, AppBuffer
from xds.fabric.xccl.p2p import Transfer, _Pair
from xds.hw import CloudMatrix384
from xds.units import KiB

POD = CloudMatrix384(servers=2)  # 32 dies on two servers
DIES = (0, 1, 5, 16, 17, 30)  # same chip (NoC), same server, other server


@dataclass(frozen=True)
class Msg:
    src: int
    dst: int
    nbytes: int
    n_aiv: int
    engine: str
    send_delay_ns: int
    recv_delay_ns: int


@dataclass(frozen=True)
class Scenario:
    ring_slots: int
    slot_bytes: int
    messages: tuple[Msg, ...]
    jitter_ns: int  # random extra delay inside protocol lanes (0 = none)


@dataclass
class Outcome:
    problems: list[str] = field(default_factory=list)
    send_done_ns: dict[int, int] = field(default_factory=dict)
    recv_done_ns: dict[int, int] = field(default_factory=dict)
    end_ns: int = 0
    max_occupied: dict[tuple[int, int], int] = field(default_factory=dict)


@st.composite
def messages(draw: st.DrawFn, max_messages: int = 10, max_bytes: int = 48 * KiB) -> Msg:
    src = draw(st.sampled_from(DIES))
    dst = draw(st.sampled_from([d for d in DIES if d != src]))
    return Msg(
        src,
        dst,
        nbytes=draw(st.integers(0, max_bytes)),
        n_aiv=draw(st.integers(1, 6)),
        engine=draw(st.sampled_from(["mte", "mte", "dma"])),
        send_delay_ns=draw(st.integers(0, 20_000)),
        recv_delay_ns=draw(st.integers(0, 20_000)),
    )


def scenarios(max_messages: int = 10, max_bytes: int = 48 * KiB) -> st.SearchStrategy[Scenario]:
    return st.builds(
        Scenario,
        ring_slots=st.sampled_from([1, 2, 3, 4, 8]),
        slot_bytes=st.sampled_from([1 * KiB, 2 * KiB, 4 * KiB]),
        messages=st.lists(messages(max_messages, max_bytes), min_size=1, max_size=max_messages).map(
            tuple
        ),
        jitter_ns=st.sampled_from([0, 0, 500, 3_000]),
    )


class Jittery(P2P):
    """The correct protocol with random extra delays inside its lanes."""

    jitter_ns = 0

    async def delay(self, side: str, pair: _Pair, lane: int) -> None:
        if self.jitter_ns:
            await xds.sleep_ns(int(xds.rng(f"jitter/{side}").integers(0, self.jitter_ns + 1)))


class EarlyTail(Jittery):
    """Mutant: publishes tailPtr when the store is issued, before the data is visible (R1)."""

    def tail_visible_ns(self, t: Transfer) -> int:
        return t.start_ns + self.fabric.engines.meta_write_ns


class EarlyAck(Jittery):
    """Mutant: ACKs a chunk (returns its credit) before copying it out (R2)."""

    def before_copy_out(self, pair: _Pair, lane: int, consumed: int) -> None:
        self.fabric.post_meta(xds.now_ns(), pair.src, pair.dst, lane, Direction.TX, ack=consumed)

    def after_copy_out(self, pair: _Pair, lane: int, consumed: int, t: Transfer) -> None:
        pass


def _leaves(exc: BaseException) -> list[str]:
    if isinstance(exc, BaseExceptionGroup):
        return [text for sub in exc.exceptions for text in _leaves(sub)]
    return [f"{type(exc).__name__}: {exc}"]


def run_scenario(
    sc: Scenario,
    *,
    mode: str = "bytes",
    protocol: type[P2P] = Jittery,
    backend: str = "asyncio",
    seed: int = 0,
) -> Outcome:
    out = Outcome()
    # Each message gets its own source and destination range.
    offsets: list[tuple[int, int]] = []
    used: dict[int, int] = {}
    for m in sc.messages:
        src_off = used.get(m.src, 0)
        used[m.src] = src_off + m.nbytes
        dst_off = used.get(m.dst, 0)
        used[m.dst] = dst_off + m.nbytes
        offsets.append((src_off, dst_off))
    app_bytes = max(max(used.values(), default=0), 32)
    payload_rng = np.random.default_rng(seed)
    payloads = [payload_rng.bytes(m.nbytes) for m in sc.messages]

    async def main() -> None:
        fabric = UBFabric(
            POD,
            payload_mode=mode,
            app_bytes=-(-app_bytes // 32) * 32,
            ring_slots=sc.ring_slots,
            slot_bytes=sc.slot_bytes,
            min_chunk_bytes=512,
        )
        p2p = protocol(fabric)
        p2p.jitter_ns = sc.jitter_ns  # type: ignore[attr-defined]
        if mode == "bytes":
            for m, (src_off, _), data in zip(sc.messages, offsets, payloads, strict=True):
                fabric.write_local(m.src, src_off, data)
        by_pair: dict[tuple[int, int], list[int]] = {}
        for i, m in enumerate(sc.messages):
            by_pair.setdefault((m.src, m.dst), []).append(i)

        async with XCCL(fabric, protocol=p2p) as x:

            async def sender(indices: list[int]) -> None:
                for i in indices:
                    m = sc.messages[i]
                    await xds.sleep_ns(m.send_delay_ns)
                    out.send_done_ns[i] = await x.send(
                        m.src,
                        m.dst,
                        AppBuffer(offsets[i][0], m.nbytes),
                        1000 + i,
                        n_aiv=m.n_aiv,
                        engine=m.engine,
                    )

            async def receiver(indices: list[int]) -> None:
                for i in indices:
                    m = sc.messages[i]
                    await xds.sleep_ns(m.recv_delay_ns)
                    out.recv_done_ns[i] = await x.receive(
                        m.dst,
                        m.src,
                        AppBuffer(offsets[i][1], m.nbytes),
                        1000 + i,
                        n_aiv=m.n_aiv,
                        engine=m.engine,
                    )

            with anyio.fail_after(5):  # virtual seconds: far beyond any scenario
                async with anyio.create_task_group() as tg:
                    for indices in by_pair.values():
                        tg.start_soon(sender, indices)
                        tg.start_soon(receiver, indices)
        out.problems.extend(p2p.monitor.violations)
        out.max_occupied = dict(p2p.monitor.max_occupied)
        if mode == "bytes":
            for i, m in enumerate(sc.messages):
                got = fabric.read_local(m.dst, offsets[i][1], m.nbytes)
                if got != payloads[i]:
                    out.problems.append(f"message {i} arrived corrupted")
        out.end_ns = xds.now_ns()

    try:
        xds.run(main, backend=backend, seed=seed)
    except BaseException as exc:  # every failure is a finding
        out.problems.extend(_leaves(exc))
    received = sorted(out.recv_done_ns)
    if not out.problems and received != list(range(len(sc.messages))):
        out.problems.append(f"received {received}, expected every message exactly once")
    return out
