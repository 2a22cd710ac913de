"""FlowServe and Transformerless: DP groups, TE-shell, routing, KV blocks, deployments.

See SPEC.md sections 6-11 and ARCHITECTURE.md "Layers".

Components: :mod:`~xds.serve.routing` (the TE-shell's decode DP routing),
:mod:`~xds.serve.kv` (KV block accounting), :mod:`~xds.serve.mtp` (multi-token prediction
commit and acceptance), :mod:`~xds.serve.jitter` (host jitter sources and mitigations),
:mod:`~xds.serve.decode` (colocated decode, SPEC 12.2), :mod:`~xds.serve.eplb` (expert load
balancing), :mod:`~xds.serve.prefill` (Prefill TEs and their cooperative scheduler),
:mod:`~xds.serve.prefill_cost` (a Prefill TE's step time),
:mod:`~xds.serve.distflow` (PD KV transfers), :mod:`~xds.serve.decode_te` (a Decode TE under
continuous arrivals), :mod:`~xds.serve.job_executor` (the choice of Prefill and Decode TE) and
:mod:`~xds.serve.replay` (trace replay on a PD deployment).

Four policies are plain functions you can replace: decode DP routing
(:func:`~xds.serve.routing.lowest_kv`), prefill DP-group placement
(:func:`~xds.serve.prefill.least_work`), and the Job Executor's Prefill and Decode TE choices
(:func:`~xds.serve.job_executor.earliest_first_token`,
:func:`~xds.serve.job_executor.fewest_sequences`).
"""
