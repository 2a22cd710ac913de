"""The multi-level heartbeat (SPEC 11.1, P115; 11.3 "Heartbeat").

The control plane pings the TE-shell every ``control_period_ns``; the TE-shell pings every DP
master every ``dp_period_ns``. A DP master answers pings only from its own single-threaded
loop, between the steps where it waits for its executor (:mod:`.engine`), so an executor that
hangs or crashes before replying leaves the pings unanswered, and so does a healthy iteration
longer than the timeout (the false positive the paper accepts). A ping unanswered for
``timeout_ns`` marks the DP unhealthy at that instant: within ``dp_period_ns + timeout_ns`` of
the fault. The control plane learns it at its next ping of the TE-shell and acts
(:data:`~.config.Unhealthy`).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ...runtime import emit, now_ns, sleep_ns, sleep_until_ns
from ...runtime.sync import Streams
from .config import HeartbeatConfig


class Ping(msgspec.Struct, frozen=True):
    seq: int
    sent_ns: int


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The TE-shell marked a DP unhealthy."""

    dp: int
    ping_ns: int
    """When the unanswered ping was sent."""
    marked_ns: int
    seen_by_control_plane_ns: int = -1
    fault_injected: bool
    """Whether an injected hang or crash had stopped this DP's executor when it was marked
    (False: a false positive, or a DP stalled behind another's fault at a global barrier)."""


class TEShellHeartbeat:
    """The TE-shell's side: one ping stream per DP master, and the health map."""

    def __init__(self, config: HeartbeatConfig, dps: int, faulty: Callable[[int], bool]):
        self.config = config
        self.dps = dps
        self._faulty = faulty
        self.streams = Streams()
        """The ping streams (the engine closes them when its run ends)."""
        streams = [self.streams.create(Ping, float("inf")) for _ in range(dps)]
        self._to_dp: list[MemoryObjectSendStream[Ping]] = [s for s, _ in streams]
        self.inbox: list[MemoryObjectReceiveStream[Ping]] = [r for _, r in streams]
        """Per DP master: the pings waiting for its loop."""
        self._answered = [0] * dps
        self._answer = [anyio.Event() for _ in range(dps)]
        self.verdicts: list[Verdict] = []
        self.unhealthy: set[int] = set()
        """DPs marked unhealthy that have not answered since."""
        self._scopes: dict[int, anyio.CancelScope] = {}

    def pong(self, dp: int, ping: Ping) -> None:
        """A DP master's reply (called from the master's own loop)."""
        self._answered[dp] = max(self._answered[dp], ping.seq)
        self._answer[dp].set()

    def serve(self, dp: int) -> int:
        """Answer every ping waiting for DP ``dp``'s master; returns how many."""
        n = 0
        while True:
            try:
                ping = self.inbox[dp].receive_nowait()
            except anyio.WouldBlock:
                return n
            self.pong(dp, ping)
            n += 1

    async def watch(self, dp: int) -> None:
        """Ping DP ``dp`` every period. A ping unanswered for the timeout marks it unhealthy;
        the answer, if it ever comes, marks it healthy again (e.g. a DP that was stalled
        behind another's fault). Cancelled when the DP is removed."""
        with anyio.CancelScope() as scope:
            self._scopes[dp] = scope
            await self._watch(dp)

    def retire(self, dp: int) -> None:
        """Stop watching a removed DP."""
        if dp in self._scopes:
            self._scopes[dp].cancel()
        self.unhealthy.discard(dp)

    async def _watch(self, dp: int) -> None:
        cfg = self.config
        seq = 0
        while True:
            seq += 1
            sent = now_ns()
            self._to_dp[dp].send_nowait(Ping(seq, sent))
            with anyio.move_on_after(cfg.timeout_ns / 1e9):
                await self._answered_to(dp, seq)
            if self._answered[dp] < seq:
                v = Verdict(
                    dp=dp, ping_ns=sent, marked_ns=now_ns(), fault_injected=self._faulty(dp)
                )
                self.verdicts.append(v)
                self.unhealthy.add(dp)
                emit("te-shell", "dp-unhealthy", dp=dp, ping_ns=sent, fault=v.fault_injected)
                await self._answered_to(dp, seq)
                self.unhealthy.discard(dp)
                emit("te-shell", "dp-recovered", dp=dp)
            await sleep_until_ns(max(now_ns(), sent + cfg.dp_period_ns))

    async def _answered_to(self, dp: int, seq: int) -> None:
        while self._answered[dp] < seq:
            self._answer[dp] = anyio.Event()
            await self._answer[dp].wait()


async def control_plane(
    config: HeartbeatConfig, shell: TEShellHeartbeat, act: Callable[[list[Verdict]], None]
) -> None:
    """Ping the TE-shell every period; hand the verdicts marked since the last ping to
    ``act``, in (time, DP) order. A verdict marked at the very instant of a ping waits for the
    next one, so same-instant ordering never decides what the control plane sees."""
    seen: set[int] = set()
    while True:
        await sleep_ns(config.control_period_ns)
        now = now_ns()
        new = sorted(
            (v.marked_ns, v.dp, i)
            for i, v in enumerate(shell.verdicts)
            if i not in seen and v.marked_ns < now
        )
        if not new:
            continue
        for _, dp, i in new:
            seen.add(i)
            shell.verdicts[i] = msgspec.structs.replace(
                shell.verdicts[i], seen_by_control_plane_ns=now
            )
            emit("control-plane", "unhealthy", dp=dp)
        act([shell.verdicts[i] for _, _, i in new])
