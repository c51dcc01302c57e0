"""The one spec generator: every generated file in spec/, tests/fixtures/ and README.md, drawn from the code.

    protocol       spec/states.md, reasons.md, seam.md, whole, from the FSM, error and wire tables
    artifact       the tables block of spec/artifact-manifest.md
    dsv4_layout    tests/fixtures/deepseek-v4-flash.layout.json, from DeepSeek-V4-Flash's public facts
    audit_layouts  the GLM-5.2 and Ornith layout fixtures
    audits         the `dgr plan` output and tables pasted in the model audits
    ranges         spec/layer-ranges.md, from llama_arch and docs/perf/certify/results.json
    readme         README.md's performance block, from docs/perf/current/results.json
    files          the table of every generated file; `python -m dgr.specgen` writes them
"""

__all__: list[str] = []
