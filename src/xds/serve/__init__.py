"""FlowServe and Transformerless: DP groups, TE-shell, routing, KV blocks, deployments.

See SPEC.md sections 6-11 and ARCHITECTURE.md "Layers".
"""
