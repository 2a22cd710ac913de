"""FlowServe and Transformerless: DP groups, TE-shell, routing, KV blocks, deployments.

See SPEC.md sections 6-11 and ARCHITECTURE.md "Layers".

Components: :mod:`~xds.serve.routing` (the TE-shell's decode DP routing),
:mod:`~xds.serve.kv` (KV block accounting), :mod:`~xds.serve.mtp` (multi-token prediction
commit and acceptance), :mod:`~xds.serve.jitter` (host jitter sources and mitigations),
:mod:`~xds.serve.decode` (colocated decode, SPEC 12.2), :mod:`~xds.serve.eplb` (expert load
balancing), :mod:`~xds.serve.prefill` (Prefill TEs and their cooperative scheduler),
:mod:`~xds.serve.distflow` (PD KV transfers), :mod:`~xds.serve.decode_te` (a Decode TE under
continuous arrivals) and :mod:`~xds.serve.replay` (trace replay on a PD deployment).
"""
