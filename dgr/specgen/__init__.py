"""The one spec generator: every generated file in spec/ and tests/fixtures/, drawn from the code.

    protocol       spec/states.md, reasons.md, seam.md, whole, from the FSM, error and wire tables
    artifact       the tables block of spec/artifact-manifest.md
    dsv4_layout    tests/fixtures/deepseek-v4-flash.layout.json, from DeepSeek-V4-Flash's public facts
    audit_layouts  the GLM-5.2 and Ornith layout fixtures
    audits         the `dgr plan` output and tables pasted in the model audits
    files          the table of every generated file; `python -m dgr.specgen` writes them
"""

__all__: list[str] = []
