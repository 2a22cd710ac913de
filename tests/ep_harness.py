"""Run dispatch -> experts -> combine on an EP group and collect everything (test helper)."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import numpy as np

import xds
from xds.fabric import UBFabric
from xds.fabric.xccl.ep import DispatchOutput, EPConfig, EPGroup
from xds.fabric.xccl.moe import ExpertMap
from xds.hw import CloudMatrix384
from xds.model import ReferenceMoE, TinyMoE, dequantize_int8, quantize_int8, round_bf16

POD = CloudMatrix384(servers=4)


@dataclass
class MoERun:
    model: ReferenceMoE | None
    xs: list[np.ndarray]
    routes: list[tuple[np.ndarray, np.ndarray]]
    handles: list[DispatchOutput | None] = field(default_factory=list)
    ys: list[np.ndarray | None] = field(default_factory=list)
    dispatch_ns: list[int] = field(default_factory=list)
    combine_ns: list[int] = field(default_factory=list)
    expert_map: ExpertMap | None = None
    scale_dtype: str = "fp32"

    def reference(self, r: int, dispatch_dtype: str, combine_dtype: str) -> np.ndarray:
        rounding = {
            "fp32": None,
            "bf16": round_bf16,
            "int8": lambda v: dequantize_int8(*quantize_int8(v, self.scale_dtype)),
        }
        rin, rout = rounding[dispatch_dtype], rounding[combine_dtype]
        idx, w = self.routes[r]
        return self.model.forward(self.xs[r], idx, w, round_input=rin, round_output=rout)


def run_moe(
    *,
    n_ranks: int = 8,
    batch: list[int] | int = 12,
    shape: TinyMoE | None = None,
    dispatch_dtype: str = "fp32",
    combine_dtype: str = "fp32",
    tier: str = "protocol",
    mode: str = "bytes",
    delays_ns: list[int] | None = None,
    seed: int = 0,
    routes: list[tuple[np.ndarray, np.ndarray]] | None = None,
    expert_map: ExpertMap | None = None,
    ranks: list[int] | None = None,
    n_aiv: int = 8,
    capacity: int = 256,
    pod: CloudMatrix384 | None = None,
    pull_order: str = "static",
    scale_dtype: str = "fp32",
) -> MoERun:
    shape = shape or TinyMoE()
    rng = np.random.default_rng(seed)
    batches = batch if isinstance(batch, list) else [batch] * n_ranks
    if mode == "size" and routes is not None:
        model = None  # timing only: no weights, no token data
        xs = [np.zeros((b, 0), np.float32) for b in batches]
    else:
        model = ReferenceMoE(shape, rng)
        xs = [rng.standard_normal((b, shape.hidden)).astype(np.float32) for b in batches]
    routes = routes or [model.route(x) for x in xs]
    expert_map = expert_map or ExpertMap(shape.n_experts, n_ranks)
    ranks = ranks or [3 * i % POD.n_pod_dies for i in range(n_ranks)]
    run = MoERun(
        model,
        xs,
        routes,
        [None] * n_ranks,
        [None] * n_ranks,
        [0] * n_ranks,
        [0] * n_ranks,
        expert_map,
        scale_dtype,
    )
    delays = delays_ns or [0] * n_ranks
    slot_expert = {}
    for e, reps in enumerate(expert_map.replicas):
        for p in reps:
            slot_expert[(int(expert_map.slots_rank[p]), int(expert_map.local_index[p]))] = e

    async def main() -> None:
        fabric = UBFabric(pod or POD, payload_mode=mode)
        group = EPGroup(
            fabric,
            ranks,
            expert_map,
            EPConfig(
                hidden=shape.hidden,
                top_k=shape.top_k,
                max_tokens_per_rank=capacity,
                dispatch_dtype=dispatch_dtype,
                combine_dtype=combine_dtype,
                n_aiv=n_aiv,
                pull_order=pull_order,
                scale_dtype=scale_dtype,
            ),
            tier=tier,
        )

        async def rank(r: int) -> None:
            await xds.sleep_ns(delays[r])
            idx, w = routes[r]
            t0 = xds.now_ns()
            x = xs[r] if mode == "bytes" else len(xs[r])
            h = await group.dispatch(r, x, idx, event_id=11)
            run.dispatch_ns[r] = xds.now_ns() - t0
            run.handles[r] = h
            out = None
            if mode == "bytes":
                out = np.zeros((h.n_recv, shape.top_k, shape.hidden), np.float32)
                for i in range(h.n_recv):
                    for j in range(shape.top_k):
                        s = int(h.recv_local_slots[i, j])
                        if s >= 0:
                            out[i, j] = model.expert(slot_expert[(r, s)], h.recv_x[i : i + 1])[0]
            t1 = xds.now_ns()
            run.ys[r] = await group.combine(r, h, out, w, event_id=12)
            run.combine_ns[r] = xds.now_ns() - t1

        async with anyio.create_task_group() as tg:
            for r in range(n_ranks):
                tg.start_soon(rank, r)

    xds.run(main, seed=seed)
    return run
