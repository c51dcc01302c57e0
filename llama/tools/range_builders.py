#!/usr/bin/env python3
"""Convert llama.cpp graph builders to layer ranges, and audit a tree for them.

dgr's patch series lets llama.cpp load and compute only the layers
[layer_start, layer_end) of a model.  Every graph builder in src/models/ must
then loop over [il_start, il_end) instead of [0, n_layer), and a range that
stops early must end its graph with the residual stream right after the layer
loop (build_range_output).  For most builders that is a two-line mechanical
edit (commit a65487c made it in 110 files by hand); this script makes it, so
that rebasing the series onto a newer llama.cpp does not mean redoing it by
hand, and checks that the architectures the series opts in
(llm_arch_supports_layer_range) really run a converted builder.

    range_builders.py convert SRC_DIR FILE...        # FILE: src/models/x.cpp
    range_builders.py convert SRC_DIR --group NAME   # a FAMILIES group
    range_builders.py check   SRC_DIR
    range_builders.py gate    SRC_DIR --group NAME   # case lines to paste

convert refuses, and writes nothing at all, when any file has a shape it does
not recognise, or is listed in HAND or NOT_CONVERTED; a converted file is left
as it is.  check exits 1 when an opted-in architecture's builder is not
converted, or when a file in src/models/ is neither converted nor listed in
NOT_CONVERTED.  A tree without the series (no gate function, unconverted
builders) is audited by the same rules and so fails: check passes only on a
tree that carries the series consistently.

Python 3.11, standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

MODELS = Path("src/models")

# The builders of opted-in architectures that take the mechanical edit alone (89),
# grouped by model family so that each group is one reviewable commit.
FAMILIES = {
    # dense decoders with RMSNorm blocks (llama-like)
    "llama-like": [
        "apertus.cpp", "arcee.cpp", "baichuan.cpp", "chatglm.cpp",
        "deci.cpp", "ernie4-5.cpp", "exaone.cpp", "exaone4.cpp",
        "granite.cpp", "granite-swa.cpp",
        "hunyuan-vl.cpp", "internlm2.cpp", "llama.cpp",
        "maincoder.cpp", "mellum.cpp", "mistral3.cpp", "nanbeige.cpp", "olmo2.cpp",
        "openelm.cpp", "paddleocr.cpp", "pangu-embed.cpp", "phi3.cpp", "plamo.cpp",
        "plamo3.cpp", "qwen.cpp", "qwen2.cpp", "qwen2vl.cpp", "qwen3.cpp",
        "refact.cpp", "seed-oss.cpp", "smollm3.cpp", "spark2-5.cpp", "xverse.cpp",
    ],
    # dense decoders with LayerNorm blocks (GPT-NeoX, Falcon, Phi-2, Cohere, ...)
    "gpt-like": [
        "cohere2.cpp", "command-r.cpp", "falcon.cpp", "gptneox.cpp", "jais.cpp",
        "jais2.cpp", "nemotron.cpp", "olmo.cpp", "orion.cpp", "phi2.cpp",
        "stablelm.cpp", "starcoder2.cpp",
    ],
    # mixture-of-experts decoders with ordinary attention
    "moe": [
        "arctic.cpp", "bailingmoe.cpp", "bailingmoe2.cpp", "cohere2moe.cpp",
        "dbrx.cpp", "dots1.cpp", "ernie4-5-moe.cpp", "exaone-moe.cpp", "grok.cpp",
        "grovemoe.cpp", "hunyuan-moe.cpp", "hy-v3.cpp", "laguna.cpp", "llama4.cpp",
        "maple.cpp", "mimo2.cpp", "minimax-m2.cpp", "minimax-m3.cpp", "olmoe.cpp",
        "openai-moe.cpp", "qwen2moe.cpp", "qwen3moe.cpp", "qwen3vlmoe.cpp",
        "smallthinker.cpp", "step35.cpp",
    ],
    # DeepSeek and the builders with its MLA / sparse (indexer) attention
    "deepseek-mla": [
        "deepseek.cpp", "deepseek2.cpp", "deepseek32.cpp", "dots3note.cpp",
        "glm-dsa.cpp", "plm.cpp",
    ],
    # recurrent and hybrid builders: their ranges carry recurrent state inputs
    "recurrent-hybrid": [
        "bailingmoe3.cpp", "falcon-h1.cpp", "granite-hybrid.cpp",
        "jamba.cpp", "kimi-linear.cpp", "lfm2.cpp", "mamba.cpp",
        "minimax-01.cpp", "nemotron-h.cpp", "plamo2.cpp", "qwen35.cpp",
        "qwen35moe.cpp", "qwen3next.cpp",
    ],
}

# Converted by a65487c with hand edits beyond the mechanical one (input scaling
# or position embeddings only on the first range, token-embedding reads, ...):
# convert must not touch them, as the mechanical edit alone would be wrong.
HAND = [
    "afmoe.cpp", "bitnet.cpp", "bloom.cpp", "codeshell.cpp", "gemma.cpp",
    "gemma2.cpp", "gemma3.cpp", "glm4.cpp", "glm4-moe.cpp", "gpt2.cpp",
    "minicpm3.cpp", "mpt.cpp", "muse-glimmer.cpp", "qwen3vl.cpp", "rwkv6.cpp",
    "starcoder.cpp",
]

# Files in src/models/ that the mechanical edit must not be applied to, and why.
_HC_SEAM = ("hyper-connection streams (hc_mult rows of n_embd per token): the "
            "seam between ranges is wider than one row of n_embd")
NOT_CONVERTED = {
    # converted by nothing: not opted in (dgr's certification found why, or the family is not a causal decoder)
    "arwkv7.cpp": "every layer reads the first layer's value (v_first): a second stream across every boundary",
    "rwkv7.cpp": "every layer reads the first layer's value (v_first): a second stream across every boundary",
    "kimi-k3.cpp": "its attention residuals bank earlier layers' inputs (resi_stack) for later layers: a growing second stream",
    "talkie.cpp": "every layer reads the input embedding again (embd_skip): a second stream across every boundary",
    "cogvlm.cpp": "picks the text or vision expert by whether the batch holds tokens, which a later range never does",
    "gemma3n.cpp": "its layers read per-layer token embeddings computed before the first layer, and share KV across the model",
    "gemma4.cpp": "its layers read per-layer token embeddings computed before the first layer",
    "granite-switch.cpp": "its input path picks adapter tokens before the first layer",
    "rwkv6qwen2.cpp": "its whole random model crashes at graph reserve, so no split can be compared with it",
    "chameleon.cpp": "half-implemented upstream (test-llama-archs skips it); not opted in",
    "pockettts.cpp": "a TTS model: not opted in",
    "bert.cpp": "an encoder (non-causal, pooled): not opted in",
    "eurobert.cpp": "an encoder (non-causal, pooled): not opted in",
    "modern-bert.cpp": "an encoder (non-causal, pooled); b11434 adds decision-head layers after its stack: not opted in",
    "neo-bert.cpp": "an encoder (non-causal, pooled): not opted in",
    "gemma-embedding.cpp": "an embedding model (non-causal, pooled): not opted in",
    "t5.cpp": "an encoder-decoder: the decoder's layers read the encoder's output",
    "dream.cpp": "a diffusion LM (non-causal decode): not opted in",
    "llada.cpp": "a diffusion LM (non-causal decode): not opted in",
    "llada-moe.cpp": "a diffusion LM (non-causal decode): not opted in",
    "rnd1.cpp": "a diffusion LM (non-causal decode): not opted in",
    # hyper-connection builders
    "deepseek4.cpp": _HC_SEAM + "; converted by hand with a wider seam in b6f7df6",
    "glm5-next.cpp": _HC_SEAM + "; needs the wider seam of b6f7df6",
    "hy-v4.cpp": _HC_SEAM + "; needs the wider seam of b6f7df6",
    "qwen4exp.cpp": _HC_SEAM + "; needs the wider seam of b6f7df6",
    # draft models
    "dflash.cpp": "draft model (DFlash) over the target's hidden states; its graphs "
                  "loop over n_layer twice (target-feature KV, then draft layers)",
    "eagle3.cpp": "draft model (EAGLE3) over the target's hidden states; no layer loop",
    "gemma4-assistant.cpp": "draft model for gemma4: its input is the target's hidden "
                            "state and it loops over n_layer_nextn, not a layer stack",
    # builders whose computation is not a single stack of layers
    "hrm-text.cpp": "HRM: two layer stacks re-applied over H/L cycles carrying two "
                    "states (zH, zL); a layer range is not a slice of the computation",
    "wavtokenizer-dec.cpp": "audio codec decoder (posnet and convnext blocks), no "
                            "transformer layer stack over n_layer",
    "clef.cpp": "decision model (b11434): qwen35 backbone feeding a decision head whose "
                "input_decision is built before the layer loop; not converted yet",
    "clip.cpp": "quant-only stub: build_arch_graph aborts (runtime is tools/mtmd)",
    # no graph of their own: they run another file's graph
    "deepseek2ocr.cpp": "no graph of its own: uses llama_model_deepseek2::graph",
    "granite-moe.cpp": "no graph of its own: uses llama_model_granite::graph",
    "hunyuan-dense.cpp": "no graph of its own: uses llama_model_hunyuan_vl::graph",
    "jina-bert-v2.cpp": "no graph of its own: uses llama_model_bert::graph",
    "jina-bert-v3.cpp": "no graph of its own: uses llama_model_bert::graph",
    "lfm2moe.cpp": "no graph of its own: uses llama_model_lfm2::graph<iswa>",
    "llama-embed.cpp": "no graph of its own: uses llama_model_llama::graph<embed>",
    "mamba2.cpp": "no graph of its own: uses llama_model_mamba::graph",
    "minicpm.cpp": "no graph of its own: uses llama_model_granite::graph",
    "mistral4.cpp": "no graph of its own: uses llama_model_deepseek2::graph",
    "nemotron-h-moe.cpp": "uses llama_model_nemotron_h::graph; this file only builds "
                          "the MTP head (graph_mtp), which has no layer loop",
    "nomic-bert.cpp": "no graph of its own: uses llama_model_bert::graph",
    "nomic-bert-moe.cpp": "no graph of its own: uses llama_model_bert::graph",
    "phimoe.cpp": "no graph of its own: uses llama_model_phi3::graph<iswa>",
    "qwen3tts.cpp": "no graph of its own: inherits llama_model_qwen3vl (hand-edited)",
    "t5encoder.cpp": "no graph of its own: uses llama_model_t5::graph<true>",
    # shared layer builders
    "delta-net-base.cpp": "helper base (llm_build_delta_net_base), no graph constructor",
    "mamba-base.cpp": "helper base (llm_build_mamba_base), no graph constructor",
    "rwkv6-base.cpp": "helper base (llm_build_rwkv6_base), no graph constructor",
    "rwkv7-base.cpp": "helper base (llm_build_rwkv7_base), no graph constructor",
}

# llm_arch_supports_layer_range() as a65487c left it (b6f7df6 adds DEEPSEEK4
# only).  Kept here because `gate` prints case lines for trees that lack it.
GATE_A65487C = """
    AFMOE APERTUS ARCEE ARCTIC BAICHUAN BAILINGMOE BAILINGMOE2 BAILINGMOE3 BITNET
    BLOOM CHATGLM CODESHELL COHERE2 COHERE2MOE COMMAND_R DBRX DECI DEEPSEEK
    DEEPSEEK2 DEEPSEEK32 DOTS1 DOTS3NOTE ERNIE4_5 ERNIE4_5_MOE EXAONE EXAONE_MOE
    EXAONE4 FALCON FALCON_H1 GEMMA GEMMA2 GEMMA3 GLM_DSA GLM4 GLM4_MOE OPENAI_MOE
    GPT2 GPTNEOX GRANITE GRANITE_SWA GRANITE_HYBRID GRANITE_MOE GROK GROVEMOE
    HUNYUAN_DENSE HUNYUAN_MOE HUNYUAN_VL HY_V3 INTERNLM2 JAIS JAIS2 JAMBA
    KIMI_LINEAR LAGUNA LFM2 LFM2MOE LLAMA LLAMA4 MAINCODER MAMBA MAMBA2 MAPLE
    MELLUM MIMO2 MINICPM MINICPM3 MINIMAX_01 MINIMAX_M2 MINIMAX_M3 MISTRAL3
    MISTRAL4 MPT MUSE_GLIMMER NANBEIGE NEMOTRON NEMOTRON_H NEMOTRON_H_MOE OLMO
    OLMO2 OLMOE OPENELM ORION PADDLEOCR PANGU_EMBED PHI2 PHI3 PHIMOE PLAMO PLAMO2
    PLAMO3 PLM QWEN QWEN2 QWEN2MOE QWEN2VL QWEN3 QWEN35 QWEN35MOE QWEN3MOE
    QWEN3NEXT QWEN3VL QWEN3VLMOE REFACT RWKV6 SEED_OSS SMALLTHINKER SMOLLM3
    SPARK2_5 STABLELM STARCODER STARCODER2 STEP35 XVERSE
""".split()

# The one loop form the 110 builders use, and what the edit makes of it.
LOOP_HEADER = "for (int il = 0; il < n_layer; ++il) {"
RANGE_HEADER = "for (int il = il_start; il < il_end; ++il) {"
RESIDUALS = ("inpL", "cur")  # the names the builders carry the residual stream in


class Refused(Exception):
    """A file whose shape convert does not recognise."""


# --------------------------------------------------------------------------
# C++ scanning: just enough to find functions, loops and their braces.


def mask_code(src: str) -> str:
    """Blank out comments and string/char literals, keeping every offset and
    newline, so that braces and names in them cannot mislead the scanning."""
    out = []
    i, n = 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif src.startswith('R"', i) and (m := re.match(r'R"([^(\s]*)\(', src[i:])):
            end = src.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
        elif src[i] in "\"'":
            j = i + 1
            while j < n and src[j] != src[i] and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(src[i] + re.sub(r"[^\n]", " ", src[i + 1:j - 1]) + src[j - 1])
            i = j
            continue
        else:
            out.append(src[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", src[i:j]))
        i = j
    return "".join(out)


def match_close(masked: str, open_at: int) -> int:
    """Index of the bracket closing the one at open_at."""
    pairs = {"{": "}", "(": ")"}
    opener, closer = masked[open_at], pairs[masked[open_at]]
    depth = 0
    for i in range(open_at, len(masked)):
        if masked[i] == opener:
            depth += 1
        elif masked[i] == closer:
            depth -= 1
            if depth == 0:
                return i
    raise Refused(f"unbalanced '{opener}' at offset {open_at}")


@dataclass
class Block:
    signature: str  # the code between the previous top-level block and '{'
    open: int
    close: int


def top_level_blocks(masked: str) -> list[Block]:
    """Every top-level braced body (functions, classes, initialisers)."""
    blocks, last, i = [], 0, 0
    while i < len(masked):
        c = masked[i]
        if c == "{":
            close = match_close(masked, i)
            blocks.append(Block(masked[last:i], i, close))
            i = last = close + 1
            continue
        if c == ";":
            last = i + 1
        i += 1
    return blocks


# llama_model_X[<..>]::graph_y[<..>]::name(  -- a member of a builder's graph class
GRAPH_MEMBER = re.compile(
    r"\bllama_model_(\w+)\s*::\s*(graph\w*)\s*(?:<[^<>]*>)?\s*::\s*(~?\w+)\s*\(")


@dataclass
class GraphFunction:
    owner: str  # X of llama_model_X
    graph: str  # the graph class: graph, graph_mtp, graph_dsv4, ...
    name: str  # the member function
    is_ctor: bool
    open: int
    close: int


def graph_functions(masked: str) -> list[GraphFunction]:
    """The member functions of graph classes: the code a layer range runs."""
    found = []
    for b in top_level_blocks(masked):
        m = None
        for m in GRAPH_MEMBER.finditer(b.signature):
            pass  # the last match is the function's own name
        if m:
            found.append(GraphFunction(m.group(1), m.group(2), m.group(3),
                                       m.group(2) == m.group(3), b.open, b.close))
    return found


@dataclass
class Loop:
    start: int  # offset of "for"
    init: str
    cond: str
    body_open: int | None  # None: a loop without braces
    body_close: int | None


def for_loops(masked: str, lo: int, hi: int) -> list[Loop]:
    """Every classic for loop starting in [lo, hi), nested ones included."""
    loops = []
    for m in re.finditer(r"\bfor\s*\(", masked[lo:hi]):
        start = lo + m.start()
        paren = lo + m.end() - 1
        header = masked[paren + 1:match_close(masked, paren)]
        parts = split_top(header, ";")
        if len(parts) != 3:
            continue  # range-based for
        after = match_close(masked, paren) + 1
        after += len(masked[after:]) - len(masked[after:].lstrip())
        braced = masked[after:after + 1] == "{"
        loops.append(Loop(start, parts[0].strip(), parts[1].strip(),
                          after if braced else None,
                          match_close(masked, after) if braced else None))
    return loops


def split_top(text: str, sep: str) -> list[str]:
    """Split on sep outside parentheses."""
    parts, depth, cur = [], 0, []
    for c in text:
        depth += (c in "([{") - (c in ")]}")
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    return parts + ["".join(cur)]


# A loop bounded by the model's layer count: n_layer or hparams.n_layer(),
# whatever its variable; n_layer_nextn, dec_n_layer, posnet.n_layer, ... are
# other stacks and do not count.
MODEL_LAYER_BOUND = re.compile(
    r"<\s*(?:\(\s*\w+\s*\)\s*)?(?:hparams\s*\.\s*)?n_layer\b(?:\s*\(\s*\))?\s*$")


def is_layer_loop(loop: Loop) -> bool:
    return bool(MODEL_LAYER_BOUND.search(loop.cond))


def is_range_loop(loop: Loop) -> bool:
    return (re.fullmatch(r"int\s+il\s*=\s*il_start", loop.init) is not None
            and re.fullmatch(r"il\s*<\s*il_end", loop.cond) is not None)


def depth_at(masked: str, lo: int, pos: int) -> int:
    """Brace depth at pos, counted from the brace at lo."""
    seg = masked[lo:pos]
    return seg.count("{") - seg.count("}")


def line_bounds(text: str, pos: int) -> tuple[int, int]:
    """Start and end (after the newline) of the line holding pos."""
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return start, len(text) if end < 0 else end + 1


# --------------------------------------------------------------------------
# convert


@dataclass
class Edit:
    at: int
    drop: int  # characters replaced
    text: str


def next_statement(masked: str, pos: int) -> str:
    """The code from pos up to the first ';', '{' or '}' outside parentheses
    (comments are already blank, so they are skipped)."""
    depth = 0
    for i in range(pos, len(masked)):
        depth += (masked[i] in "([") - (masked[i] in ")]")
        if depth == 0 and masked[i] in ";{}":
            return masked[pos:i + 1].strip()
    return masked[pos:].strip()


def carried_variable(masked: str, loop: Loop) -> str:
    """Which of inpL / cur holds the residual stream after the loop.

    The commit's rule: the variable the first statement after the loop reads
    (`cur = inpL;`, `build_norm(inpL, ...)`, lfm2's `build_norm(cur, ...)`),
    which the loop body must also assign (it is what the next layer reads)."""
    stmt = next_statement(masked, loop.body_close + 1)
    if not stmt.endswith(";") or re.match(r"(if|for|while|return)\b", stmt):
        raise Refused(f"the loop is followed by {stmt[:40]!r}, not a statement")
    assign = re.match(r"[\w:<>\s*&]*?\b\w+\s*=(?!=)", stmt)
    read = stmt[assign.end():] if assign else stmt
    names = [v for v in RESIDUALS if re.search(rf"\b{v}\b", read)]
    if len(names) != 1:
        raise Refused(f"cannot tell the residual variable from {stmt[:60]!r}")
    body = masked[loop.body_open:loop.body_close]
    if not re.search(rf"(?<![\w.>]){names[0]}\s*=(?!=)", body):
        raise Refused(f"the layer loop never assigns {names[0]}, read after it")
    return names[0]


def range_output_block(indent: str, var: str) -> str:
    return (f"{indent}if (build_range_output({var})) {{\n"
            f"{indent}    return;\n"
            f"{indent}}}\n")


def loop_edits(src: str, masked: str, loop: Loop) -> tuple[list[Edit], str]:
    """The two edits of one layer loop (its header, and the block after it),
    and the residual variable the block outputs."""
    hdr_lo, hdr_hi = line_bounds(src, loop.start)
    indent = src[hdr_lo:loop.start]
    if indent.strip() or src[loop.start:hdr_hi].rstrip("\n") != LOOP_HEADER:
        raise Refused(f"layer loop {src[hdr_lo:hdr_hi].strip()!r} is not the form "
                      f"{LOOP_HEADER!r}")
    close_lo, close_hi = line_bounds(src, loop.body_close)
    if src[close_lo:close_hi].rstrip("\n") != indent + "}":
        raise Refused("the layer loop's closing brace is not alone on its line")
    var = carried_variable(masked, loop)
    block = range_output_block(indent, var)
    # a65487c: one blank line before the block and one after; reuse a blank
    # line that already follows the loop
    blank_follows = src[close_hi:close_hi + 1] == "\n"
    block = "\n" + block + ("" if blank_follows else "\n")
    return [Edit(loop.start, len(LOOP_HEADER), RANGE_HEADER),
            Edit(close_hi, 0, block)], var


def ctor_loop(masked: str, fn: GraphFunction) -> Loop | None:
    """The one layer loop of a graph constructor, at its top level."""
    loops = [lp for lp in for_loops(masked, fn.open, fn.close)
             if is_layer_loop(lp) or is_range_loop(lp)]
    if not loops:
        return None
    if len(loops) > 1:
        raise Refused(f"{len(loops)} layer loops in llama_model_{fn.owner}::{fn.graph}")
    loop = loops[0]
    if depth_at(masked, fn.open, loop.start) != 1 or loop.body_open is None:
        raise Refused(f"the layer loop of llama_model_{fn.owner}::{fn.graph} is "
                      "nested or has no braces")
    return loop


def convert_source(src: str) -> tuple[str, list[str]]:
    """Return the converted source and the variables chosen (empty list: the
    source was already converted).  Raises Refused."""
    masked = mask_code(src)
    functions = graph_functions(masked)
    for fn in (f for f in functions if not f.is_ctor):
        for lp in for_loops(masked, fn.open, fn.close):
            if is_layer_loop(lp) or is_range_loop(lp):
                raise Refused(f"a loop over layers ({lp.init}; {lp.cond}) in the helper "
                              f"llama_model_{fn.owner}::{fn.graph}::{fn.name}")
    edits, chosen, seen = [], [], 0
    for fn in (f for f in functions if f.is_ctor):
        loop = ctor_loop(masked, fn)
        if loop is None:
            continue
        seen += 1
        calls = "build_range_output" in masked[fn.open:fn.close]
        if is_range_loop(loop):
            if not calls:
                raise Refused(f"llama_model_{fn.owner}::{fn.graph} loops over "
                              "il_start..il_end but lacks build_range_output")
            continue  # already converted
        if calls:
            raise Refused(f"llama_model_{fn.owner}::{fn.graph} calls build_range_output "
                          "but its loop is not converted")
        loop_edit, var = loop_edits(src, masked, loop)
        edits += loop_edit
        chosen.append(var)
    if not seen:
        raise Refused("no layer loop in any graph constructor")
    for e in sorted(edits, key=lambda e: e.at, reverse=True):
        src = src[:e.at] + e.text + src[e.at + e.drop:]
    return src, chosen


def excluded(rel: Path) -> str | None:
    """Why a file must not get the mechanical edit, if it must not."""
    if rel.parent != MODELS:
        return "not a builder in src/models/"
    if rel.name in HAND:
        return "needs hand edits beyond the mechanical one (listed in HAND)"
    if rel.name in NOT_CONVERTED:
        return "listed in NOT_CONVERTED: " + NOT_CONVERTED[rel.name]
    return None


def cmd_convert(args: argparse.Namespace) -> int:
    src_dir = Path(args.src_dir)
    rels = [MODELS / f for f in FAMILIES[args.group]] if args.group else []
    rels += [Path(f) for f in args.files]
    if not rels:
        sys.exit("convert: name FILEs or a --group")
    results, refused = {}, 0
    for rel in rels:
        try:
            if reason := excluded(rel):
                raise Refused(reason)
            src = (src_dir / rel).read_text()
            new, chosen = convert_source(src)
            results[rel] = (src, new)
            print(f"{'converted' if chosen else 'already converted'}: {rel}"
                  + (f" (build_range_output({', '.join(chosen)}))" if chosen else ""))
        except (Refused, OSError) as err:
            refused += 1
            print(f"refused: {rel}: {err}")
    if refused:
        print(f"{refused} file(s) refused: nothing written")
        return 1
    for rel, (src, new) in results.items():
        if new != src:
            (src_dir / rel).write_text(new)
    return 0


# --------------------------------------------------------------------------
# the tree: which builder each architecture runs, and its state


def function_body(masked: str, name_re: str) -> tuple[int, int] | None:
    for b in top_level_blocks(masked):
        if re.search(name_re, b.signature):
            return b.open, b.close
    return None


def arch_classes(src_dir: Path) -> dict[str, str]:
    """LLM_ARCH_X -> llama_model_y from llama_model_mapping's switch."""
    text = mask_code((src_dir / "src/llama-model.cpp").read_text())
    body = function_body(text, r"\bllama_model_mapping\s*\(")
    if body is None:
        sys.exit("no llama_model_mapping() in src/llama-model.cpp")
    mapping, pending = {}, []
    for m in re.finditer(r"case\s+LLM_ARCH_(\w+)\s*:|return\s+new\s+llama_model_(\w+)\s*\(",
                         text[body[0]:body[1]]):
        if m.group(1):
            pending.append(m.group(1))
        else:
            mapping.update((arch, m.group(2)) for arch in pending)
            pending = []
    return mapping


def gate_archs(src_dir: Path) -> list[str] | None:
    """The archs llm_arch_supports_layer_range() opts in; None without it."""
    text = mask_code((src_dir / "src/llama-arch.cpp").read_text())
    body = function_body(text, r"\bllm_arch_supports_layer_range\s*\(")
    if body is None:
        return None
    return re.findall(r"case\s+LLM_ARCH_(\w+)\s*:", text[body[0]:body[1]])


@dataclass
class ClassDecl:
    base: str | None  # y of llama_model_y it derives from, None for llama_model_base
    own_graph: bool
    alias: str | None  # y of `using graph = llama_model_y::graph...;`


def class_decls(src_dir: Path) -> dict[str, ClassDecl]:
    text = mask_code((src_dir / MODELS / "models.h").read_text())
    decls = {}
    for m in re.finditer(r"\bstruct\s+llama_model_(\w+)\s*(?::\s*public\s+llama_model_(\w+)\s*)?\{",
                         text):
        body = text[m.end() - 1:match_close(text, m.end() - 1)]
        alias = re.search(r"\busing\s+graph\s*=\s*llama_model_(\w+)\s*::", body)
        base = m.group(2) if m.group(2) != "base" else None
        decls[m.group(1)] = ClassDecl(base, re.search(r"\bstruct\s+graph\b", body) is not None,
                                      alias.group(1) if alias else None)
    return decls


def graph_owner(cls: str, decls: dict[str, ClassDecl]) -> str | None:
    """The class whose graph the model class builds: its own, an alias's, or
    (declaring none) its base class's."""
    for _ in range(len(decls)):
        d = decls.get(cls)
        if d is None:
            return None
        if d.own_graph:
            return cls
        nxt = d.alias or d.base
        if nxt is None:
            return None
        cls = nxt
    return None


@dataclass
class FileState:
    state: str  # converted | partial | not converted | no layer loop | no graph | unparsable
    ctors: set[str]  # X of every llama_model_X::graph ctor defined here
    classes: set[str]  # X of every llama_model_X whose members are defined here


def file_state(src: str) -> FileState:
    masked = mask_code(src)
    try:
        blocks = top_level_blocks(masked)
        functions = graph_functions(masked)
        state = loop_state(masked, functions)
    except Refused:  # unbalanced brackets: nothing can be said of it
        return FileState("unparsable", set(), set())
    ctors = {f.owner for f in functions if f.is_ctor and f.graph == "graph"}
    classes = set(re.findall(r"\bllama_model_(\w+)\s*::\s*(?:load_arch_hparams"
                             r"|load_arch_tensors|build_arch_graph)\s*\(",
                             "".join(b.signature for b in blocks)))
    return FileState(state, ctors, classes)


def loop_state(masked: str, functions: list[GraphFunction]) -> str:
    """How far the layer loops of a file's graph code are converted."""
    if not any(f.is_ctor for f in functions):
        return "no graph"
    ranged, incomplete, left = 0, 0, 0
    for fn in functions:
        for loop in for_loops(masked, fn.open, fn.close):
            if is_range_loop(loop):
                ranged += 1
                # a range that stops early must return right after its loop,
                # from the constructor that builds the graph
                after = masked[loop.body_close or loop.start:fn.close]
                incomplete += not fn.is_ctor or "build_range_output" not in after
            elif is_layer_loop(loop):
                left += 1
    if not ranged:
        return "not converted" if left else "no layer loop"
    return "partial" if left or incomplete else "converted"


@dataclass
class Tree:
    states: dict[str, FileState]  # every src/models/*.cpp
    classes: dict[str, str]  # LLM_ARCH_X -> y of llama_model_y
    builders: dict[str, str | None]  # LLM_ARCH_X -> file of the graph it runs


def read_tree(src_dir: Path) -> Tree:
    states = {p.name: file_state(p.read_text())
              for p in sorted((src_dir / MODELS).glob("*.cpp"))}
    classes = arch_classes(src_dir)
    decls = class_decls(src_dir)
    ctor_file = {owner: name for name, st in states.items() for owner in st.ctors}
    builders = {arch: ctor_file.get(graph_owner(cls, decls) or "")
                for arch, cls in classes.items()}
    return Tree(states, classes, builders)


def cmd_check(args: argparse.Namespace) -> int:
    tree = read_tree(Path(args.src_dir))
    gate = gate_archs(Path(args.src_dir))
    if gate is None:
        print("gate: no llm_arch_supports_layer_range() in src/llama-arch.cpp: no "
              "architecture is opted in (a tree without the layer-range series)")
        gate = []
    else:
        print(f"gate: llm_arch_supports_layer_range() opts in {len(gate)} architectures")
    print_table(tree, set(gate))
    problems = gate_problems(tree, gate) + file_problems(tree)
    for p in problems:
        print("FAIL: " + p)
    print("check: " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


def gate_problems(tree: Tree, gate: list[str]) -> list[str]:
    problems = []
    for arch in gate:
        name = tree.builders.get(arch)
        if name is None:
            problems.append(f"LLM_ARCH_{arch} is opted in but runs no graph builder found here")
        elif tree.states[name].state != "converted":
            problems.append(f"LLM_ARCH_{arch} is opted in but {name} is {tree.states[name].state}")
    return problems


def file_problems(tree: Tree) -> list[str]:
    problems = []
    for name, st in tree.states.items():
        if st.state == "partial":
            problems.append(f"{name} is partially converted")
        elif st.state != "converted" and name not in NOT_CONVERTED:
            problems.append(f"{name} is {st.state} and not listed in NOT_CONVERTED")
    return problems


def class_files(tree: Tree) -> dict[str, str]:
    """y -> the file defining llama_model_y's members; a class defining none
    (qwen3tts) goes to the file named after it."""
    found = {cls: name for name, st in tree.states.items() for cls in st.classes}
    for cls in tree.classes.values():
        if cls not in found and cls.replace("_", "-") + ".cpp" in tree.states:
            found[cls] = cls.replace("_", "-") + ".cpp"
    return found


def print_table(tree: Tree, gate: set[str]) -> None:
    """One row per file: its state, and the archs whose graph it builds or
    whose class it defines (with "->" to the file whose graph they run)."""
    class_file = class_files(tree)
    print(f"{'FILE':22} {'STATE':14} ARCHS (+ opted in, - not)")
    counts: dict[str, int] = {}
    for name, st in tree.states.items():
        counts[st.state] = counts.get(st.state, 0) + 1
        archs = sorted(a for a, cls in tree.classes.items()
                       if name in (tree.builders[a], class_file.get(cls)))
        marks = " ".join(("+" if a in gate else "-") + a
                         + ("" if tree.builders[a] in (name, None) else f"->{tree.builders[a]}")
                         for a in archs)
        listed = "  [NOT_CONVERTED]" if name in NOT_CONVERTED else ""
        print(f"{name:22} {st.state:14} {marks}{listed}")
    print("files: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    for name, st in tree.states.items():
        if st.state == "converted" and name in NOT_CONVERTED:
            print(f"note: {name} is converted (by hand) though listed in NOT_CONVERTED")


# --------------------------------------------------------------------------
# gate


def cmd_gate(args: argparse.Namespace) -> int:
    src_dir = Path(args.src_dir)
    files = set(HAND if args.group == "HAND" else FAMILIES[args.group])
    builders = read_tree(src_dir).builders
    archs = sorted(a for a, f in builders.items() if f in files and a in GATE_A65487C)
    for arch in archs:
        print(f"        case LLM_ARCH_{arch}:")
    if not archs:
        print(f"gate: no architecture of group {args.group} is in a65487c's gate", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    groups = sorted(FAMILIES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="apply the mechanical layer-range edit in place")
    p.add_argument("src_dir")
    p.add_argument("files", nargs="*", help="builder paths relative to SRC_DIR")
    p.add_argument("--group", choices=groups)
    p.set_defaults(run=cmd_convert)
    p = sub.add_parser("check", help="audit a tree's builders against its gate")
    p.add_argument("src_dir")
    p.set_defaults(run=cmd_check)
    p = sub.add_parser("gate", help="print the case lines of a group's opted-in archs")
    p.add_argument("src_dir")
    p.add_argument("--group", choices=groups + ["HAND"], required=True)
    p.set_defaults(run=cmd_gate)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
