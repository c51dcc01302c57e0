"""The node registry: who serves which layers of which model, and who is alive.

Pure bookkeeping with time passed in (the tracker passes `trio.current_time()`,
one clock, so tests drive it with trio's MockClock). A node is alive while
its last heartbeat is younger than `dead_after_s`; past that it is dead and
routes through it fail (the gateway watches `sweep`). A node that registers
again (it restarted) replaces its old entry and is alive again. A node dead
for `forget_after_s` is dropped (`forget`), so entries of nodes that never
come back do not pile up.

Everything here arrives from the network: dgr.tracker.registration reads
and checks every field of a registration or heartbeat (anything wrong is a
`CallerError(INVALID_REQUEST)`, 400, never a crash); this module decides
what a checked one may change.

Each node advertises `max_positions`, the positions per session it really
allocates (`--ctx`), which the gateway clamps Route Sessions to; and each
heartbeat lists the session ids the node holds, so the gateway can close
sessions it no longer knows of (see Gateway.reconcile). Registrations and
heartbeats also name the prefixes the node keeps (the last block key of
each, at most `MAX_PREFIXES`), which the gateway routes by, so
a restarted tracker still sends a conversation's next turn to its KV. A
node with accelerators names them in its heartbeats with their memory
(`devices`), kept as of the last one: the node listing and /metrics show
them; a heartbeat whose devices were dropped (malformed) says why in
`devices_dropped`, and the tracker logs it once per new reason. Each
registration names the node process's boot nonce (`NodeEntry.boot`), which
its credentials are bound to; a heartbeat naming another is answered as an
unknown node, so the node registers its new boot first.

Every entry belongs to the Ed25519 key that signed its registration
(dgr.security.auth). The first key to register a node id owns it for the
tracker's life, and an id derived from a key (`n-...`, see
dgr.security.identity) belongs to that key from the start: a registration
for an id under another key is refused with `identity_taken` and changes
nothing. A node that restarts with its key registers again and replaces its
entry. A chosen name (`node1`) is first come, first served, and is held only
while its entry is: once the entry is forgotten, another admitted key may
take the name. A derived id stays its key's forever, so it is the form to
use where that matters. The id `gateway` is the tracker's own and no node
may register it.

A heartbeat under an id the signing key does not own is refused as if the
id were unknown (`not_found`, 404, the same words): heartbeats need no join
token, so a different answer would let any stranger with a fresh key test
which ids exist. The tracker logs the truth.

With `require_tls` (--require-tls) a registration whose URL is not https://
is refused (FORBIDDEN), so the tracker never hands out a plain next hop;
with `encrypt` (the command line's default, off with --insecure) one whose
URL is plain http:// off loopback is. The seed address may stay plain
(dgr.security.tls says why).

A registration whose URL or seed address names a wildcard host (0.0.0.0,
::) is recorded with the source address the tracker saw it come from
instead, so a node bound to every interface is reachable at the address its
packets came from (`reachable`); the reply tells the node what was recorded. When that
source is loopback (the node reached the tracker at 127.0.0.1 on the
tracker's own machine), the node is recorded at a loopback address that
other machines cannot reach, and the tracker logs a warning: the node means
to serve other machines (it bound every interface) but will be routed, and
its pieces fetched, at an address only this machine reaches.

Routes take turns (dgr.tracker.routing): each entry counts the sessions
routed to it (`turns`), and one that registers starts level with the busiest
live node of its layers, so joining (or restarting) draws no burst.

A node's declared capacity is a claim: the tracker bounds it
(`max_node_sessions`) and routes to it at once only as many sessions as it
has been seen to carry (`NodeEntry.limit`, see PROVEN_START), so a node
cannot draw every session by declaring a million slots.

A node blamed for a late step (dgr.tracker.blame) gets a strike (`strike`):
each halves its limit and doubles its load as routing compares it, and
enough of them ban it (not `routable`) for a while. Its `Standing` is kept
by node id and key, apart from its entry, so registering again (a restart)
or being forgotten clears none of it; `sweep` expires strikes and lifts bans.

A node may claim a Model Artifact (a manifest id and, optionally, the
address it seeds it on). Each registration starts the claim's proof afresh:
PENDING until the tracker's challenges (dgr.tracker.proofs) pass or fail.
A node without a claim is UNCLAIMED, routable unless the registry requires
proofs, in which case it is FAILED at once. Only `routable` nodes are routed.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import attrs

from dgr.api.hosts import is_loopback, is_wildcard
from dgr.errors import CallerError, Reason
from dgr.fsm.proof import ProofState, ProofStatus
from dgr.seam.types import DeviceMemory, ModelInfo
from dgr.tracker.blame import SlowPolicy, Standing
from dgr.security.identity import is_derived_id, key_text, node_id_for
from dgr.security.tls import check_registered_url
from dgr.tracker.registration import read_heartbeat, read_registration

__all__ = ["NodeEntry", "Registry", "DEAD_AFTER_S", "GATEWAY_ID", "MAX_NODE_SESSIONS", "PROVEN_START"]

log = logging.getLogger("dgr.registry")

# Seconds without a heartbeat before a node is dead. 1 s lost live nodes while three others loaded a
# model on 2 cores.
DEAD_AFTER_S = 3.0
# Nodes beat this many times within dead_after_s (the tracker tells each node its period when it
# registers): every 0.5 s at the default. A beat costs the tracker a signed request through Quart,
# about 2 ms of CPU, so at 4 beats a second two idle nodes kept 7% of a core busy.
BEATS_PER_DEAD_AFTER = 6
# Sessions a tracker routes to one node at most, whatever it declares (--max-node-sessions).
MAX_NODE_SESSIONS = 64
# Sessions a node is trusted with at once before it has carried that many: a declared capacity is a
# claim, so the tracker starts here and doubles it each time the node ends a session well while
# holding that many (halves it when the node is lost mid-session). A real node's slots (llama.cpp's
# n_seq_max, 4 by default) are usually below it, so only a claim above 16 is ever held back.
PROVEN_START = 16
# The tracker's own name as a party to a session. Delivery capabilities were once issued to this node id
# (before trust v3 each names the node that holds it): it stays reserved, so that no node's id is ever
# mistaken for the tracker's in a log, a report or a capability of an older tracker.
GATEWAY_ID = "gateway"


@attrs.define
class NodeEntry:
    node_id: str
    url: str
    start: int
    stop: int
    backend: str
    model: ModelInfo
    capacity: int
    describe: dict[str, Any]
    registered_at: float
    last_seen: float
    sessions: int = 0  # as the node last reported
    kv_bytes: int = 0
    # Sessions this gateway holds on the node: taken before its opens, given back once its close
    # is done. Capacity is judged by it, not by heartbeats, which lag a closed session by a beat
    # and would refuse the next client a slot the node has already freed.
    reserved: int = 0
    alive: bool = True
    pid: int | None = None  # for local tooling (dgr up, the test harness); never trusted for routing
    manifest_id: str | None = None  # the Model Artifact the node claims to hold layers [start, stop) of
    seed: str | None = None  # HOST:PORT where it seeds that artifact over BitTorrent
    proof: ProofStatus = attrs.field(factory=ProofStatus)
    max_positions: int = 0  # positions per session the node allocates (--ctx); 0 until set from the model
    held: frozenset[str] = frozenset()  # session ids the node held at its last heartbeat
    # the last block keys of the prefixes it kept (dgr.node.prefix), as of its last registration or heartbeat
    prefixes: frozenset[str] = frozenset()
    # its accelerators' memory as of its last heartbeat (none: a CPU node), or why that heartbeat's were dropped
    devices: tuple[DeviceMemory, ...] = ()
    devices_dropped: str | None = None
    dead_since: float | None = None
    key: bytes = b""  # the Ed25519 public key that signed its registration: only it may speak for the node
    tls_cert: str | None = None  # PEM of the node's TLS certificate, pinned for https calls to it
    proven: int = PROVEN_START  # sessions at once the tracker has seen it carry (see PROVEN_START)
    routed_at: float = 0.0  # when a route last took it (its registration until then): routes take turns
    # its process's boot nonce (signed registration): what its capabilities and tickets are bound to
    boot: str = ""
    standing: Standing = attrs.field(factory=Standing)  # its timeouts (the registry's, shared across registrations)
    turns: int = 0  # sessions routed to it (from the busiest peer's count at registration): routes take turns

    def __attrs_post_init__(self) -> None:
        self.routed_at = max(self.routed_at, self.registered_at)
        if self.max_positions <= 0:
            self.max_positions = self.model.context_length

    @property
    def routable(self) -> bool:
        return self.alive and self.proof.routable and not self.standing.banned

    def limit(self) -> int:
        """Sessions the tracker routes to it at once: its capacity (bounded at registration), as far as proven,
        halved for each strike it holds (at least one)."""
        return max(1, min(self.capacity, self.proven) >> len(self.standing.strikes))

    @property
    def load(self) -> int:
        """Its sessions as routing weighs them: doubled, plus one, for each strike it holds, so a node with
        one strike is chosen as if it held 2n + 1 (an idle one as if it held one)."""
        return ((self.reserved + 1) << len(self.standing.strikes)) - 1

    def full(self) -> bool:
        return self.reserved >= self.limit()

    def served(self) -> None:
        """A session it carried ended well, while `reserved` sessions (this one too) were on it."""
        if self.reserved >= self.proven:
            self.proven = min(2 * self.proven, max(self.capacity, PROVEN_START))

    def faulted(self) -> None:
        """It was lost in the middle of a session: trust it with fewer at once."""
        self.proven = max(PROVEN_START, self.proven // 2)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "node": self.node_id,
            "url": self.url,
            "layers": f"{self.start}:{self.stop}",
            "backend": self.backend,
            "model": self.model.name,
            "digest": self.model.digest,
            "n_layers": self.model.n_layers,
            "capacity": self.capacity,
            "limit": self.limit(),
            "sessions": self.sessions,
            "kv_bytes": self.kv_bytes,
            "devices": [d.to_json() for d in self.devices],
            "devices_dropped": self.devices_dropped,
            "prefixes": len(self.prefixes),
            "alive": self.alive,
            "pid": self.pid,
            "heartbeat_age_s": round(now - self.last_seen, 3),
            "max_positions": self.max_positions,
            "manifest_id": self.manifest_id,
            "seed": self.seed,
            "proof": self.proof.to_json(),
            "routable": self.routable,
            "strikes": len(self.standing.strikes),
            "banned_s": None if self.standing.banned_until is None else round(self.standing.banned_until - now, 1),
            "key": key_text(self.key) if self.key else None,
            "tls": self.tls_cert is not None,
            "boot": self.boot,
            "describe": self.describe,
        }


@attrs.define
class Registry:
    dead_after_s: float = DEAD_AFTER_S
    nodes: dict[str, NodeEntry] = attrs.field(factory=dict)
    require_proof: bool = False  # nodes without a Model Artifact claim are not routed
    require_tls: bool = False  # --require-tls: a registration whose URL is http:// is refused
    encrypt: bool = False  # a registration whose URL is http:// off loopback is refused (the CLI's default)
    forget_after_s: float = 300.0  # a node dead this long is dropped from the registry
    max_node_sessions: int = MAX_NODE_SESSIONS  # the most capacity a node may declare
    trusted_ends: frozenset[bytes] = frozenset()  # keys that may hold a route's first or last layer; empty: any
    slow: SlowPolicy = attrs.field(factory=SlowPolicy)  # what timeouts cost a node (dgr.tracker.blame)
    # (node id, key) -> its timeouts, kept while it has any (pruned in `forget` once quiet)
    standings: dict[tuple[str, bytes], Standing] = attrs.field(factory=dict)

    # node id -> the key that first registered it, while its entry is known (pruned with it in `forget`)
    owners: dict[str, bytes] = attrs.field(factory=dict)

    @property
    def heartbeat_s(self) -> float:
        """How often a node should beat: several times within the death threshold."""
        return self.dead_after_s / BEATS_PER_DEAD_AFTER

    def _owned(self, node_id: str, key: bytes) -> None:
        """Raises: CallerError(IDENTITY_TAKEN) if `node_id` belongs to another key than `key`."""
        if node_id == GATEWAY_ID:
            raise CallerError(Reason.IDENTITY_TAKEN, f"node id {node_id!r} is the tracker's own: choose another")
        owner = self.owners.get(node_id)
        if is_derived_id(node_id) and owner is None:
            owner = None if node_id_for(key) == node_id else b"derived from another key"
        if owner is not None and owner != key:
            raise CallerError(Reason.IDENTITY_TAKEN,
                              f"node id {node_id[:100]!r} belongs to another key; an id is never taken over")

    def register(self, data: dict[str, Any], now: float, *, key: bytes = b"", seen: str | None = None) -> NodeEntry:
        """Record a node signed by `key`, reached from host `seen`.

        Raises:
            CallerError(INVALID_REQUEST): a malformed registration.
            CallerError(IDENTITY_TAKEN): its node id belongs to another key; nothing changed.
        """
        entry = NodeEntry(**attrs.asdict(read_registration(data, seen=seen, max_capacity=self.max_node_sessions),
                                         recurse=False), registered_at=now, last_seen=now, key=key)
        n_layers = entry.model.n_layers
        check_registered_url(entry.url, required=self.require_tls, encrypt=self.encrypt)  # handed out as a next hop
        if not (0 <= entry.start < entry.stop <= n_layers):
            raise CallerError(Reason.INVALID_REQUEST, f"layers {entry.start}:{entry.stop} outside [0, {n_layers})")
        if entry.manifest_id is not None:
            entry.proof.claim()
        elif self.require_proof:
            entry.proof.require("this tracker routes only nodes that prove their layers: start the node with --manifest",
                                Reason.PROOF_FAILED.value)
        self._owned(entry.node_id, key)
        self.owners.setdefault(entry.node_id, key)
        old = self.nodes.get(entry.node_id)
        # level with the busiest live node of its layers: a node that joins (or restarts) draws no burst
        entry.turns = max((n.turns for n in self.nodes.values() if n.alive and n.node_id != entry.node_id
                           and n.model.name == entry.model.name and n.start < entry.stop and entry.start < n.stop),
                          default=0)
        if old is not None and old.alive and old.url != entry.url:
            log.warning("node id %s re-registered from %s while %s still heartbeats under it: replacing it",
                        entry.node_id, entry.url, old.url)
        if seen and is_loopback(seen) and is_wildcard(urlsplit(data["url"]).hostname or ""):
            log.warning("node %s bound every interface but registered over loopback: recorded at %s, which other "
                        "machines cannot reach. If it serves other machines, give it --tracker with this tracker's "
                        "LAN address, or --advertise", entry.node_id, entry.url)
        entry.standing = self.standings.setdefault((entry.node_id, key), entry.standing)
        self.nodes[entry.node_id] = entry
        return entry

    def strike(self, node_id: str, now: float) -> bool:
        """A late step blamed on `node_id` (dgr.tracker.blame); True when it bans the node."""
        entry = self.nodes.get(node_id)
        if entry is None:
            return False
        banned = entry.standing.strike(now, self.slow)
        if banned:
            log.warning("node %s banned from routing for %.0fs: %d timeouts within %.0fs", node_id,
                        entry.standing.banned_until - now, self.slow.ban_after, self.slow.window_s)
        return banned

    def beating(self, node_id: str, key: bytes) -> NodeEntry:
        """The live entry a heartbeat for `node_id` signed by `key` would update; changes nothing.

        The tracker asks this before it parses a heartbeat's body, so a key beating for an id it does not own
        costs it no parsing.

        Raises: CallerError(NOT_FOUND): it must register (again), or the id is another key's: the same
        answer, so that heartbeats (which need no join token) tell no stranger which ids exist.
        """
        entry = self.nodes.get(node_id)
        unknown = CallerError(Reason.NOT_FOUND, f"node {node_id[:100]!r} is not registered")
        try:
            self._owned(node_id, key)
        except CallerError:
            log.warning("a heartbeat for node %s signed by another key (%s) was refused as not registered",
                        node_id[:100], key_text(key) if key else "none")
            raise unknown from None
        if entry is not None and entry.key != key:
            raise unknown
        if entry is None or not entry.alive:
            raise unknown
        return entry

    def heartbeat(self, data: dict[str, Any], now: float, *, key: bytes = b"") -> NodeEntry:
        """Raises: CallerError(NOT_FOUND) for a node that must register (again: a heartbeat naming another boot
        than its registration's too), or signed by a key that does not own the node id (the same answer: see
        `beating`); (INVALID_REQUEST) if malformed."""
        node_id = data.get("node")
        entry = self.beating(node_id if isinstance(node_id, str) else "", key)
        beat = read_heartbeat(data)
        if beat.boot is not None and beat.boot != entry.boot:  # it restarted, unseen: bind the new boot first
            raise CallerError(Reason.NOT_FOUND, f"node {entry.node_id[:100]!r} restarted since it registered "
                                                "(another boot nonce): register again")
        entry.last_seen = now
        entry.sessions = beat.sessions
        entry.kv_bytes = beat.kv_bytes
        entry.held = beat.held
        entry.prefixes = beat.prefixes
        entry.devices = beat.devices
        if beat.devices_dropped is not None and beat.devices_dropped != entry.devices_dropped:
            log.warning("node %s: its heartbeat's devices were dropped: %s", entry.node_id, beat.devices_dropped)
        entry.devices_dropped = beat.devices_dropped
        return entry

    def mark_dead(self, node_id: str, now: float | None = None) -> None:
        entry = self.nodes.get(node_id)
        if entry is not None and entry.alive:
            entry.alive = False
            entry.dead_since = entry.last_seen if now is None else now

    def sweep(self, now: float) -> list[str]:
        """Mark nodes whose heartbeats stopped; return the ids that just died."""
        died = []
        for standing in self.standings.values():
            standing.refresh(now, self.slow)
        for entry in self.nodes.values():
            if entry.alive and now - entry.last_seen > self.dead_after_s:
                entry.alive = False
                entry.dead_since = now
                died.append(entry.node_id)
        return died

    def forget(self, now: float) -> list[NodeEntry]:
        """Drop the entries of nodes dead for over `forget_after_s`, and their ids' owners; return them.

        A chosen name is free again once forgotten; an id derived from a key stays that key's without an owner
        recorded (`_owned`), so forgetting never frees it for another.
        """
        gone = [e for e in self.nodes.values()
                if not e.alive and now - (e.dead_since if e.dead_since is not None else e.last_seen) > self.forget_after_s]
        for e in gone:
            del self.nodes[e.node_id]
            self.owners.pop(e.node_id, None)
        held = {(e.node_id, e.key) for e in self.nodes.values()}
        for k in [k for k, s in self.standings.items() if k not in held and s.quiet]:
            del self.standings[k]
        return gone

    def alive(self) -> list[NodeEntry]:
        return [n for n in self.nodes.values() if n.alive]

    def seeders(self, manifest_id: str) -> list[NodeEntry]:
        """Live nodes that proved layers of the manifest and seed it, by node id."""
        return sorted(
            (n for n in self.alive() if n.manifest_id == manifest_id and n.seed and n.proof.state is ProofState.PASSED),
            key=lambda n: n.node_id,
        )
