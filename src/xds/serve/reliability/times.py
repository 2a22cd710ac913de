"""Per-layer kernel times of a reliability run, priced by the decode cost model."""

from __future__ import annotations

from ...config import require_instance
from ...runtime import run
from ..decode_model import DecodeConfig, DecodeModel, measure_comm
from .config import LayerTimes


def layer_times(
    config: DecodeConfig | None = None, *, context: int = 3_072, seed: int = 0
) -> LayerTimes:
    """One MoE layer of ``config`` (default: SPEC 12.2's peak run) at ``context`` tokens:
    attention side and busiest expert die from :mod:`xds.model.costs`, dispatch and combine
    from the collective tier (:func:`xds.serve.decode_model.measure_comm`), the LM head and
    sampling once per iteration. Main-model pass with its MTP draft tokens."""
    if config is not None:
        require_instance(config, DecodeConfig, "config")
    cfg = config or DecodeConfig()
    tps = 1 + cfg.mtp_config.k
    tokens = cfg.batch_per_die * tps
    comm = measure_comm(cfg, tokens, seed=seed)
    dm = DecodeModel(cfg, comm)
    m = cfg.spec

    async def expert() -> int:
        from ...runtime import rng

        return dm.busiest_expert_ns(
            rng("reliability/layer-times"),
            tokens * cfg.dies,
            cfg.dies - cfg.shared_expert_dies,
            cfg.shared_expert_dies,
        )

    head, sampling = dm.head_ns(float(tokens))
    return LayerTimes(
        attention_ns=sum(dm.attention_part(cfg.batch_per_die, float(tps), context, m.layers - 1)),
        dispatch_ns=comm.dispatch_ns,
        expert_ns=run(expert, seed=seed, event_log=False),
        combine_ns=comm.combine_ns,
        head_ns=head + sampling,
    )
