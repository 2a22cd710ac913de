"""A KV-transfer protocol of your own in a PD replay (``replay(..., kv_mover=...)``)."""

from __future__ import annotations

import functools

import anyio
import msgspec
import numpy as np
import pytest

import xds
from xds.errors import ConfigError, ProtocolError
from xds.serve.decode import DecodeConfig
from xds.serve.distflow import KVMove
from xds.serve.jitter import JitterConfig
from xds.serve.prefill import PrefillConfig
from xds.serve.replay import PDConfig, replay
from xds.trace import Request, Workload
from xds.units import MS, US

SMALL = PDConfig(
    prefill=PrefillConfig(tes=2, long_pool_tes=0),
    decode=DecodeConfig(
        dies=32, batch_per_die=4, shared_expert_dies=4, jitter=JitterConfig(enabled=False)
    ),
)
WL = Workload(tuple(Request(i, i * 50 * MS, 2500 + 500 * (i % 3), 12) for i in range(6)))


async def same_as_closed_form(move: KVMove) -> None:
    await xds.sleep_until_ns(move.book(move.part_bytes))


async def compress_then_send(move: KVMove) -> None:
    """A made-up protocol: 30 us to compress the KV 2:1, then half the bytes on the link."""
    await xds.sleep_ns(30 * US)
    await xds.sleep_until_ns(move.book([b / 2 for b in move.part_bytes]))


def test_a_mover_like_the_built_in_closed_form_gives_its_transfer_times():
    base = replay(WL, SMALL).records
    mine = replay(WL, SMALL, kv_mover=same_as_closed_form).records
    for a, b in zip(base, mine, strict=True):
        assert b.outcome == "completed" and b.decode_placement == a.decode_placement
        assert abs(b.kv_transfer_ns - a.kv_transfer_ns) <= 2  # whole-byte rank parts


def test_a_compressing_protocol_moves_half_the_bytes_and_pays_its_compute():
    base = replay(WL, SMALL).records
    mine = replay(WL, SMALL, kv_mover=compress_then_send).records
    for a, b in zip(base, mine, strict=True):
        assert b.outcome == "completed"
        assert 30 * US < b.kv_transfer_ns < a.kv_transfer_ns  # faster than sending it all
        assert b.kv_transfer_ns < 0.6 * a.kv_transfer_ns + 30 * US


def test_a_chunked_protocol_on_the_xccl_tier_matches_one_message_per_rank():
    xccl = msgspec.structs.replace(SMALL, kv_transfer="xccl")

    async def two_chunks(move: KVMove) -> None:  # each rank's part as two messages in a row
        async def rank(r: int) -> None:
            half = np.int64(move.part_bytes[r]) // 2  # numpy sizes are fine
            await move.send(r, half, 2 * move.transfer.transfer_id + 1)
            await move.send(r, move.part_bytes[r] - half, 2 * move.transfer.transfer_id + 2)

        async with anyio.create_task_group() as tg:
            for r in range(len(move.sources)):
                tg.start_soon(rank, r)

    short = Workload(
        tuple(msgspec.structs.replace(r, input_tokens=r.input_tokens // 5) for r in WL.requests)
    )
    base = replay(short, xccl).records  # (every slot of the KV is an event on this tier)
    mine = replay(short, xccl, kv_mover=two_chunks).records
    for a, b in zip(base, mine, strict=True):
        assert b.outcome == "completed"
        assert 1.0 <= b.kv_transfer_ns / a.kv_transfer_ns < 1.1  # a second message's set-up


def test_on_the_xccl_tier_book_is_refused_since_the_fabric_carries_the_bytes():
    with pytest.raises(ConfigError, match=r"book\(\) is the closed-form tier's"):
        replay(WL, msgspec.structs.replace(SMALL, kv_transfer="xccl"), kv_mover=same_as_closed_form)


def test_a_mover_is_deterministic_and_checked():
    a = replay(WL, SMALL, kv_mover=compress_then_send, event_log=True)
    b = replay(WL, SMALL, kv_mover=compress_then_send, event_log=True)
    assert msgspec.json.encode(a.records) == msgspec.json.encode(b.records)
    assert a.events.digest() == b.events.digest()
    with pytest.raises(ConfigError, match="kv_mover"):
        replay(WL, SMALL, kv_mover="fast")  # type: ignore[arg-type]

    async def bad_book(move: KVMove) -> None:
        move.book([1.0])  # one size for a TP-4 transfer

    with pytest.raises(ConfigError, match="one non-negative size per TP rank"):
        replay(WL, SMALL, kv_mover=bad_book)

    async def send_without_fabric(move: KVMove) -> None:
        assert move.tier == "closed-form" and move.xccl is None
        await move.send(0, 10, 1)

    async def every_rank_at_once(move: KVMove) -> None:  # each rank's send fails alike
        async with anyio.create_task_group() as tg:
            for rank, nbytes in enumerate(move.part_bytes):
                tg.start_soon(move.send, rank, nbytes, 1)

    for mover in (send_without_fabric, every_rank_at_once):
        with pytest.raises(ConfigError, match="send\\(\\) is the xccl tier's") as err:
            replay(WL, SMALL, kv_mover=mover)
        assert not isinstance(err.value, BaseExceptionGroup)  # once, not once per rank
        assert f"raised by the kv_mover '{mover.__name__}'" in err.value.__notes__[0]


def test_a_mover_that_is_not_async_or_returns_early_or_tags_badly_is_one_clear_error():
    def not_async(move: KVMove) -> None:
        move.book(move.part_bytes)

    nothing_moves = Workload((Request(0, 0, 100, 1),))  # one output token: no KV transfer
    with pytest.raises(ConfigError, match="kv_mover 'not_async' is a plain function"):
        replay(nothing_moves, SMALL, kv_mover=not_async)  # refused up front, not at a move

    class NotAsync:  # a callable object shows it at its first move
        def __call__(self, move):
            move.book(move.part_bytes)

    with pytest.raises(ConfigError, match="returned NoneType, not an awaitable"):
        replay(WL, SMALL, kv_mover=NotAsync())  # type: ignore[arg-type]

    async def three(move, pair, extra):  # refused when the replay is built, before any move
        await xds.sleep_ns(1)

    for mover in (three, lambda: None):
        with pytest.raises(ConfigError, match=r"must take one argument, the KVMove") as err:
            replay(nothing_moves, SMALL, kv_mover=mover)  # type: ignore[arg-type]
        assert err.value.field == "kv_mover"

    def with_context(fn):  # a decorator that supplies the first argument
        @functools.wraps(fn)
        async def mover(move):
            await fn("ctx", move)

        return mover

    @with_context
    async def decorated(ctx, move):
        await xds.sleep_until_ns(move.book(move.part_bytes))

    assert replay(WL, SMALL, kv_mover=decorated).summary.completed == len(WL)

    async def forgets_to_wait(move: KVMove) -> None:
        move.book(move.part_bytes)

    with pytest.raises(ConfigError, match="before the parts it booked land") as err:
        replay(WL, SMALL, kv_mover=forgets_to_wait)
    assert err.value.field == "kv_mover"

    async def event_zero(move: KVMove) -> None:
        await move.send(0, move.part_bytes[0], 0)

    with pytest.raises(
        ConfigError, match=r"send\(\) takes an eventID in 1..2\*\*64-1, got 0"
    ) as err:
        replay(WL, msgspec.structs.replace(SMALL, kv_transfer="xccl"), kv_mover=event_zero)
    assert err.value.field == "event"

    for rank in (0.5, "0", -1, 99):

        async def bad_rank(move: KVMove, rank=rank) -> None:
            await move.send(rank, move.part_bytes[0], 1)

        with pytest.raises(ConfigError, match=r"^rank: send\(\): must be an integer") as err:
            replay(WL, msgspec.structs.replace(SMALL, kv_transfer="xccl"), kv_mover=bad_rank)


def test_an_error_inside_a_mover_names_the_mover_and_the_transfer():
    async def explodes(move: KVMove) -> None:
        raise RuntimeError("mover exploded")

    async def explodes_in_a_task(move: KVMove) -> None:  # the same, from its own task group
        async def part() -> None:
            raise RuntimeError("mover exploded")

        async with anyio.create_task_group() as tg:
            tg.start_soon(part)

    for mover in (explodes, explodes_in_a_task):
        with pytest.raises(RuntimeError, match="mover exploded") as err:
            replay(WL, SMALL, kv_mover=mover)
        (note,) = err.value.__notes__
        assert note.startswith(f"(raised by the kv_mover '{mover.__name__}' moving transfer ")
        assert "of request 0 to decode DP" in note


def test_a_link_going_down_mid_move_interrupts_the_mover_and_it_runs_again_after():
    from xds.serve.replay import DistFlowFault

    calls = [0]

    async def slow_mover(move: KVMove) -> None:  # 200x the bytes: a move of several ms
        calls[0] += 1
        await xds.sleep_until_ns(move.book([b * 200 for b in move.part_bytes]))

    async def shielded_mover(move: KVMove) -> None:  # the same, deaf to the link going down
        with anyio.CancelScope(shield=True):
            await slow_mover(move)

    one = Workload((Request(0, 0, 3000, 12),))
    base = replay(one, SMALL, kv_mover=slow_mover, event_log=True)
    (recv,) = base.events.select("distflow", "recv")
    took = base.records[0].kv_transfer_ns
    pair = recv.fields["pair"]  # "P<k>-D0"
    cut = DistFlowFault(
        at_ns=recv.t_ns + took // 2,
        prefill_te=int(pair[1 : pair.index("-")]),
        kind="link_down",
        duration_ns=50 * MS,
    )
    # half a move, the outage, then a whole fresh move (its bookings were given back); a
    # mover that went on across the downed link moved nothing that counts: once it returns
    # (after the link is back) it runs again
    for mover, expected in ((slow_mover, took // 2 + 50 * MS + took), (shielded_mover, 2 * took)):
        calls[0] = 0
        res = replay(one, SMALL, kv_mover=mover, faults=[cut], event_log=True)
        rec = res.records[0]
        assert rec.outcome == "completed"
        assert len(res.events.select("distflow", "move-interrupted")) == 1 and calls[0] == 2
        assert abs(rec.kv_transfer_ns - expected) <= 1_000


# -- the policy slots: one clear error naming the slot ------------------------------------------


def test_policies_must_be_plain_functions_of_the_right_arity():
    async def async_router(eligible, dps, reserve):
        return eligible[0]

    with pytest.raises(ConfigError, match="decode_routing policy 'async_router' is async") as err:
        replay(WL, SMALL, decode_routing=async_router)
    assert err.value.field == "decode_routing"
    with pytest.raises(ConfigError, match="must take 3 or 4 positional arguments") as err:
        replay(WL, SMALL, decode_routing=lambda eligible, dps: eligible[0])  # type: ignore[arg-type]
    assert err.value.field == "decode_routing"
    with pytest.raises(ConfigError, match=r"prefill_placement policy .* must take 2") as err:
        replay(WL, SMALL, prefill_placement=lambda job: 0)  # type: ignore[arg-type]


def test_a_policy_sees_copies_and_its_errors_name_its_slot():
    def sneaky(eligible, dps, reserve):
        eligible.append(0)  # the offer is a tuple: this raises, naming the slot
        return 0

    with pytest.raises(AttributeError) as err:
        replay(WL, SMALL, decode_routing=sneaky)
    assert "(raised by the decode_routing policy 'sneaky' for request 0)" in err.value.__notes__

    shown = []

    def first_te(request, tes):
        shown.append(tes)
        return tes[0].te

    res = replay(WL, SMALL, prefill_te_selection=first_te)
    assert all(r.prefill_placement.startswith("P0") for r in res.records)
    assert all(isinstance(tes, tuple) for tes in shown)  # an offer it cannot change

    # returning the view rather than its index is a likely slip: the error says so
    with pytest.raises(ProtocolError, match=r"which was not offered.*return its \.te\)$"):
        replay(WL, SMALL, prefill_te_selection=lambda request, tes: tes[0])
    with pytest.raises(ProtocolError, match=r"return its \.dp\)$"):
        replay(WL, SMALL, prefill_placement=lambda job, groups: groups[0])
    # True == 1, but a bool is refused on purpose: the error says why, not just "not offered"
    with pytest.raises(ProtocolError, match=r"chose decode DP True .*a bool is not an index"):
        replay(WL, SMALL, decode_routing=lambda eligible, dps, reserve: True)
    with pytest.raises(ProtocolError, match=r"a DPLoad was returned: return its index"):
        replay(WL, SMALL, decode_routing=lambda eligible, dps, reserve: dps[eligible[0]])
    with pytest.raises(ProtocolError, match=r"chose decode DP 0\.0 .*a float is not an index"):
        replay(WL, SMALL, decode_routing=lambda eligible, dps, reserve: float(eligible[0]))


def test_a_mover_that_lets_a_cancellation_escape_is_named():
    """A mover raising CancelledError itself (to "give up" on a transfer) once ended the
    replay with xds's internal check that decode KV blocks were freed."""
    import asyncio

    async def give_up(move):
        await xds.sleep_until_ns(move.book(move.part_bytes))
        raise asyncio.CancelledError()

    with pytest.raises(ConfigError, match=r"kv_mover 'give_up' let a cancellation escape") as err:
        replay(WL, SMALL, kv_mover=give_up)
    assert err.value.field == "kv_mover"


def test_a_stuck_mover_never_hangs_a_replay_and_the_report_names_it_first():
    from xds.errors import ModelDeadlock, ModelTimeLimit
    from xds.serve.probe import ProbeConfig

    async def stuck(move: KVMove) -> None:
        with xds.waiting_for("my protocol's ack"):
            await anyio.Event().wait()

    with pytest.raises(ModelDeadlock) as dead:  # nothing else to do: a deadlock at once
        replay(WL, SMALL, kv_mover=stuck)
    first = dead.value.args[0].splitlines()[1]
    assert first.startswith("  - request-0 (also request-1") and "<locals>.stuck" in first
    probing = msgspec.structs.replace(SMALL, probe=ProbeConfig())  # periodic probes: no deadlock
    with pytest.raises(ModelTimeLimit) as limit:
        replay(WL, probing, kv_mover=stuck, time_limit_ns=20 * 10**9)
    assert limit.value.limit_ns == 20 * 10**9
    assert "waiting for my protocol's ack" in limit.value.args[0].splitlines()[2]


def test_the_default_bound_outlasts_scheduled_faults():
    from xds.serve.replay import DistFlowFault

    day = 86_400 * 10**9
    outage = [
        DistFlowFault(at_ns=1 * MS, prefill_te=p, kind="link_down", duration_ns=2 * day)
        for p in range(SMALL.prefill.tes)
    ]  # a two-day outage, no probing: the transfer waits it out
    (rec,) = replay(Workload((Request(0, 0, 3000, 12),)), SMALL, faults=outage).records
    assert rec.outcome == "completed" and rec.finish_ns > 2 * day


def test_a_decode_router_with_a_fourth_parameter_sees_the_request():
    from xds.serve.routing import RouteRequest

    seen: list[RouteRequest] = []

    def by_length(eligible, dps, reserve_blocks, request):
        seen.append(request)
        long = request.input_tokens > 2_800  # long prompts to the upper half of the DPs
        upper = [i for i in eligible if i >= len(dps) // 2]
        lower = [i for i in eligible if i < len(dps) // 2]
        return (upper if long and upper else lower or eligible)[0]

    res = replay(WL, SMALL, decode_routing=by_length)
    assert sorted(r.request_id for r in seen) == list(range(len(WL)))
    for r in res.records:  # WL's prompts are 2500, 3000 and 3500 tokens
        dp = int(r.decode_placement.split("/DP")[1])
        assert (dp >= 16) == (r.input_tokens > 2_800)
    assert {(s.input_tokens, s.output_tokens) for s in seen} == {
        (q.input_tokens, q.output_tokens) for q in WL.requests
    }


@pytest.mark.parametrize("mover", ["built-in", "yours"])
def test_on_the_xccl_tier_a_link_going_down_mid_move_cancels_it_and_it_runs_again(mover):
    """The xccl tier's messages (or a mover of yours sending them) used to carry on through an
    outage. Now the outage cancels them mid-protocol, the die pairs are re-initialised, and the
    move runs again from the start once the link is back."""
    from xds.serve.replay import DistFlowFault

    xccl = msgspec.structs.replace(SMALL, kv_transfer="xccl")

    async def one_message_per_rank(move: KVMove) -> None:
        async with anyio.create_task_group() as tg:
            for rank, nbytes in enumerate(move.part_bytes):
                tg.start_soon(move.send, rank, nbytes, 1)

    kw = {} if mover == "built-in" else {"kv_mover": one_message_per_rank}
    one = Workload((Request(0, 0, 3000, 12),))
    base = replay(one, xccl, event_log=True, **kw)
    (recv,) = base.events.select("distflow", "recv")
    took = base.records[0].kv_transfer_ns
    pair = recv.fields["pair"]
    cut = DistFlowFault(
        at_ns=recv.t_ns + took // 2,
        prefill_te=int(pair[1 : pair.index("-")]),
        kind="link_down",
        duration_ns=5 * MS,
    )
    res = replay(one, xccl, faults=[cut], event_log=True, **kw)
    rec = res.records[0]
    assert rec.outcome == "completed"
    assert len(res.events.select("distflow", "move-interrupted")) == 1
    # half a move, the outage, then a whole fresh move on re-initialised pairs
    assert rec.kv_transfer_ns >= took // 2 + 5 * MS + took - 1_000
    assert rec.kv_transfer_ns <= took // 2 + 5 * MS + took + 50_000


def test_concurrent_xccl_kv_transfers_never_deadlock_on_the_decode_dies_aivs():
    """The Decode DP's RECV is async: it takes the decode die's AIVs only once the sender's
    message is there. A receive holding them while waiting deadlocked 12 simultaneous transfers
    on trio (hold and wait: each die's 48 AIVs held by a receive whose sender waited for its
    own die's AIVs)."""
    xccl = msgspec.structs.replace(
        SMALL, prefill=msgspec.structs.replace(SMALL.prefill, tes=1), kv_transfer="xccl"
    )
    wl = Workload(tuple(Request(i, 0, 800 + 37 * i, 6) for i in range(12)))
    res = replay(wl, xccl, backend="trio")
    assert [r.outcome for r in res.records] == ["completed"] * 12


def test_a_transfer_completes_only_when_its_last_tp_rank_part_has_landed():
    """SPEC 10.7 TP synchronisation: a Prefill TP=4 -> Decode TP=1 transfer completes (and
    decode may use the KV) only after every rank's part landed; a part landing early shows
    nothing. Here rank r starts its part r ms late, so the parts land a millisecond apart."""
    landed: dict[int, list[int]] = {}  # request -> when each rank's part landed

    async def staggered(move: KVMove) -> None:
        async def rank(r: int) -> None:
            await xds.sleep_ns(r * MS)
            await move.send(r, move.part_bytes[r], move.transfer.transfer_id + 1)
            landed.setdefault(move.transfer.request_id, []).append(xds.now_ns())

        async with anyio.create_task_group() as tg:
            for r in range(len(move.sources)):
                tg.start_soon(rank, r)

    short = Workload(
        tuple(msgspec.structs.replace(r, input_tokens=r.input_tokens // 5) for r in WL.requests)
    )
    xccl = msgspec.structs.replace(SMALL, kv_transfer="xccl")
    base = {r.request_id: r for r in replay(short, xccl).records}
    for rec in replay(short, xccl, kv_mover=staggered).records:
        parts = landed[rec.request_id]
        assert rec.outcome == "completed" and len(parts) == 4
        assert max(parts) - min(parts) >= 2 * MS  # the parts really landed apart
        # the first decode token needs the whole KV: it comes after the last part landed
        assert rec.token_ns[0] > max(parts)
        # the transfer took about the 3 ms of stagger longer than all four parts at once (a
        # little less: the last part, alone on the decode die's port by then, moves faster)
        gap = rec.kv_transfer_ns - base[rec.request_id].kv_transfer_ns
        assert 2.5 * MS < gap <= 3 * MS
