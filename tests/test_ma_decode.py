"""MoE-attention disaggregated decode (SPEC 10.3): domain exclusivity, microbatch dependencies,
persistent kernels, utilisation, the exposed tail, conservation and determinism."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest

from xds.errors import ConfigError, ProtocolError
from xds.fabric import UBFabric
from xds.fabric.xccl.a2e import AEConfig, AEGroup
from xds.fabric.xccl.ep import EPConfig, EPGroup
from xds.fabric.xccl.moe import ExpertMap
from xds.hw import CloudMatrix384
from xds.model import ReferenceMoE, TinyMoE
from xds.runtime import now_ns, run, sleep_ns
from xds.serve.ma_config import AECosts, MADecodeConfig, ae_layout
from xds.serve.ma_decode import AECurve, MADecodeInstance, MoEPool, Span, ae_curve

SMALL = MADecodeConfig(
    domains=3,
    attention_dies_per_domain=8,
    expert_dies=32,
    shared_expert_dies=0,
    batch_per_die=8,
    input_tokens=256,
    output_tokens=6,
)


@pytest.fixture(scope="module")
def small_curve() -> AECurve:
    return ae_curve(SMALL)


def _serve(config, curve, **kw):
    record = kw.pop("record", True)

    async def main():
        inst = MADecodeInstance(config, curve, record=record)
        return inst, await inst.serve(**kw)

    return run(main, seed=0, event_log=False)


def _by(spans: list[Span], kind: str) -> dict[tuple[int, int, int], Span]:
    return {(s.domain, s.layer, s.microbatch): s for s in spans if s.kind == kind}


def test_config_errors_name_the_field():
    cases = [
        ({"microbatches": 9, "batch_per_die": 8}, "microbatches"),
        ({"attention_dies_per_domain": 400}, "attention_dies_per_domain"),
        ({"expert_dies": 300, "shared_expert_dies": 32}, "expert_dies"),
        ({"batch_per_die": 4000}, "batch_per_die"),
        ({"domain_turns": "sometimes"}, "domain_turns"),
        ({"model": "gpt-2"}, "model"),
    ]
    for kw, field in cases:
        with pytest.raises(ConfigError) as err:
            MADecodeConfig(**kw)
        assert err.value.field == field, (kw, err.value)


def test_exclusive_domains_never_overlap_on_the_a2e_e2a_path(small_curve):
    """At any instant A2E/E2A traffic belongs to one domain, in the rotation d0 -> d1 -> d2."""
    together = msgspec.structs.replace(SMALL, domain_start="together")
    inst, res = _serve(together, small_curve, max_iterations=2)
    spans = [s for s in inst.pool.spans if s.kind in ("a2e", "e2a")]
    spans.sort(key=lambda s: s.start_ns)
    for a in spans:
        for b in spans:
            if a.domain != b.domain:
                assert a.end_ns <= b.start_ns or b.end_ns <= a.start_ns, (a, b)
    # with every domain ready (all started together), turns go in rotation order: the
    # domains' first A2E of each main-pass MoE layer in the first iteration
    m = together.spec
    for layer in range(m.dense_layers + 1, m.layers - 1):
        firsts = {}
        for s in spans:
            if s.kind == "a2e" and s.layer == layer and s.microbatch == 0:
                firsts.setdefault(s.domain, s.start_ns)
        assert sorted(firsts, key=firsts.get) == [0, 1, 2], layer
    assert res.iterations == 2


def test_relaxed_overlaps_domains_and_is_faster(small_curve):
    ex = _serve(SMALL, small_curve, max_iterations=3)[1]
    relaxed_cfg = msgspec.structs.replace(SMALL, domain_turns="relaxed")
    inst, rel = _serve(relaxed_cfg, small_curve, max_iterations=3)
    a2e = [s for s in inst.pool.spans if s.kind == "a2e"]
    e2a = [s for s in inst.pool.spans if s.kind == "e2a"]
    overlap = any(
        a.domain != e.domain and a.start_ns < e.end_ns and e.start_ns < a.end_ns
        for a in a2e
        for e in e2a
    )
    assert overlap, "relaxed turns never overlapped one domain's E2A with the next one's A2E"
    assert rel.mean_iteration_ns < ex.mean_iteration_ns


def test_a_microbatch_waits_for_its_previous_e2a(small_curve):
    """Attention of (domain, microbatch) at layer l+1 starts only after E2A of layer l
    delivered to that domain; the two microbatches ping-pong."""
    inst, _ = _serve(SMALL, small_curve, max_iterations=1)
    attn, e2a = _by(inst.pool.spans, "attention"), _by(inst.pool.spans, "e2a")
    m = SMALL.spec
    checked = 0
    for (d, layer, mb), span in e2a.items():
        nxt = attn.get((d, layer + 1, mb))
        if nxt is not None and layer + 1 < m.layers:
            assert nxt.start_ns >= span.end_ns
            checked += 1
    assert checked >= SMALL.domains * SMALL.microbatches * (m.moe_layers - 1)
    # ping-pong: microbatch 1's attention runs while microbatch 0 is at the experts
    d0 = [s for s in inst.pool.spans if s.domain == 0 and s.layer == m.dense_layers + 1]
    a2e0 = next(s for s in d0 if s.kind == "a2e" and s.microbatch == 0)
    att1 = next(s for s in d0 if s.kind == "attention" and s.microbatch == 1)
    assert att1.start_ns < a2e0.end_ns


def test_the_last_microbatch_is_exposed(small_curve):
    """The main pass ends after the last MoE layer's last E2A: A2E + MoE + E2A of the last
    microbatch are on the critical path (P124)."""
    together = msgspec.structs.replace(SMALL, domain_start="together")
    inst, res = _serve(together, small_curve, max_iterations=1)
    m = SMALL.spec
    last = m.layers - 1
    first: dict[tuple[str, int, int, int], Span] = {}
    for span in inst.pool.spans:  # the first iteration's spans (domains go on, unrecorded)
        first.setdefault((span.kind, span.domain, span.layer, span.microbatch), span)
    mb = SMALL.microbatches - 1
    attn_end = first[("attention", 0, last, mb)].end_ns
    tail = [first[(kind, 0, last, mb)] for kind in ("a2e", "moe", "e2a")]
    assert attn_end <= tail[0].start_ns < tail[0].end_ns <= tail[1].start_ns
    assert tail[1].end_ns <= tail[2].start_ns
    # domain 0 started at 0: its first iteration ends after that E2A (then the LM head)
    assert res.domains[0].iteration_ns[0] > tail[2].end_ns


def test_every_token_is_generated_once(small_curve):
    _, res = _serve(SMALL, small_curve, record=False)
    # prefill made each first token: decode makes the rest
    assert res.tokens == SMALL.attention_dies * SMALL.batch_per_die * (SMALL.output_tokens - 1)
    # MTP acceptance may finish a domain an iteration early: the rotation then skips it
    assert {len(d.iteration_ns) for d in res.domains} <= {res.iterations - 1, res.iterations}
    assert 1.0 <= res.mean_tokens_per_step <= 1 + SMALL.mtp_config.k


def test_more_domains_keep_the_moe_kernel_busier(small_curve):
    """Same global batch: 3 domains leave the MoE stream less idle than 1 (SPEC 10.3)."""
    one = msgspec.structs.replace(SMALL, domains=1, attention_dies_per_domain=24)
    busy3 = _serve(SMALL, small_curve, max_iterations=3, record=False)[1].stream_busy["moe"]
    busy1 = _serve(one, ae_curve(one), max_iterations=3, record=False)[1].stream_busy["moe"]
    assert busy3 > busy1 > 0


def test_same_seed_same_run(small_curve):
    a = _serve(SMALL, small_curve, max_iterations=2)[1]
    b = _serve(SMALL, small_curve, max_iterations=2)[1]
    assert msgspec.json.encode(a) == msgspec.json.encode(b)


def _pool(poll_ns: int = 1_000) -> MoEPool:
    from xds.hw import ASCEND_910C_DIE
    from xds.serve.decode_model import KernelTimes

    cfg = msgspec.structs.replace(SMALL, poll_ns=poll_ns)
    curve = AECurve([AECosts(16, 50_000, 60_000, 1)])
    return MoEPool(cfg, KernelTimes(cfg.spec, ASCEND_910C_DIE), curve, record=True)


def test_persistent_kernels_stop_after_the_batch_in_flight():
    """STOPPED: kernels exit within a poll interval plus the batch in flight; queued batches
    come back dropped, never lost; submitting afterwards is an error."""

    async def main():
        pool = _pool()
        batches = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run)
            for d in range(3):
                for mb in range(2):
                    batches.append(pool.submit(d, 3, mb, 16))
            await sleep_ns(70_000)  # d0 mb0 is past A2E, d0 mb1 in A2E
            stopped_at = now_ns()
            pool.stop()
        with pytest.raises(ProtocolError):
            pool.submit(0, 4, 0, 16)
        return pool, batches, stopped_at

    pool, batches, stopped_at = run(main, seed=0, event_log=False)
    assert all(b.done.is_set() for b in batches)
    assert sum(b.dropped for b in batches) >= 4
    # no kernel took new work after the stop; they exited once the batch in flight was done
    assert all(s.start_ns <= stopped_at for s in pool.spans)
    in_flight_end = max(s.end_ns for s in pool.spans)
    assert stopped_at < in_flight_end
    assert pool.stopped_ns <= in_flight_end + pool.config.poll_ns
    assert pool._in_flight == 0


def test_idle_kernels_notice_work_at_their_next_poll():
    async def main():
        pool = _pool(poll_ns=10_000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run)
            await sleep_ns(3_000)
            b = pool.submit(0, 3, 0, 16)
            for d in range(3):
                pool.close(d)
            await b.done.wait()
        return pool

    pool = run(main, seed=0, event_log=False)
    a2e = next(s for s in pool.spans if s.kind == "a2e")
    assert a2e.start_ns == 10_000  # submitted at 3 us, noticed at the 10 us poll


def test_a_failing_kernel_cancels_its_siblings_and_is_reported(small_curve):
    async def main():
        inst = MADecodeInstance(SMALL, small_curve)

        def boom(*_a, **_k):
            raise RuntimeError("expert die 7: HBM ECC error")

        inst.pool._expert_ns = boom  # type: ignore[method-assign]
        await inst.serve(max_iterations=2)

    with pytest.raises(BaseException) as err:
        run(main, seed=0, event_log=False)
    assert "HBM ECC error" in repr(err.value) or any(
        "HBM ECC error" in str(e) for e in getattr(err.value, "exceptions", [])
    )


def test_a_warmup_that_would_leave_no_iteration_skips_none_and_says_so(small_curve):
    """It once reported warmup 3 of 3 iterations while averaging all three."""
    runs = {w: _serve(SMALL, small_curve, max_iterations=3, warmup=w)[1] for w in (0, 1, 3, 10)}
    assert [runs[w].warmup for w in (0, 1, 3, 10)] == [0, 1, 0, 0]
    assert runs[3].mean_iteration_ns == runs[10].mean_iteration_ns == runs[0].mean_iteration_ns
    assert runs[1].mean_iteration_ns != runs[0].mean_iteration_ns


def test_a_curve_measured_on_another_layout_is_refused(small_curve):
    other = msgspec.structs.replace(SMALL, expert_dies=SMALL.expert_dies // 2)
    foreign = AECurve(small_curve.points, layout=ae_layout(other))

    async def build(curve):
        return MADecodeInstance(SMALL, curve)

    with pytest.raises(ConfigError, match="measured on another layout") as err:
        run(build, foreign, event_log=False)
    assert err.value.field == "curve"
    run(build, AECurve(small_curve.points), event_log=False)  # points from elsewhere: trusted
    assert small_curve.layout == ae_layout(SMALL)


def test_serve_argument_errors(small_curve):
    async def main(**kw):
        await MADecodeInstance(SMALL, small_curve).serve(**kw)

    for kw, field in (({"from_token": 6}, "from_token"), ({"max_iterations": 0}, "max_iterations")):
        with pytest.raises(ConfigError) as err:
            run(lambda kw=kw: main(**kw), seed=0, event_log=False)
        assert err.value.field == field


def _greedy_decode(layout: str, *, steps: int = 3, layers: int = 2) -> list[np.ndarray]:
    """A tiny MoE decoder (embedding, ``layers`` residual MoE layers, LM head) decoding greedily
    on 4 DP groups, its MoE layers through dispatch/combine (colocated: each DP die is an EP
    rank) or A2E/E2A (MA: 4 attention dies, 6 expert dies, trampolines), bytes mode, FP32."""
    shape = TinyMoE(hidden=32, intermediate=16, n_experts=12, top_k=3)
    gen = np.random.default_rng(5)
    moe = [ReferenceMoE(shape, gen) for _ in range(layers)]
    embed = gen.standard_normal((50, 32)).astype(np.float32)
    head = gen.standard_normal((32, 50)).astype(np.float32)
    n_dp, batch, n_exp = 4, 3, 6
    tokens = [[gen.integers(0, 50, batch)] for _ in range(n_dp)]
    emap = ExpertMap(12, n_dp if layout == "colocated" else n_exp)
    slot_expert = {
        (int(emap.slots_rank[p]), int(emap.local_index[p])): e
        for e, reps in enumerate(emap.replicas)
        for p in reps
    }

    def experts(layer: int, die: int, x: np.ndarray, slots: np.ndarray) -> np.ndarray:
        out = np.zeros((len(x), shape.top_k, shape.hidden), np.float32)
        for i, j in zip(*np.nonzero(slots >= 0), strict=True):
            e = slot_expert[(die, int(slots[i, j]))]
            out[i, j] = moe[layer].expert(e, x[i : i + 1])[0]
        return out

    async def main() -> None:
        fabric = UBFabric(CloudMatrix384(servers=2), payload_mode="bytes")
        if layout == "colocated":
            group = EPGroup(
                fabric,
                list(range(n_dp)),
                emap,
                EPConfig(
                    hidden=32,
                    top_k=3,
                    max_tokens_per_rank=8,
                    dispatch_dtype="fp32",
                    combine_dtype="fp32",
                ),
            )
        else:
            group = AEGroup(
                fabric,
                list(range(n_dp)),
                list(range(16, 16 + n_exp)),
                emap,
                AEConfig(hidden=32, top_k=3, a2e_dtype="fp32", e2a_dtype="fp32"),
            )

        async def dp(r: int) -> None:
            for step in range(steps):
                x = embed[tokens[r][-1]]
                for layer in range(layers):
                    idx, w = moe[layer].route(x)
                    eid = 2 * (step * layers + layer) + 1
                    if layout == "colocated":
                        h = await group.dispatch(r, x, idx, eid)
                        out = experts(layer, r, h.recv_x, h.recv_local_slots)
                        y = await group.combine(r, h, out, w, eid + 1)
                    else:
                        h = await group.a2e(r, x, idx, eid)
                        y = await group.e2a(h, w, eid + 1)
                    x = x + y
                tokens[r].append(np.argmax(x @ head, axis=1))

        async def expert_die(j: int) -> None:
            for step in range(steps):
                for layer in range(layers):
                    eid = 2 * (step * layers + layer) + 1
                    inp = await group.expert_receive(j, eid)
                    await group.expert_return(j, inp, experts(layer, j, inp.x, inp.slots), eid + 1)

        async with anyio.create_task_group() as tg:
            for r in range(n_dp):
                tg.start_soon(dp, r)
            if layout == "ma":
                for j in range(n_exp):
                    tg.start_soon(expert_die, j)

    run(main, seed=0, event_log=False)
    return [np.stack(t) for t in tokens]


def test_ma_layout_generates_the_same_tokens_as_the_colocated_one():
    """SPEC 10.3: MoE-attention disaggregation produces the same tokens as the colocated
    layout (content mode, greedy)."""
    colocated, ma = _greedy_decode("colocated"), _greedy_decode("ma")
    for a, b in zip(colocated, ma, strict=True):
        assert np.array_equal(a, b)
    assert len({t.tobytes() for seq in colocated for t in seq[1:]}) > 1  # tokens do vary


def test_stop_reaches_kernels_waiting_for_a_drain_or_noticing_a_batch(xds_backend):
    """No kernel starts work after STOPPED: not the A2E kernel waiting for the previous
    domain's batches to drain, nor one that got a batch at the stopping instant."""

    async def waiting_for_the_drain():
        pool = _pool()
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run)
            batches = [pool.submit(0, 3, 0, 16), pool.submit(0, 3, 1, 16), pool.submit(1, 3, 0, 16)]
            await sleep_ns(110_000)  # domain 1's turn waits for domain 0's E2A
            stopped_at = now_ns()
            pool.stop()
        return pool, batches, stopped_at

    async def same_instant():
        pool = _pool()
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run)
            await sleep_ns(5_000)
            batch = pool.submit(0, 3, 0, 16)
            stopped_at = now_ns()
            pool.stop()
        return pool, [batch], stopped_at

    for main in (waiting_for_the_drain, same_instant):
        pool, batches, stopped_at = run(main, backend=xds_backend, event_log=False)
        assert all(s.start_ns < stopped_at for s in pool.spans), main.__name__
        assert all(b.done.is_set() for b in batches) and pool._in_flight == 0
        assert batches[-1].dropped


def test_an_instance_serves_once_and_its_curve_covers_small_batches(small_curve):
    assert small_curve.points[0].tokens_per_die == 1  # the fixed costs, measured
    assert small_curve.a2e_ns(1) == small_curve.points[0].a2e_ns > 10_000

    async def main():
        inst = MADecodeInstance(SMALL, small_curve)
        await inst.serve(max_iterations=1)
        await inst.serve(max_iterations=1)

    with pytest.raises(ProtocolError, match="served its workload"):
        run(main, seed=0, event_log=False)


def test_staggered_domains_interleave_and_keep_the_experts_busier(small_curve):
    """SPEC 10.3: domains interleave, they do not run in lockstep. Staggered starts spread
    the domains' iterations; started together, the rotation keeps them nearly aligned."""
    together = msgspec.structs.replace(SMALL, domain_start="together", output_tokens=64)
    staggered = msgspec.structs.replace(SMALL, output_tokens=64)
    a = _serve(together, small_curve, max_iterations=6, from_token=8, record=False)[1]
    b = _serve(staggered, small_curve, max_iterations=6, from_token=8, record=False)[1]
    assert b.stream_busy["moe"] > a.stream_busy["moe"]
    assert b.mean_iteration_ns < a.mean_iteration_ns


def test_asyncio_and_trio_give_the_same_run(small_curve):
    """Whether a kernel pays a poll delay is decided by when the batch was queued and when the
    kernel became free, not by which same-instant event the backend runs first."""
    uneven = MADecodeConfig(  # one sequence per microbatch: zero-cost batches at the end
        domains=3,
        attention_dies_per_domain=4,
        expert_dies=16,
        shared_expert_dies=0,
        batch_per_die=5,
        input_tokens=256,
        output_tokens=5,
        microbatches=5,
    )
    curve = ae_curve(uneven)

    def go(backend):
        async def main():
            return await MADecodeInstance(uneven, curve).serve()

        return run(main, seed=0, backend=backend, event_log=False)

    a, t = go("asyncio"), go("trio")
    assert [d.iteration_ns for d in a.domains] == [d.iteration_ns for d in t.domains]
    assert a.stream_busy == t.stream_busy


def test_serving_closes_the_pools_streams(small_curve, streams_left_open):
    assert streams_left_open(lambda: _serve(SMALL, small_curve, max_iterations=2)) == []


def test_output_tokens_mean_what_they_mean_in_colocated_decode():
    """Prefill makes each sequence's first token in both deployments: a sequence needs two
    output tokens to decode at all, and decode makes output_tokens - 1 of them."""
    with pytest.raises(ConfigError, match=">= 2") as exc:
        msgspec.structs.replace(SMALL, output_tokens=1)
    assert exc.value.field == "output_tokens"
