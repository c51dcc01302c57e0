"""The member gone bad inside routes: a real `dgr node`, a few of its methods patched at run time.

`dgr soak --attacker` starts one beside its route (`python -m dgr.bench.inside
--tally FILE --mode MODE -- NODE ARGS`, NODE ARGS as `dgr node` takes them).
It computes every step honestly, so the tracker routes sessions through it,
and attacks from inside the routes it is on:

- `middle` (with trusted ends: it holds the middle stage beside an honest
  node of the same layers, a shared stage). On its `forge_at`-th session it
  delivers a TOKEN frame of the lure for the step it holds, with the
  capability its relay plan gave it; on its `report_at`-th it reports the
  tail's failure in the head's name; on its `slow_at`-th it holds a decode
  step (and those after it) `slow_s` seconds, past the step's deadline.
  Each answer is tallied; a 2xx to a forged delivery or a report in another's
  name is an attack accepted. The slow step is judged by the tracker's
  strikes (dgr.bench.soak reads them), not here.
- `tail` (the control run, without trusted ends: it holds the tail's range
  beside the honest tail). Each answer it gives is the lure from its start,
  token by token, with the tokens' true bytes: the tracker's checks cannot tell a tail's
  choice from its model's, which is why the ends must be trusted. The soak
  must then find the lure in answers, and fail.

At exit (SIGTERM, SIGINT) it writes its tally as JSON to `--tally`. One job:
the member gone bad (its patches, its tally, its process's start and stop
for the soak); the node is `dgr node` itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import trio

__all__ = ["LURE", "INSIDE_ID", "Inside", "main", "start_inside", "stop_inside"]

INSIDE_ID = "inside"  # its node id
_HOLD_FROM = 3  # the slow session's steps held: from the third this node passes on (a decode step)
LURE = "SECURITY NOTICE: re-enter your API key at http://attacker.example/login "


@attrs.define
class Inside:
    mode: str
    forge_at: int = 3
    report_at: int = 6
    slow_at: int = 9
    slow_s: float = 35.0
    sessions: list[str] = attrs.field(factory=list)  # the sessions it relayed, in order
    answers: dict[str, Counter] = attrs.field(factory=dict)
    accepted: Counter = attrs.field(factory=Counter)
    lure_tokens: int = 0  # tokens it answered with the lure (tail mode)
    made: int = 0  # attacks it made that an honest tracker strikes it for (forge, report, slow)
    slowed: bool = False  # a session's decode step has been held

    def note(self, attack: str, status: int | str, *, refused_if_ok: bool = True) -> None:
        self.answers.setdefault(attack, Counter())[str(status)] += 1
        if refused_if_ok and isinstance(status, int) and 200 <= status < 300:
            self.accepted[attack] += 1

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "sessions": len(self.sessions), "lure_tokens": self.lure_tokens, "made": self.made,
                "attacks": {k: dict(v) for k, v in sorted(self.answers.items())}, "accepted": dict(self.accepted)}

    # -- the patches ---------------------------------------------------------------------------
    def install(self) -> None:
        from dgr.node.relay import Relay
        from dgr.node.replies import NodeReplies

        if self.mode == "tail":
            self._lie_as_tail(NodeReplies)
            return
        inside, run, put = self, Relay.run, Relay.put
        first: dict[str, trio.Event] = {}
        frames: dict[str, bytes] = {}
        counts: dict[str, int] = {}  # items put, per session
        held: dict[str, list] = {}  # the slow session's items, from its HOLD_FROM-th on, until released
        holding: dict[str, trio.Event] = {}  # set when the slow session's hold begins

        def held_put(relay, item) -> None:
            frame = getattr(item, "frame", None)
            if frame is not None and relay.sid in first and relay.sid not in frames:
                frames[relay.sid] = frame
                first[relay.sid].set()
            counts[relay.sid] = counts.get(relay.sid, 0) + 1
            if relay.sid in held and counts[relay.sid] >= _HOLD_FROM and (holding[relay.sid].is_set()
                                                                           or not inside.slowed):
                if not holding[relay.sid].is_set():
                    inside.slowed, inside.made = True, inside.made + 1
                held[relay.sid].append(item)  # a decode step, computed here and not sent on
                holding[relay.sid].set()
                return
            put(relay, item)

        async def release(relay) -> None:
            await holding[relay.sid].wait()
            await trio.sleep(inside.slow_s)
            for item in held.pop(relay.sid, []):
                put(relay, item)

        async def attacked_run(relay) -> None:
            if relay.plan.next is None:  # it relays answers only as a tail: not in middle mode
                return await run(relay)
            inside.sessions.append(relay.sid)
            n = len(inside.sessions)
            first[relay.sid] = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(inside._attack, relay, n, first[relay.sid], frames)
                    if 0 < inside.slow_at <= n and not inside.slowed:  # until one session is long enough to hold
                        held[relay.sid], holding[relay.sid] = [], trio.Event()
                        nursery.start_soon(release, relay)
                    await run(relay)
                    nursery.cancel_scope.cancel()
            finally:
                for kept in (first, frames, counts, held, holding):
                    kept.pop(relay.sid, None)

        Relay.put, Relay.run = held_put, attacked_run

    def _lie_as_tail(self, replies_cls) -> None:
        from dgr.seam.frame import TokenResult

        inside, sample = self, replies_cls.sample
        said: dict[str, int] = {}  # session -> lure tokens answered in it: each answer is the lure from its start

        def lying_sample(replies, frame, sampler, out) -> TokenResult:
            honest = sample(replies, frame, sampler, out)
            backend = replies.backend
            ids = backend.tokenize(LURE, add_special=False, parse_special=False)
            n = said[frame.session] = said.get(frame.session, 0) + 1
            if len(said) > 4096:  # a bound: sessions end, this dict must not grow with them
                said.pop(next(iter(said)))
            token = ids[(n - 1) % len(ids)]
            inside.lure_tokens += 1
            return TokenResult(token, honest.logprob, backend.token_bytes(token), backend.is_eog(token))

        replies_cls.sample = lying_sample

    async def _attack(self, relay, n: int, ready: trio.Event, frames: dict[str, bytes]) -> None:
        from dgr.seam.wire import CAPABILITY_HEADER, ROUTE_SESSION_HEADER

        cap = [(CAPABILITY_HEADER, relay.plan.deliver_capability)] if relay.plan.deliver_capability else []
        pool = relay.pool(relay.plan.deliver_url)
        if n in (self.forge_at, self.report_at) and n > 0:
            await ready.wait()  # the session is live at the tracker once its first step has been computed here
        if n == self.forge_at:
            self.made += 1
            await self._forge(relay, frames[relay.sid], cap)
        if n == self.report_at:
            self.made += 1
            route = relay.plan.route.split(",") if relay.plan.route else []
            named = route[0] if route else "node0"
            data = {"session": relay.sid, "reporter": named, "code": "node_error", "message": LURE,
                    "node": route[-1] if route else None}
            try:
                r = await pool.request("POST", "/v1/seam/deliver", json.dumps(data).encode(),
                                       [("Content-Type", "application/json"), (ROUTE_SESSION_HEADER, relay.sid), *cap])
                self.note("report_in_anothers_name", r.status)
            except Exception as exc:  # noqa: BLE001 - any failure to be heard is a refusal here
                self.note("report_in_anothers_name", type(exc).__name__)

    async def _forge(self, relay, step_frame: bytes, cap: list[tuple[str, str]]) -> None:
        from dgr.seam.frame import TokenResult, decode_frame, encode_frame
        from dgr.seam.stream import encode_record
        from dgr.seam.wire import CONTENT_TYPE, DELIVER_STREAM_PATH, ROUTE_SESSION_HEADER, FrameKind

        step = decode_frame(step_frame)
        token = encode_frame(FrameKind.TOKEN, step.session, step.seq, step.pos0 + step.n_tokens - 1, 1, step.width,
                             extra=TokenResult(5, -0.01, LURE.encode(), False).payload())
        status: int | str = "no answer"
        try:
            stream = await relay.pool(relay.plan.deliver_url).open_stream(
                DELIVER_STREAM_PATH, [("Content-Type", CONTENT_TYPE), (ROUTE_SESSION_HEADER, relay.sid), *cap])
            try:
                with contextlib.suppress(Exception):  # refused before the body is taken: the answer says so
                    await stream.send(encode_record((), token))
                    await stream.end()
                with trio.move_on_after(10):
                    status = (await stream.answer()).status
            finally:
                await stream.release()
        except Exception as exc:  # noqa: BLE001 - a cut connection is a refusal too
            status = type(exc).__name__
        self.note("forge_answer", status)


def start_inside(route, layers: str, mode: str, tally: Path, slow_s: float, at: str = "3,6,9",
                 timeout_s: float = 120.0):
    """The member gone bad on `route` (a dgr.testing.harness.LocalRoute) for `layers`, with a key of its own
    (never a trusted end), once the tracker lists it alive; its process."""
    from dgr.procs import die_with_parent
    from dgr.security.identity import Identity

    key = tally.with_suffix(".key")
    Identity.load(key, create=True)
    cmd = [sys.executable, "-m", "dgr.bench.inside", "--tally", str(tally), "--mode", mode, "--slow-s", str(slow_s),
           "--at", at,
           "--", *route.node_args(INSIDE_ID, layers, key)]
    # its own interpreter (dgr.testing.launcher forks dgr commands only): the patches must precede the node
    proc = subprocess.Popen(cmd, env=route.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(n["node"] == INSIDE_ID and n["alive"] for n in route.node_table()):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the inside attacker did not register within {timeout_s:g} s")


def stop_inside(proc, tally: Path) -> dict[str, Any] | None:
    """SIGTERM it; its tally (None if it left none)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    try:
        return json.loads(tally.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m dgr.bench.inside")
    p.add_argument("--tally", required=True, help="file to write the tally to at exit (JSON)")
    p.add_argument("--mode", choices=("middle", "tail"), default="middle")
    p.add_argument("--slow-s", type=float, default=35.0, help="how long its slow session's decode step is held")
    p.add_argument("--at", default="3,6,9", help="its FORGE,REPORT,SLOW sessions (counted from 1, 0: never), comma-separated")
    args = p.parse_args(argv[:cut])
    forge_at, report_at, slow_at = (int(x) for x in args.at.split(","))
    inside = Inside(args.mode, forge_at, report_at, slow_at, args.slow_s)
    inside.install()

    from dgr.cli import main as dgr_main

    try:
        return dgr_main(["node", *argv[cut + 1:]])  # until SIGTERM or SIGINT (dgr.serve.run_until_signal)
    finally:
        with open(args.tally, "w") as f:
            json.dump(inside.to_json(), f)


if __name__ == "__main__":
    sys.exit(main())
