"""Workloads and results: trace loaders, generators, per-request records and summaries.

The replay driver for PD-disaggregated deployments is :mod:`xds.serve.replay`; the synthetic
SPEC 12.4 workload is :mod:`xds.trace.production`.
"""

from .loaders import (
    guess_format,
    load,
    load_azure,
    load_generic,
    load_lengths,
    load_mooncake,
    load_request_csv,
)
from .metrics import (
    SLA,
    DecodeStats,
    RequestRecord,
    Stat,
    Summary,
    check_complete,
    summarize,
    write,
)
from .servegen import load_servegen
from .workload import Request, Workload, fixed, gamma_arrivals, poisson_arrivals, synthetic

__all__ = [
    "SLA",
    "DecodeStats",
    "Request",
    "RequestRecord",
    "Stat",
    "Summary",
    "Workload",
    "check_complete",
    "fixed",
    "gamma_arrivals",
    "guess_format",
    "load",
    "load_azure",
    "load_generic",
    "load_lengths",
    "load_mooncake",
    "load_request_csv",
    "load_servegen",
    "poisson_arrivals",
    "summarize",
    "synthetic",
    "write",
]
