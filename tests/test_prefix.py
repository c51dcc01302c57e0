"""Prefix reuse: the node's cache (pure), and routes that reuse it (in-process stub nodes, real code paths)."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import trio

from dgr.api.openai import parse_request
from dgr.errors import CallerError, Failure, Reason
from dgr.node.membership import heartbeat_body
from dgr.node.prefix import Kept, PrefixCache
from dgr.seam.keys import BLOCK_TOKENS, MARK_BYTES, MAX_ADVERTISED, block_chain, prefix_root, token_marks, valid_chain
from dgr.node.snapshot import SNAPSHOT_MAX_MB, SnapshotDir, check
from dgr.testing.inproc import InProcRoute
from dgr.tracker.gateway import GatewayConfig
from dgr.tracker.live import pipeline_chunk
from dgr.tracker.routing import choose_route

QUIET = GatewayConfig(sweep_s=3600.0)
B = BLOCK_TOKENS
SECRET = b"the tracker's prefix secret"  # what dgr.tracker.run derives from the tracker's identity

# -- the hash chain ------------------------------------------------------------------------------------------


def test_chain_keys_name_whole_blocks_and_agree_exactly_on_shared_prefixes() -> None:
    root = prefix_root("digest", "", SECRET)
    a = list(range(5 * B + 7))
    b = a[: 3 * B] + [9] + a[3 * B + 1 :]
    ka, kb = block_chain(a, root), block_chain(b, root)
    assert len(ka) == 5 and valid_chain(ka, 5)  # the partial last block has no key
    assert ka[:3] == kb[:3] and all(x != y for x, y in zip(ka[3:], kb[3:]))  # one token changes every later key
    assert block_chain(a[: 2 * B], root) == ka[:2]
    # the root isolates models and scopes
    assert block_chain(a, prefix_root("digest", "key1", SECRET))[0] != ka[0]
    assert block_chain(a, prefix_root("other", "", SECRET))[0] != ka[0]
    assert not valid_chain(["XYZ"], 5) and not valid_chain(ka, 4) and not valid_chain("ab", 5)


def test_marks_name_every_token_before_them_and_a_block_s_last_begins_its_key() -> None:
    root = prefix_root("d", "", SECRET)
    a = list(range(2 * B + 10))
    b = a[: B + 20] + [7] + a[B + 21 :]
    ma, mb = token_marks(a, root), token_marks(b, root)
    assert len(ma) == len(a) * MARK_BYTES
    at = [ma[i * MARK_BYTES : (i + 1) * MARK_BYTES] == mb[i * MARK_BYTES : (i + 1) * MARK_BYTES] for i in range(len(a))]
    assert at == [True] * (B + 20) + [False] * (len(a) - B - 20)  # from the first difference on, every mark differs
    chain = block_chain(a, root)
    assert [ma[(i + 1) * B * MARK_BYTES - MARK_BYTES : (i + 1) * B * MARK_BYTES].hex() for i in range(2)] == [
        k[: 2 * MARK_BYTES] for k in chain]


def test_match_is_exact_to_the_token_where_both_sides_name_the_positions() -> None:
    root = prefix_root("d", "", SECRET)
    kept_tokens = list(range(B + 40))
    chain, marks = block_chain(kept_tokens, root), token_marks(kept_tokens, root)
    c = PrefixCache()
    k = Kept(c.new_id(), tuple(chain), 10, head=marks[: (B + 30) * MARK_BYTES], tail=marks[B * MARK_BYTES :])
    assert k.positions == B + 40 and c.add(k) == []
    # a prompt sharing 1 block and 25 tokens, offered with its marks: reused to the token
    prompt = kept_tokens[: B + 25] + [999] * 50
    assert c.match(block_chain(prompt, root), token_marks(prompt, root)) == (k, B + 25)
    # sharing 30 tokens of block 0 only: the entry's head names them
    prompt = kept_tokens[:30] + [999] * 90
    assert c.match(block_chain(prompt, root), token_marks(prompt, root)) == (k, 30)
    # without marks: whole blocks, as before
    assert c.match(block_chain(kept_tokens + [5] * B, root)) == (k, B)
    # a prompt that extends all of it supersedes it once kept
    longer = kept_tokens + [5] * 100
    lm = token_marks(longer, root)
    lc = block_chain(longer, root)
    newer = Kept(c.new_id(), tuple(lc), 10, head=lm, tail=lm[len(lc) * B * MARK_BYTES :])
    assert c.add(newer) == [k.id]


def test_a_node_names_a_bounded_number_of_kept_prefixes() -> None:
    root = prefix_root("d", "", SECRET)
    c = PrefixCache()
    entries = [Kept(c.new_id(), tuple(block_chain([i, i + 1] * B, root)), 1) for i in range(MAX_ADVERTISED + 40)]
    for e in entries:
        c.add(e)
    named = c.advertised()
    assert len(named) == MAX_ADVERTISED and named[0] == entries[-1].chain[-1]  # the most recently used first
    c.match(entries[0].chain)
    assert c.advertised()[0] == entries[0].chain[-1]


async def test_heartbeats_name_the_kept_prefixes_within_a_bound(nursery) -> None:
    route = InProcRoute.stub(config=QUIET)
    route.register_all()
    await nursery.start(route.run)
    node = route.services[0]
    root = prefix_root("d", "", SECRET)
    for i in range(MAX_ADVERTISED + 40):  # bookkeeping only: what a heartbeat reads
        node.prefix.add(Kept(node.prefix.new_id(), tuple(block_chain([i, i + 1] * B, root)), 1))
    body = heartbeat_body(node)
    assert len(body["prefixes"]) == MAX_ADVERTISED and len(json.dumps(body["prefixes"])) <= 9 * 1024  # 36 bytes a key
    assert route.heartbeat(0).prefixes == frozenset(body["prefixes"])
    key = node.identity.public
    for bad in (body["prefixes"] + ["0" * 32], ["XYZ"], "abc"):
        with pytest.raises(CallerError) as err:
            route.registry.heartbeat({**body, "prefixes": bad}, trio.current_time(), key=key)
        assert err.value.reason is Reason.INVALID_REQUEST
    # the most recently used are named: the 40 oldest are not
    last, named = MAX_ADVERTISED + 39, route.registry.nodes[node.node_id].prefixes
    assert block_chain([3, 4] * B, root)[-1] not in named and block_chain([last, last + 1] * B, root)[-1] in named


# -- the cache's bookkeeping ---------------------------------------------------------------------------------


def _kept(cache: PrefixCache, chain: list[str]) -> Kept:
    return Kept(cache.new_id(), tuple(chain), len(chain) * 10)


def test_match_finds_the_longest_prefix_and_a_longer_turn_supersedes_its_own_earlier_one() -> None:
    root = prefix_root("d", "", SECRET)
    conv = block_chain(list(range(6 * B)), root)
    other = block_chain(list(range(2 * B)) + [7] * (3 * B), root)  # shares two blocks with conv
    c = PrefixCache()
    t1 = _kept(c, conv[:3])
    assert c.add(t1) == []
    assert c.match(conv) == (t1, 3 * B) and c.hits == 1
    assert c.match(block_chain([5] * B, root)) == (None, 0) and c.misses == 1
    t2 = _kept(c, conv[:5])
    assert c.add(t2) == [t1.id] and c.superseded == 1  # the same conversation, one turn later
    o = _kept(c, other)
    assert c.add(o) == []  # a branch, not a continuation: both stay
    assert c.match(other[:2] + ["0" * 32]) == (o, 2 * B)  # most recently used of the two holding 2 blocks
    assert c.match(conv) == (t2, 5 * B)
    assert c.reused_tokens == (3 + 2 + 5) * B


def test_lru_eviction_and_the_byte_budget() -> None:
    root = prefix_root("d", "", SECRET)
    chains = [block_chain([i] * (2 * B), root) for i in range(4)]
    c = PrefixCache(max_bytes=50)
    ids = [_kept(c, ch) for ch in chains]
    assert c.add(ids[0]) == [] and c.add(ids[1]) == []
    c.match(chains[0])  # 0 is now the most recent
    assert c.add(ids[2]) == [ids[1].id] and c.evictions == 1  # 60 bytes > 50: the least recent goes
    assert c.evict() == ids[0].id and list(c.entries) == [ids[2].id]
    assert c.match(chains[1]) == (None, 0)  # evicted keys are gone from the index
    big = Kept(c.new_id(), tuple(chains[3]), 500)
    assert big.id in c.add(big)  # larger than the whole budget: not kept at all
    assert c.nbytes <= 50


def test_random_operations_keep_the_index_consistent() -> None:
    rng = random.Random(17)
    root = prefix_root("d", "", SECRET)
    c = PrefixCache(max_bytes=200)
    for _ in range(500):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 5) * B)]
        chain = block_chain(tokens, root)
        op = rng.random()
        if op < 0.5:
            c.add(_kept(c, chain))
        elif op < 0.8:
            kept, n = c.match(chain)
            assert (kept is None) == (n == 0) and n % B == 0  # no marks offered: whole blocks only
            if kept is not None:
                assert kept.chain[n // B - 1] == chain[n // B - 1]
        elif c.entries:
            c.evict()
        assert c.nbytes <= 200
        live_keys = {k for e in c.entries.values() for k in e.chain}
        assert set(c._index) == live_keys


# -- routes that reuse --------------------------------------------------------------------------------------

SYSTEM = "You answer in one line. " * 12  # ~290 stub tokens: four whole blocks


def _req(prompt: str, max_tokens: int = 24):
    return parse_request({"model": "stub", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens},
                         "completion")


async def _ask(route: InProcRoute, prompt: str, scope: str = "k1", max_tokens: int = 24):
    live = await route.gateway.open(_req(prompt, max_tokens), scope=scope)
    text = "".join([d.text async for d in live.recv])
    return text, live


async def _chat(route: InProcRoute, turns: int, scope: str = "k1", tag: str = "",
                kept: list[tuple[int, int]] | None = None) -> list[tuple[str, int]]:
    """A conversation: each turn's prompt is the last prompt, its answer and a new question.

    `kept` gets each turn's (prompt tokens, answer tokens fed into the KV).
    """
    prompt, out = SYSTEM + tag, []
    for t in range(turns):
        prompt += f" Q{t}: what next?"
        text, live = await _ask(route, prompt, scope)
        out.append((text, live.rs.prefix_reused))
        if kept is not None:
            kept.append((len(live.prompt), len(live.fed)))
        prompt += text
    return out


def _settled(route: InProcRoute) -> None:
    for s in route.services:
        assert s.sessions == {} and s.backend.session_count() == 0 and s.backend.kv_bytes() == 0


@pytest.mark.parametrize("generated", [False, True], ids=["prompt-kept", "generated-kept"])
async def test_a_conversation_reuses_its_prefix_and_answers_as_without(nursery, generated: bool) -> None:
    off = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, prefix_reuse=False))
    on = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, prefix_keep_generated=generated))
    for r in (off, on):
        r.register_all()
        await nursery.start(r.run)
    plain = await _chat(off, 4)
    kept: list[tuple[int, int]] = []
    reused = await _chat(on, 4, kept=kept)
    assert [t for t, _ in reused] == [t for t, _ in plain]
    assert [n for _, n in plain] == [0, 0, 0, 0]
    # turn 2 on reuses, to the token, every position turn 1 computed: its prompt, and its answer but the
    # last token sampled (never in the KV) where answers are kept; never the last prompt token
    want = [0] + [p + (fed if generated else 0) for p, fed in kept[:-1]]
    assert [n for _, n in reused] == want and all(n < p for n, (p, _) in zip(want, kept))
    assert any(n % B for n in want[1:])  # not whole blocks: what block reuse would have recomputed
    _settled(on)  # live-session KV accounting is back to zero; kept prefixes are reported apart
    for s in on.services:
        st = s.status()["prefix"]
        # each turn took the last one's KV over (its prompt extends all of it), and left a longer one
        assert st["entries"] == 1 and st["bytes"] > 0 and st["hits"] == 3 and st["superseded"] == 0
        assert s.backend.prefix_bytes() == st["bytes"]
    # the head computed only what it did not reuse
    head = on.services[0]
    chunks = [-(-(p - n) // pipeline_chunk(p - n, 512, len(on.services))) for (_, n), (p, _) in zip(reused, kept)]
    assert chunks[1:] == [1, 1, 1]  # a turn after the first: its new positions, one chunk
    assert head.stats.frames_in["PREFILL"] == sum(chunks)


async def test_reuse_is_exact_to_the_token_and_never_takes_the_last_prompt_token(nursery) -> None:
    off = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, prefix_reuse=False))
    on = InProcRoute.stub(config=QUIET)
    for r in (off, on):
        r.register_all()
        await nursery.start(r.run)
    base = SYSTEM[: 2 * B + 21]  # a shared prefix that ends mid-block
    prompts = [base + "Who?", base + "Why?", base + "Why?", (base + "Why?")[:-1]]
    reused = []
    for prompt in prompts:
        want, _ = await _ask(off, prompt)
        got, live = await _ask(on, prompt)
        assert got == want
        reused.append(live.rs.prefix_reused)
    # "Why?" shares the prefix and "Wh" with "Who?"; the same prompt again reuses all but its last two tokens
    # (the last gives the first answer token; a lone position would run on other kernels); so does a prompt
    # that is all kept
    n = len(base)
    assert reused == [0, n + 2, n + 4 - 2, n + 3 - 2]
    _settled(on)


async def test_usage_and_telemetry_report_the_reused_tokens(nursery) -> None:
    route = InProcRoute.stub(config=QUIET)
    route.register_all()
    await nursery.start(route.run)
    text, first = await _ask(route, SYSTEM)
    assert first.usage()["prompt_tokens_details"] == {"cached_tokens": 0}
    _, second = await _ask(route, SYSTEM + text + " and?")
    cached = second.usage()["prompt_tokens_details"]["cached_tokens"]
    assert cached == second.rs.prefix_reused > 0
    snap = second.telemetry.latest
    assert snap["prefix_reused_tokens"] == cached and snap["prefill"]["total"] == len(SYSTEM + text + " and?")


async def test_another_api_key_does_not_reuse_unless_the_tracker_shares(nursery) -> None:
    route = InProcRoute.stub(config=QUIET)
    shared = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, share_prefixes=True))
    for r in (route, shared):
        r.register_all()
        await nursery.start(r.run)
        await _ask(r, SYSTEM, scope="alice")
    _, live = await _ask(route, SYSTEM + " again", scope="bob")
    assert live.rs.prefix_reused == 0
    _, live = await _ask(route, SYSTEM + " again", scope="alice")
    assert live.rs.prefix_reused > 0
    _, live = await _ask(shared, SYSTEM + " again", scope="bob")
    assert live.rs.prefix_reused > 0


async def test_nodes_holding_different_lengths_reuse_the_shortest(nursery) -> None:
    on = InProcRoute.stub(config=QUIET)
    off = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, prefix_reuse=False))
    for r in (on, off):
        r.register_all()
        await nursery.start(r.run)
    text, _ = await _ask(on, SYSTEM)
    # the tail forgets its prefix; the head keeps it, and also learns a shorter one from another scope-mate
    tail = on.services[1]
    await tail.scheduler.call(lambda: [tail.backend.drop_prefix(tail.prefix.evict()) for _ in range(1)])
    # both nodes now hold 2 blocks and 7 tokens of it (" o" of " other" is also SYSTEM's next), the head 4 as well
    await _ask(on, SYSTEM[: 2 * B + 5] + " other")
    assert SYSTEM[2 * B + 5 : 2 * B + 8] == " on"  # and " other" goes on " ot"
    want, _ = await _ask(off, SYSTEM + text + " next")
    got, live = await _ask(on, SYSTEM + text + " next")
    assert live.rs.prefix_reused == 2 * B + 7  # the head held more and dropped the rest before the first step
    assert got == want
    _settled(on)


async def test_kept_prefixes_never_refuse_a_live_session(nursery) -> None:
    """Capacity 3 per node, 8 concurrent conversations over 3 turns: prefixes are evicted, never a 429."""
    route = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, admission_wait_s=60.0), capacity=3)
    route.register_all()
    await nursery.start(route.run)
    results: dict[int, list] = {}

    async def conv(i: int) -> None:
        results[i] = await _chat(route, 3, scope=f"user{i}", tag=f" #{i}")

    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(conv, i)
    assert len(results) == 8
    _settled(route)
    for s in route.services:
        assert len(s.prefix.entries) <= 3 and s.backend.free_slots() + len(s.prefix.entries) == 3
        assert s.prefix.evictions > 0
        assert s.stats.refused.get(Reason.NODE_AT_CAPACITY.value, 0) == 0
    assert route.gateway.metrics.failure_counts() == {}


async def test_a_failed_session_keeps_nothing(nursery) -> None:
    route = InProcRoute.stub(config=QUIET)
    route.register_all()
    await nursery.start(route.run)
    live = await route.gateway.open(_req(SYSTEM, 200), scope="k")
    async for _ in live.recv:
        live.abort(Failure(Reason.CANCELLED, "the client went away"))
        break
    async for _ in live.recv:
        pass
    with trio.fail_after(5):
        while route.services[0].sessions or route.services[1].sessions:
            await trio.sleep(0.01)
    assert live.rs.failure is not None
    _settled(route)
    assert all(len(s.prefix.entries) == 0 for s in route.services)


async def test_the_route_that_kept_a_prefix_is_preferred(nursery) -> None:
    """Two routes of the same layers: turn 2 goes back to the route that kept turn 1, though the default
    rule (routes take turns: dgr.tracker.routing) would pick the other."""
    route = InProcRoute.stub(splits=((0, 15), (15, 30), (0, 15), (15, 30)), config=QUIET)
    route.register(2)
    route.register(3)
    await nursery.start(route.run)
    text, first = await _ask(route, SYSTEM)
    assert [h.node_id for h in first.rs.route] == ["n2", "n3"]
    route.register(0)
    route.register(1)
    _, other = await _ask(route, SYSTEM + text + " next", scope="someone else")  # another scope's: no reuse
    assert [h.node_id for h in other.rs.route] == ["n2", "n3"] and other.rs.prefix_reused == 0
    # n2 and n3 were routed last, so the turn would go to n0 and n1 but for the prefix n2 and n3 kept
    assert choose_route(list(route.registry.nodes.values()), "stub").hops[0].node_id == "n0"
    _, second = await _ask(route, SYSTEM + text + " next")
    assert [h.node_id for h in second.rs.route] == ["n2", "n3"] and second.rs.prefix_reused >= 4 * B
    assert all(n.reserved == 0 for n in route.registry.nodes.values())


# -- Prefix Snapshots ---------------------------------------------------------------------------------------


def _with_snapshots(folder, config=QUIET, max_bytes: int | None = SNAPSHOT_MAX_MB * 2**20) -> InProcRoute:
    """A fresh in-process route (a restart) whose nodes keep snapshots under `folder`/n0, n1, and whose tracker
    keeps its prefix secret (it derives it from its identity, dgr.tracker.run)."""
    route = InProcRoute.stub(config=config)
    route.gateway.admission.prefix_secret = SECRET
    for s in route.services:
        b = s.backend
        s.snapshots = SnapshotDir(folder / s.node_id, {"model_digest": b.info.digest, "manifest_id": None,
                                                      "backend": b.name, "layers": str(b.layers)},
                                  max_bytes=max_bytes)
    route.register_all()
    return route


async def test_a_restarted_route_reloads_its_snapshots_and_skips_the_system_prompt(nursery, tmp_path) -> None:
    first = _with_snapshots(tmp_path)
    await nursery.start(first.run)
    text, _ = await _ask(first, SYSTEM)
    for s in first.services:
        assert s.snapshots.written == 1 and len(list((tmp_path / s.node_id).glob("*.kv"))) == 1
    # a restart: new processes, nothing in memory, the same folders
    again = _with_snapshots(tmp_path)
    await nursery.start(again.run)
    for i, s in enumerate(again.services):
        assert s.snapshots.loaded == 1 and s.snapshots.refused == [] and len(s.prefix.entries) == 1
        again.heartbeat(i)  # naming what it reloaded: only the tracker judges whether a head may hold a prefix
    plain = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, prefix_reuse=False))
    plain.register_all()
    await nursery.start(plain.run)
    want, _ = await _ask(plain, SYSTEM + text + " next")
    got, live = await _ask(again, SYSTEM + text + " next")
    assert live.rs.prefix_reused >= 4 * B and got == want
    assert again.services[0].stats.frames_in["PREFILL"] == 1  # one chunk: the system prompt was not sent again


@pytest.mark.parametrize("damage", ["bytes", "layers", "model"])
async def test_a_tampered_or_foreign_snapshot_is_refused(nursery, tmp_path, damage: str) -> None:
    first = _with_snapshots(tmp_path)
    await nursery.start(first.run)
    await _ask(first, SYSTEM)
    folder = tmp_path / "n1"
    kv, = folder.glob("*.kv")
    manifest = kv.with_suffix(".json")
    if damage == "bytes":
        data = bytearray(kv.read_bytes())
        data[len(data) // 2] ^= 1
        kv.write_bytes(bytes(data))
    else:
        meta = json.loads(manifest.read_text())
        meta["layers" if damage == "layers" else "model_digest"] = "0:15" if damage == "layers" else "0" * 64
        manifest.write_text(json.dumps(meta))
    again = _with_snapshots(tmp_path)
    await nursery.start(again.run)
    tail = again.services[1]
    assert tail.snapshots.loaded == 0 and len(tail.prefix.entries) == 0
    refused, = tail.snapshots.refused
    assert refused["code"] == Reason.SNAPSHOT_MISMATCH.value
    assert {"bytes": "sha256", "layers": "layers", "model": "model_digest"}[damage] in refused["message"]
    assert tail.status()["snapshots"]["refused"] == [refused]
    _, live = await _ask(again, SYSTEM + " next")
    assert live.rs.prefix_reused == 0  # the head holds it, the tail does not: the route reuses nothing


def test_check_refuses_what_does_not_match() -> None:
    own = {"model_digest": "d", "manifest_id": None, "backend": "stub", "layers": "0:15"}
    chain = block_chain(list(range(B)), prefix_root("d", "", SECRET))
    data = b"kv"
    meta = {"schema": 1, **own, "chain": chain, "positions": B, "bytes": 2,
            "sha256": hashlib.sha256(data).hexdigest()}
    assert check(meta, data, own).chain == tuple(chain)
    for bad in ({**meta, "schema": 2}, {**meta, "positions": 2 * B}, {**meta, "backend": "llama"},
                {**meta, "chain": ["zz"]}, {**meta, "bytes": 3}):
        with pytest.raises(CallerError) as err:
            check(bad, data, own)
        assert err.value.reason is Reason.SNAPSHOT_MISMATCH


def test_snapshots_are_private_and_never_follow_a_planted_link(tmp_path) -> None:
    """Issue 40, snapshots on disk: the folder is 0700 and its files 0600; a symlink planted where the
    temporary file goes is replaced, not written through; a folder that others can write is refused for
    writing and loading; at start only manifests are read, the KV bytes when a snapshot is loaded."""
    import os
    import stat

    own = {"model_digest": "d", "manifest_id": None, "backend": "stub", "layers": "0:15"}
    chain = tuple(block_chain(list(range(B)), prefix_root("d", "", SECRET)))
    folder = tmp_path / "snaps"
    snaps = SnapshotDir(folder, own)
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    folder.mkdir(mode=0o700)
    os.symlink(victim, folder / f"{chain[-1]}.kv.tmp")
    snaps.write(chain, b"kv bytes")
    assert victim.read_text() == "untouched"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for f in folder.iterdir():
        assert stat.S_IMODE(f.lstat().st_mode) == 0o600 and not f.is_symlink(), f
    # only manifests are read at start: a changed KV file is found when that snapshot is loaded
    (folder / f"{chain[-1]}.kv").write_bytes(b"changed!")
    (found,) = SnapshotDir(folder, own).scan()
    with pytest.raises(CallerError) as err:
        found.read()
    assert err.value.reason is Reason.SNAPSHOT_MISMATCH
    # a folder others can write: nothing loaded from it, nothing written to it
    folder.chmod(0o777)
    shared = SnapshotDir(folder, own)
    assert shared.scan() == [] and "no one else" in shared.refused[0]["message"]
    with pytest.raises(PermissionError):
        shared.write(chain, b"kv bytes")


def _disk(folder) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


async def test_the_snapshot_folder_stays_within_its_budget_least_recently_used_first(nursery, tmp_path) -> None:
    """Issue 40, snapshots on disk: distinct conversations filled the folder without bound. With a budget,
    the least recently used snapshots are deleted before a new one is written, the files together never
    exceed it, a snapshot larger than the whole budget is not written, and a restart under a lower budget
    trims the folder at once."""
    probe = _with_snapshots(tmp_path / "probe")
    await nursery.start(probe.run)
    await _ask(probe, SYSTEM + " prompt 0")
    size = _disk(tmp_path / "probe" / "n1")  # one stub snapshot, manifest and KV
    budget = 3 * size + size // 2  # room for 3
    route = _with_snapshots(tmp_path / "snaps", max_bytes=budget)
    await nursery.start(route.run)
    tail = route.services[1]
    folder = tmp_path / "snaps" / "n1"
    names = []
    for i in range(6):
        await _ask(route, SYSTEM + f" prompt {i}", scope=f"caller {i}")  # 6 conversations, no shared prefix
        assert _disk(folder) <= budget
        names.append(next(reversed(tail.snapshots.sizes)))
        if i == 2:  # the first conversation again: it is used, so the second is the next to go
            await _ask(route, SYSTEM + " prompt 0", scope="caller 0")
        if i == 3:
            assert (folder / f"{names[0]}.json").exists() and not (folder / f"{names[1]}.json").exists()
    on_disk = {f.stem for f in folder.glob("*.json")}
    assert len(on_disk) == 3 and tail.snapshots.evicted == 3
    assert on_disk == set(names[3:]), "the three used last are kept"
    assert len(set(names)) == 6
    assert tail.status()["snapshots"]["disk_bytes"] == _disk(folder) <= budget
    # too large for the whole budget: not written, nothing evicted for it
    tiny = _with_snapshots(tmp_path / "tiny", max_bytes=size // 2)
    await nursery.start(tiny.run)
    await _ask(tiny, SYSTEM + " prompt 0")
    assert tiny.services[1].snapshots.too_large == 1 and list((tmp_path / "tiny" / "n1").iterdir()) == []
    # a restart with a budget for one: the two least recently used go before anything is loaded
    again = _with_snapshots(tmp_path / "snaps", max_bytes=size + size // 2)
    await nursery.start(again.run)
    assert {f.stem for f in folder.glob("*.json")} == {names[5]} and _disk(folder) <= size + size // 2
    assert again.services[1].snapshots.loaded == 1 and again.services[1].snapshots.evicted == 2


async def test_a_manifest_claiming_more_positions_than_its_bytes_hold_is_refused_and_deleted(nursery,
                                                                                         tmp_path) -> None:
    """Issue 40, snapshots on disk: positions are checked against the data. A manifest rewritten to claim
    one block more than its KV holds (chain, positions, name and digest all consistent) is refused and its
    files deleted, never loaded into a slot; so is one whose KV file is not the size it names."""
    first = _with_snapshots(tmp_path)
    await nursery.start(first.run)
    await _ask(first, SYSTEM)
    await _ask(first, SYSTEM + " and something else entirely", scope="other")
    folder = tmp_path / "n1"
    longer, shorter = sorted(folder.glob("*.json"), key=lambda p: -len(json.loads(p.read_text())["chain"]))
    meta = json.loads(shorter.read_text())
    forged = "f" * len(meta["chain"][-1])
    meta["chain"].append(forged)
    meta["positions"] += B
    (folder / f"{forged}.json").write_text(json.dumps(meta))
    (folder / f"{forged}.json").chmod(0o600)
    shorter.with_suffix(".kv").rename(folder / f"{forged}.kv")
    shorter.unlink()
    grown = json.loads(longer.read_text())  # the other one names a size its KV file does not have
    longer.with_suffix(".kv").write_bytes(longer.with_suffix(".kv").read_bytes() + b"x")
    again = _with_snapshots(tmp_path)
    await nursery.start(again.run)
    tail = again.services[1]
    assert tail.snapshots.loaded == 0 and len(tail.prefix.entries) == 0 and tail.backend.prefix_bytes() == 0
    assert tail.snapshots.deleted == 2 and list(folder.iterdir()) == []
    said = {r["file"]: r["message"] for r in tail.snapshots.refused}
    assert f"holds {meta['positions'] - B} positions, its manifest claims {meta['positions']}" in said[f"{forged}.json"]
    assert f"holds {grown['bytes'] + 1} bytes" in said[longer.name]


def test_prefix_exact_keeps_prompts_only_from_dgr_up_and_dgr_tracker() -> None:
    from dgr.cli import build_parser
    from dgr.up import tracker_args

    assert GatewayConfig().prefix_keep_generated  # answers are kept by default, as llama-server's cache_prompt does
    up = build_parser().parse_args(["up", "--prefix-exact"])
    assert "--prefix-exact" in tracker_args(up)
    assert "--prefix-exact" not in tracker_args(build_parser().parse_args(["up"]))
    assert build_parser().parse_args(["tracker", "--prefix-exact"]).prefix_exact
