"""The tracker's side of layer-possession proofs: challenge every node that claims a Model Artifact.

A node may register a claim: "I hold layers [A, B) of manifest M (and seed it
at HOST:PORT)". The tracker routes it only once the claim is proven:

1. The claim must fit the manifest, read from the tracker's own --manifest
   files (the tracker never takes a manifest from a node): a known id, the
   node's ModelInfo digest equal to the manifest's file sha256, the same
   architecture and block count. Otherwise the proof fails with
   `artifact_mismatch` (or `proof_failed` for a manifest the tracker does not
   know), without a challenge.
2. `challenges` challenges follow (dgr.artifact.proof.make_challenge), one at
   a time, each answered within `deadline_s`: first one block in each of up to
   `challenges` even strata of [A, B), so a node missing any whole stratum is
   always caught, then the rest uniformly over the claim. Blocks are drawn
   with `random.SystemRandom`, so a node cannot predict them.
3. The first failed challenge (a wrong answer, an error, a timeout, an
   unreachable node) fails the claim with `proof_failed` and the verdict.

Each challenge is sent as a request signed with the tracker's key
(dgr.security.auth `Signer`: its headers sign the body's digest, so a node
checks them before it reads the body) and addressed to the node by id, with
a fresh nonce; honest nodes answer only challenges signed by the tracker
they pinned and addressed to themselves. The answer must be
signed by the key the node registered with, over the challenge (nonce
included) and the answer: a node without the weights cannot relay its
challenges to an honest node (it refuses them) nor pass off that node's
signed answers as its own (the signature is the other node's). An `https://`
node is challenged over TLS, trusting the certificate it registered. An
answer is read up to MAX_CONTROL_BYTES; a longer one fails the challenge.

The verdict lands in the entry's `ProofStatus` (dgr.tracker.registry). A
re-registration makes a new entry with a new PENDING claim and is challenged
again; a late verdict for an old entry changes nothing that is routed.

Left out: periodic re-challenges of live nodes, and proofs for nodes
without a manifest (the registry's `require_proof` decides whether those
are routed at all).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import random
import secrets
import time
from collections.abc import Iterable
from typing import Any

import attrs
import httpx
import trio

from dgr.artifact.manifest import Manifest
from dgr.artifact.proof import Answer, Challenge, check_answer, make_challenge
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, PeerError, Reason, parse_error_body
from dgr.fsm.proof import ProofEvent, ProofState
from dgr.security.auth import ANSWER_DOMAIN, Signer, verify_json
from dgr.security.identity import Identity
from dgr.security.tls import TlsTrust, httpx_default_trust
from dgr.seam.wire import MAX_CONTROL_BYTES
from dgr.tracker.registry import NodeEntry
from dgr.tracker.seam_client import read_capped

__all__ = ["CHALLENGE_PATH", "DEFAULT_CHALLENGES", "DEFAULT_DEADLINE_S", "Prover", "plan_challenges",
           "answer_signature_problem"]

log = logging.getLogger("dgr.proofs")

CHALLENGE_PATH = "/v1/artifact/challenge"
# 8 strata: a node missing an eighth of its claimed layers fails for sure;
# one missing a fraction f of the bytes passes with probability <= (1 - f)^8.
DEFAULT_CHALLENGES = 8
# An honest node reads one piece and hashes it (milliseconds); fetching the
# block from another peer first takes longer, which is what the bound is for.
DEFAULT_DEADLINE_S = 2.0


def _strata(layers: LayerRange, k: int) -> list[LayerRange]:
    n = min(k, len(layers))
    bounds = [layers.start + round(i * len(layers) / n) for i in range(n + 1)]
    return [LayerRange(a, b) for a, b in itertools.pairwise(bounds)]


def plan_challenges(manifest: Manifest, layers: LayerRange, k: int, rng: random.Random) -> list[Challenge]:
    """k challenges for a claim on layers: one per even stratum first, the rest over the whole range.

    Raises:
        CallerError(INVALID_REQUEST): layers outside the manifest's model.
    """
    strata = _strata(layers, k)
    plan = [make_challenge(manifest, s, rng) for s in strata]
    plan += [make_challenge(manifest, layers, rng) for _ in range(k - len(strata))]
    return plan


def answer_signature_problem(entry: NodeEntry, challenge: dict[str, Any], reply: Any) -> str | None:
    """Why an answer is not the node's own answer to this challenge, or None.

    Every entry registered over HTTP has a key; only in-process registrations
    (tests of other things) have none, and their answers are not signed.
    """
    if not entry.key:
        return None
    answer = {k: v for k, v in reply.items() if k != "signature"} if isinstance(reply, dict) else {}
    signature = reply.get("signature") if isinstance(reply, dict) else None
    if not verify_json(entry.key, ANSWER_DOMAIN, {"challenge": challenge, "answer": answer}, signature):
        return (f"the answer is not signed by {entry.node_id}'s key over this challenge "
                "(unsigned, altered, or relayed from another node)")
    return None


def _claim_problem(entry: NodeEntry, manifest: Manifest) -> str | None:
    """Why a claim cannot be of this manifest, or None."""
    m, model = manifest.model, entry.model
    if model.digest != manifest.file.sha256:
        return (
            f"the node's file digest {model.digest[:12]} is not manifest {manifest.id[:12]}'s "
            f"file {manifest.file.name} ({manifest.file.sha256[:12]})"
        )
    if (model.architecture, model.n_layers) != (m.architecture, m.block_count):
        return (
            f"the node serves {model.architecture} with {model.n_layers} layers; manifest {manifest.id[:12]} "
            f"is {m.architecture} with {m.block_count} layers"
        )
    return None


@attrs.define
class Prover:
    """Runs claims' challenges in its own nursery; `submit` queues one."""

    manifests: dict[str, Manifest] = attrs.field(factory=dict)
    challenges: int = DEFAULT_CHALLENGES
    deadline_s: float = DEFAULT_DEADLINE_S
    rng: random.Random = attrs.field(factory=random.SystemRandom)
    identity: Identity | None = None  # the tracker's key: signs challenge requests (nodes refuse unsigned ones)
    tls: TlsTrust = attrs.field(factory=TlsTrust)
    _nursery: trio.Nursery | None = None
    _client: httpx.AsyncClient | None = None

    @classmethod
    def from_manifests(cls, manifests: Iterable[Manifest], **kw) -> Prover:
        return cls(manifests={m.id: m for m in manifests}, **kw)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the challenge tasks and their HTTP client until cancelled."""
        async with httpx.AsyncClient(timeout=self.deadline_s, verify=httpx_default_trust()) as client:
            try:
                async with trio.open_nursery() as nursery:
                    self._client, self._nursery = client, nursery
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                self._client, self._nursery = None, None

    def submit(self, entry: NodeEntry) -> None:
        """Start proving a PENDING claim; a claim that cannot be proven here fails at once."""
        if entry.proof.state is not ProofState.PENDING:
            return
        if self._nursery is None:
            entry.proof.decide(ProofEvent.REFUTED, "this tracker is not checking proofs",
                               reason=Reason.PROOF_FAILED.value)
            return
        self._nursery.start_soon(self.prove, entry)

    async def prove(self, entry: NodeEntry) -> None:
        """Check one claim and record its verdict in entry.proof. Never raises for a bad node."""
        started = time.perf_counter()
        manifest = self.manifests.get(entry.manifest_id or "")
        if manifest is None:
            self._fail(entry, Reason.PROOF_FAILED,
                       f"this tracker does not know manifest {str(entry.manifest_id)[:12]}: start it with "
                       "--manifest for that file", started)
            return
        problem = _claim_problem(entry, manifest)
        if problem is not None:
            self._fail(entry, Reason.ARTIFACT_MISMATCH, problem, started)
            return
        layers = LayerRange(entry.start, entry.stop)
        try:
            plan = plan_challenges(manifest, layers, self.challenges, self.rng)
        except CallerError as exc:
            self._fail(entry, Reason.PROOF_FAILED, exc.message, started)
            return
        async with contextlib.AsyncExitStack() as stack:
            client = self._client
            if entry.url.startswith("https://"):  # its own client: trust is the node's registered certificate
                try:
                    verify = self.tls.context(entry.tls_cert)
                except CallerError as exc:
                    self._fail(entry, Reason.PROOF_FAILED, exc.message, started)
                    return
                client = await stack.enter_async_context(httpx.AsyncClient(timeout=self.deadline_s, verify=verify))
            if not await self._challenge_all(entry, manifest, plan, client, started):
                return
        seconds = time.perf_counter() - started
        if entry.proof.decide(ProofEvent.HELD, f"{len(plan)} challenges over layers {layers} held",
                              challenges=len(plan), seconds=seconds):
            log.info("node %s proved layers %s of %s (%d challenges, %.3f s)", entry.node_id, layers,
                     manifest.id[:12], len(plan), seconds)

    async def _challenge_all(self, entry: NodeEntry, manifest: Manifest, plan: list[Challenge],
                             client: httpx.AsyncClient | None, started: float) -> bool:
        """Ask every challenge in turn; False (and the claim failed) at the first that does not hold."""
        for passed, challenge in enumerate(plan):
            verdict, why = await self._ask(entry, manifest, challenge, client)
            if why is not None:
                self._fail(entry, Reason.PROOF_FAILED, f"challenge {passed + 1}/{len(plan)}: {why}", started,
                           verdict=verdict, challenges=passed)
                return False
        return True

    def challenge_body(self, entry: NodeEntry, challenge: Challenge) -> dict[str, Any]:
        """The challenge as sent: addressed to the node, with a fresh nonce."""
        return {**challenge.to_json(), "node": entry.node_id, "nonce": secrets.token_hex(16)}

    def challenge_request(self, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        """A challenge body's bytes and headers: signed by the tracker (unsigned without its key, which nodes
        refuse)."""
        raw = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.identity is not None:
            headers |= Signer(self.identity).headers("POST", CHALLENGE_PATH, raw, time.time())
        return raw, headers

    async def _ask(self, entry: NodeEntry, manifest: Manifest, challenge: Challenge,
                   client: httpx.AsyncClient | None = None) -> tuple[str | None, str | None]:
        """(verdict, None) if the answer held, else (verdict or None, why)."""
        client = client or self._client
        if client is None:
            return None, "the tracker is stopping"
        url = entry.url.rstrip("/") + CHALLENGE_PATH
        body = self.challenge_body(entry, challenge)
        raw, headers = self.challenge_request(body)
        with trio.move_on_after(self.deadline_s) as scope:
            try:  # an answer is a few hashes: read no more than a control reply
                r = await read_capped(client, "POST", url, limit=MAX_CONTROL_BYTES, node=entry.node_id, content=raw,
                                      headers=headers)
            except httpx.HTTPError as exc:
                return None, f"node unreachable: {type(exc).__name__}: {exc}"
            except PeerError as exc:
                return None, exc.message
        if scope.cancelled_caught:
            return None, f"no answer within {self.deadline_s:g} s (piece {challenge.piece} block {challenge.block})"
        if r.status_code != 200:
            code, message = parse_error_body(r.content)
            detail = message if code is None else f"{code}: {message}"
            return None, f"the node refused the challenge (HTTP {r.status_code}, {detail})"
        try:
            reply = json.loads(r.content)
            answer = Answer.from_json(reply)
        except (CallerError, ValueError) as exc:
            return None, f"malformed answer: {getattr(exc, 'message', exc)}"
        why = answer_signature_problem(entry, body, reply)
        if why is not None:
            return None, why
        result = check_answer(manifest, challenge, answer)
        return result.verdict.value, None if result.ok else result.message

    def _fail(self, entry: NodeEntry, reason: Reason, message: str, started: float, *, verdict: str | None = None,
              challenges: int = 0) -> None:
        if entry.proof.decide(ProofEvent.REFUTED, message, reason=reason.value, verdict=verdict,
                              challenges=challenges, seconds=time.perf_counter() - started):
            log.warning("node %s failed its layer proof: %s", entry.node_id, message)
