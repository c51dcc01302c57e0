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
from dgr.fsm.proof import ProofState
from dgr.tracker.blame import SlowPolicy, Standing
from dgr.security.identity import is_derived_id, key_text, node_id_for
from dgr.security.tls import check_registered_url
from dgr.tracker.entry import PROVEN_START, NodeEntry, Role
from dgr.tracker.registration import read_heartbeat, read_registration
from dgr.tracker.spares import settle

# NodeEntry and PROVEN_START are dgr.tracker.entry's, named here too: where most callers have always found them
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
# The tracker's own name as a party to a session. Delivery capabilities were once issued to this node id
# (before trust v3 each names the node that holds it): it stays reserved, so that no node's id is ever
# mistaken for the tracker's in a log, a report or a capability of an older tracker.
GATEWAY_ID = "gateway"


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
    spares: int = 0  # --spares N: nodes whose layers members cover that are kept idle, per layer (dgr.tracker.spares)

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
        entry.role = Role.SPARE  # a newcomer queues behind the members settled already: no role flaps for it
        self.nodes[entry.node_id] = entry
        self.settle(entry)
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
        if beat.draining:
            self.drain(entry.node_id)
        return entry

    def mark_dead(self, node_id: str, now: float | None = None) -> None:
        entry = self.nodes.get(node_id)
        if entry is not None and entry.alive:
            entry.alive = False
            entry.dead_since = entry.last_seen if now is None else now
            self.settle()

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
        self.settle()  # deaths, and proofs passed or bans lifted since
        return died

    def drain(self, node_id: str) -> NodeEntry | None:
        """`node_id` is stopping (dgr.tracker.drain): routed nothing new from now on; its live entry, or None."""
        entry = self.nodes.get(node_id)
        if entry is None or not entry.alive:
            return None
        if entry.role is not Role.DRAINING:
            log.info("node %s drains (it was a %s)", node_id, entry.role.value)
            entry.role = Role.DRAINING
            self.settle()
        return entry

    def settle(self, new: NodeEntry | None = None) -> None:
        """Each live node's role from the layers of all (dgr.tracker.spares); `new` just registered."""
        for entry, before in settle(self.nodes.values(), self.spares):
            if entry is not new:
                log.info("node %s (layers %d:%d) is a %s, was a %s", entry.node_id, entry.start, entry.stop,
                         entry.role.value, before.value)
        if new is not None:
            log.info("node %s registered as a %s, layers %d:%d", new.node_id, new.role.value, new.start, new.stop)

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
