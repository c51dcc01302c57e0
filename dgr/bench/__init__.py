"""Measurements: `dgr bench`, `dgr soak`, and the audits run as `python -m dgr.bench.<name>`.

    cli, suite, direct, measure, report, netns   `dgr bench`: side-by-side figures, a Markdown report, plots
    soak            `dgr soak`: many Route Sessions with faults through a real route, and what they leave
    plan_overhead   the planner's prediction against the RSS of real llama.cpp shards
    dsv4_tiny       DeepSeek-V4 KV terms and shard rules against a tiny random model in llama.cpp
    audit_tiny      the same for the GLM-5.2 and Ornith (Qwen3.5) audits
    ranges          what a node serving a layer range costs to start and hold, and 2-node decode before/after
    certify         every architecture's tiny model split at its boundaries, compared bit for bit with the whole
    torch_route     the torch backend through a route
    artifact        manifest, verify, proof and fetch timings
"""

__all__: list[str] = []
