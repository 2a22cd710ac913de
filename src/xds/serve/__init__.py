"""FlowServe and Transformerless: DP groups, TE-shell, routing, KV blocks, deployments.

See SPEC.md sections 6-11 and ARCHITECTURE.md "Layers".

Components so far: :mod:`~xds.serve.routing` (the TE-shell's decode DP routing),
:mod:`~xds.serve.kv` (KV block accounting), :mod:`~xds.serve.mtp` (multi-token prediction
commit and acceptance) and :mod:`~xds.serve.jitter` (host jitter sources and mitigations).
"""
