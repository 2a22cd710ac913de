"""SPEC 10.4: the dataflow mode's invariants, against the synchronous mode and a dense
reference."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds.errors import ConfigError
from xds.runtime import run
from xds.serve.dataflow import (
    ComponentDelay,
    Dataflow,
    DataflowConfig,
    DataflowResult,
    reference_tokens,
)
from xds.units import US

CFG = DataflowConfig()
REF = reference_tokens(CFG, model_seed=7)


def _run(cfg: DataflowConfig, *, backend: str = "asyncio") -> DataflowResult:
    return run(lambda: Dataflow(cfg, model_seed=7).run(), seed=0, backend=backend, event_log=False)


def _latency(res: DataflowResult, keep) -> float:
    return float(np.mean([r.finished_ns - r.admitted_ns for r in res.requests if keep(r)]))


@pytest.mark.parametrize("mode", ["dataflow", "sync"])
def test_both_modes_give_the_reference_tokens(mode):
    res = _run(msgspec.structs.replace(CFG, mode=mode))
    assert [r.tokens for r in res.requests] == REF
    assert len({t for toks in REF for t in toks}) > 5  # tokens do vary
    assert res.messages == 2 * CFG.requests * (CFG.prompt_tokens + CFG.output_tokens - 1) * (
        CFG.layers * CFG.top_k
    )  # every token copy out and back once
    assert max(res.max_queue.values()) <= CFG.queue_depth


def test_dataflow_mode_has_no_global_step_and_finishes_sooner():
    sync = _run(msgspec.structs.replace(CFG, mode="sync"))
    flow = _run(CFG)
    assert flow.elapsed_ns < sync.elapsed_ns


def test_a_slow_component_slows_only_what_depends_on_it_in_dataflow_mode():
    """Attention worker 0 is 10x slower: in dataflow mode only its own requests slow down;
    in sync mode the global step makes every request wait for it."""
    slow = (ComponentDelay(component="attention:0", extra_ns=200 * US),)
    for_mode = {}
    for mode in ("dataflow", "sync"):
        base = _run(msgspec.structs.replace(CFG, mode=mode))
        res = _run(msgspec.structs.replace(CFG, mode=mode, delays=slow))
        assert [r.tokens for r in res.requests] == REF
        for_mode[mode] = (
            _latency(res, lambda r: r.worker == 0) / _latency(base, lambda r: r.worker == 0),
            _latency(res, lambda r: r.worker != 0) / _latency(base, lambda r: r.worker != 0),
        )
    dependent, independent = for_mode["dataflow"]
    assert dependent > 5 and independent < 1.1
    dependent, independent = for_mode["sync"]
    assert dependent > 5 and independent > 5  # a global stall


def test_a_slow_expert_window_never_deadlocks_even_with_one_slot_queues():
    cfg = msgspec.structs.replace(
        CFG,
        queue_depth=1,
        duplicate_probability=0.2,
        delays=(ComponentDelay(component="expert:2", extra_ns=300 * US, until_ns=2_000 * US),),
    )
    for mode in ("dataflow", "sync"):
        res = _run(msgspec.structs.replace(cfg, mode=mode))
        assert [r.tokens for r in res.requests] == REF
        assert max(res.max_queue.values()) <= 1


@settings(max_examples=20, deadline=None)
@given(
    mode=st.sampled_from(["dataflow", "sync"]),
    attention=st.integers(1, 4),
    experts=st.integers(1, 5),
    batch=st.integers(1, 4),
    depth=st.integers(1, 4),
    dup=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_any_shape_keeps_the_invariants(mode, attention, experts, batch, depth, dup):
    """Tokens equal the dense reference; duplicates are applied at most once (every one sent is
    dropped, unless the run ended with it in flight); queues stay in bounds; no deadlock."""
    cfg = DataflowConfig(
        mode=mode,
        attention_workers=attention,
        expert_workers=experts,
        batch_per_worker=batch,
        requests=10,
        output_tokens=4,
        queue_depth=depth,
        duplicate_probability=dup,
    )
    res = _run(cfg)
    assert [r.tokens for r in res.requests] == reference_tokens(cfg, model_seed=7)
    assert res.duplicates_dropped <= res.duplicates_sent
    assert max(res.max_queue.values()) <= depth


def test_each_backend_is_deterministic():
    cfg = msgspec.structs.replace(CFG, duplicate_probability=0.3)
    for backend in ("asyncio", "trio"):
        assert _run(cfg, backend=backend) == _run(cfg, backend=backend)


def test_bad_configs_name_the_field():
    for kwargs, field in (
        (dict(top_k=13), "top_k"),
        (
            dict(delays=(ComponentDelay(component="attention:9", extra_ns=1),)),
            "delays[0].component",
        ),
        (dict(queue_depth=0), "queue_depth"),
    ):
        with pytest.raises(ConfigError) as err:
            DataflowConfig(**kwargs)
        assert err.value.field == field
    with pytest.raises(ConfigError) as err:
        ComponentDelay(component="gpu:1", extra_ns=1)
    assert err.value.field == "component"


def test_reference_of_a_run_seed_matches_the_run_stream():
    cfg = msgspec.structs.replace(CFG, requests=4)
    res = run(lambda: Dataflow(cfg).run(), seed=3, event_log=False)
    assert [r.tokens for r in res.requests] == reference_tokens(cfg, run_seed=3)
    assert reference_tokens(cfg, run_seed=3) != reference_tokens(cfg, run_seed=4)
    with pytest.raises(ConfigError, match="give run_seed"):
        reference_tokens(cfg)
    with pytest.raises(TypeError):
        reference_tokens(cfg, 7)  # type: ignore[misc]  # which seed? it must say


def test_a_run_closes_its_streams(streams_left_open):
    assert streams_left_open(lambda: _run(DataflowConfig(requests=4))) == []
