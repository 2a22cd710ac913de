"""Online EPLB inside the peak-decode instance (SPEC 12.2 configuration, skewed routing).

Runs the full decode twice: with the skewed, drifting routing and no balancing, and with the
xds greedy rebalancing every window (four-phase swaps in the background). Prints the mean
iteration time, the first and last stretches, and how many reconfigurations ran.

Run: ``python benchmarks/eplb_online.py [--window-s 10] [--policy xds-greedy]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import xds
from xds.errors import ConfigError
from xds.serve.decode import DecodeConfig, DecodeInstance, measure_comm
from xds.serve.eplb import policy
from xds.serve.eplb.online import OnlineEPLBConfig
from xds.units import S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--policy", default="xds-greedy")
    args = parser.parse_args()
    if not 0 < args.window_s < 86_400:  # (nan fails this too)
        parser.error(f"--window-s must be in (0, 86400) seconds, got {args.window_s}")
    configs = []
    for name in ("none", args.policy):
        try:
            policy(name)  # known (or registered)
            eplb = OnlineEPLBConfig(policy=name, window_ns=round(args.window_s * S))
        except ConfigError as exc:
            parser.error(f"--policy {name}: {exc}")
        configs.append((name, DecodeConfig(eplb=eplb)))
    for name, cfg in configs:
        comm = measure_comm(cfg, cfg.batch_per_die * (1 + cfg.mtp_config.k))
        comm_mtp = measure_comm(cfg, cfg.batch_per_die)

        async def run(cfg=cfg, comm=comm, comm_mtp=comm_mtp):
            inst = DecodeInstance(cfg, comm, comm_mtp)
            res = await inst.serve(cfg.dies * cfg.batch_per_die)
            return res, inst.eplb.reconfigurations

        wall = time.perf_counter()
        res, reconfigs = xds.run(run, event_log=False)
        it = np.array(res.iteration_ns) / 1e6
        print(
            f"{name:12s} {res.iterations} iterations, mean {it.mean():.1f} ms, first 20 "
            f"{it[:20].mean():.1f} ms, last 200 {it[-200:].mean():.1f} ms, "
            f"{reconfigs} reconfigurations, {time.perf_counter() - wall:.1f} s wall"
        )


if __name__ == "__main__":
    main()
