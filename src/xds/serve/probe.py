"""Link probing of the PD KV-transfer path (SPEC 11.1, P116; 11.3 "Link probing").

Heartbeats cannot see faults outside the DP masters' loops, such as a stalled KV transfer,
which is more often Decode saturation than a broken link. A probe injects a dummy payload into
a DistFlow pair's FIFO (:meth:`xds.serve.distflow.DistFlow.probe`) and classifies what happens
within ``timeout_ns``:

========================  ===============================================  ==============
condition                 probe outcome                                    verdict
========================  ===============================================  ==============
healthy                   delivered within ``healthy_ns``                  HEALTHY
Decode saturated          delayed behind deferred RECVs, still queued or   SATURATED
                          delivered late
link down                 on the wire (nothing ahead of it) but not        LINK_FAILURE
                          delivered, and no transfer completed either
========================  ===============================================  ==============

A probe still queued at the timeout means the Decode side has not posted the RECVs ahead of it:
saturation, whatever the link does. :class:`LinkMonitor` probes every pair of a replay
periodically and keeps the verdicts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Annotated

import anyio
import msgspec
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..runtime import emit, now_ns, sleep_ns
from ..units import MS, US
from .distflow import DistFlow, ProbeState, TransferState


class LinkVerdict(enum.Enum):
    HEALTHY = "healthy"
    SATURATED = "saturated"
    LINK_FAILURE = "link_failure"


class ProbeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Probe timing ([emulator choice]: the paper gives none)."""

    timeout_ns: Annotated[int, Meta(gt=0)] = 100 * MS
    healthy_ns: Annotated[int, Meta(gt=0)] = 200 * US
    """Delivery within this is normal latency (a 64-byte DMA: start-up plus link latency)."""
    period_ns: Annotated[int, Meta(gt=0)] = 1_000 * MS
    """How often :class:`LinkMonitor` probes each pair."""
    nbytes: Annotated[int, Meta(ge=1)] = 64

    def __post_init__(self) -> None:
        check_fields(self)


class ProbeResult(msgspec.Struct, frozen=True, kw_only=True):
    pair: str
    sent_ns: int
    verdict: LinkVerdict
    latency_ns: int
    """Until delivery; -1 if not delivered before the timeout."""
    queued_ns: int
    """Spent behind transfers still waiting for their RECV (-1: still queued at the timeout)."""


async def probe(
    flow: DistFlow, config: ProbeConfig | None = None, *, decode_dp: int = 0
) -> ProbeResult:
    """Probe one DistFlow pair and classify the outcome (table above)."""
    cfg = config or ProbeConfig()
    state = ProbeState()
    completed = _completed(flow)
    with anyio.move_on_after(cfg.timeout_ns / 1e9):
        await flow.probe(state, decode_dp=decode_dp, nbytes=cfg.nbytes)
    if state.delivered_ns >= 0:
        latency = state.delivered_ns - state.sent_ns
        verdict = LinkVerdict.HEALTHY if latency <= cfg.healthy_ns else LinkVerdict.SATURATED
    elif state.on_wire_ns < 0:
        latency, verdict = -1, LinkVerdict.SATURATED  # still behind deferred RECVs
    else:
        moved = _completed(flow) > completed
        latency = -1
        verdict = LinkVerdict.SATURATED if moved else LinkVerdict.LINK_FAILURE
    result = ProbeResult(
        pair=flow.pair,
        sent_ns=state.sent_ns,
        verdict=verdict,
        latency_ns=latency,
        queued_ns=state.on_wire_ns - state.sent_ns if state.on_wire_ns >= 0 else -1,
    )
    emit("link-probe", verdict.value, pair=flow.pair, latency_ns=latency)
    return result


def _completed(flow: DistFlow) -> int:
    return sum(t.state is TransferState.COMPLETED for t in flow.transfers.values())


class LinkMonitor:
    """Probes DistFlow pairs every ``period_ns`` and keeps every result (run it as a task;
    cancel it when done). Pairs already out of service are not probed; ``on_result`` sees
    each result as it comes (the replay takes a LINK_FAILURE pair out of service)."""

    def __init__(
        self,
        flows: list[DistFlow],
        config: ProbeConfig | None = None,
        *,
        on_result: Callable[[DistFlow, ProbeResult], None] | None = None,
    ):
        self.flows = flows
        self.config = config or ProbeConfig()
        self.results: list[ProbeResult] = []
        self._on_result = on_result

    async def run(self) -> None:
        while True:
            start = now_ns()
            async with anyio.create_task_group() as tg:
                for flow in self.flows:
                    if not flow.failed:
                        tg.start_soon(self._one, flow)
            await sleep_ns(max(0, start + self.config.period_ns - now_ns()))

    async def _one(self, flow: DistFlow) -> None:
        result = await probe(flow, self.config)
        self.results.append(result)
        if self._on_result is not None:
            self._on_result(flow, result)


document_fields(ProbeConfig)
