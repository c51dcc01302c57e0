"""The tracker key a node trusts, kept beside the node's identity so that a restart trusts the same one.

A node learns its tracker's public key from the registration reply and from
then on accepts only capabilities and challenges signed with it. Before,
that pin lived in memory: a restarted node trusted whatever key the first
reply carried, so an on-path attacker (or a rogue tracker at the same
address) needed only to catch a restart.

Rules:
- The key a node expects is `--tracker-key KEY` if given; otherwise the one
  pinned for its tracker's URL (`--tracker`) in the pin file beside its
  identity (`ID.tracker` for `ID.key`); otherwise none yet, and the first
  reply's key is pinned (trust on first use) and written there. Pins are
  per URL: a node pointed at another tracker trusts that one on first use,
  but the same address answering with another key (a rogue tracker, an
  on-path attacker, a DNS answer) is refused.
- A reply with another key is refused with both keys named and how to reset
  the pin (delete the file, or pass `--tracker-key`); the node does not
  join that tracker. `--tracker-key` wins over the file, and a registration
  it admits rewrites the file with it.
- The file is one JSON object, `{"trackers": {URL: KEY}}`, mode 0600, written through a temporary file opened O_EXCL|O_NOFOLLOW
  and renamed over it. A pin file that others can write is refused: whoever
  can change it chooses whom the node obeys.
- An identity with no file (tests, `Identity.generate()`) pins in memory
  only.

Left out: several trackers per node, and rotating a tracker's key without an
operator (a signed hand-over from the old key to the new).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import attrs

from dgr.errors import CallerError, Reason
from dgr.security.identity import key_from_text, key_text
from dgr.security.private_files import write_private

__all__ = ["TrackerPin", "pin_path"]

_PIN_SUFFIX = ".tracker"
_MAX_PIN_BYTES = 1 << 16  # a pin is about 100 bytes


def pin_path(identity: Path) -> Path:
    """Where the tracker pin of the identity file `identity` lives: `ID.tracker` beside `ID.key`."""
    if identity.suffix == ".key":
        return identity.with_suffix(_PIN_SUFFIX)
    return identity.with_name(identity.name + _PIN_SUFFIX)  # never the identity file itself


@attrs.define
class TrackerPin:
    """The tracker key a node expects, and the file that keeps it across restarts."""

    path: Path | None = None  # None: in memory only
    tracker: str = ""  # the tracker's URL, whose key this is
    key: bytes | None = None  # the key expected; None until the first registration (trust on first use)
    given: bool = False  # `key` came from --tracker-key

    @classmethod
    def beside(cls, identity: Path | None, tracker: str, given: bytes | None = None) -> TrackerPin:
        """The pin of a node whose identity file is `identity`, for the tracker at `tracker`: `given`
        (--tracker-key), else the key the pin file holds for that URL.

        Raises:
            CallerError(INVALID_REQUEST): the pin file is unreadable, writable by others, or malformed.
        """
        path = None if identity is None else pin_path(Path(identity))
        tracker = tracker.rstrip("/")
        if given is not None:
            return cls(path, tracker, given, True)
        if path is None or not path.exists():
            return cls(path, tracker)
        return cls(path, tracker, _read_pins(path).get(tracker))

    def check(self, key: bytes) -> None:
        """Refuse `key`, the key the tracker answered with, unless it is the one expected.

        Raises:
            CallerError(FORBIDDEN): another key than --tracker-key, the pin file's or the one pinned at join.
        """
        if self.key is None or key == self.key:
            return
        if self.given:
            source, reset = "--tracker-key", "fix --tracker-key if the tracker's key really changed"
        elif self.path is not None:
            source = f"the key pinned for it in {self.path} at this node's first registration there"
            reset = (f"if the tracker's key really changed, delete {self.path} (every tracker's pin) or start "
                     f"the node with --tracker-key {key_text(key)}")
        else:
            source, reset = "the key pinned at join", "restart the node to join a new tracker"
        raise CallerError(Reason.FORBIDDEN, f"the tracker at {self.tracker} answered with key {key_text(key)}, but this "
                                            f"node trusts {key_text(self.key)} ({source}): refusing it; {reset}",
                          field="tracker_key")

    def keep(self, key: bytes) -> None:
        """Pin `key` (checked by `check`), and write it to the pin file unless the file holds it already.

        Raises:
            OSError: the pin file could not be written.
        """
        self.key = key
        if self.path is None:
            return
        try:
            pins = _read_pins(self.path) if self.path.exists() else {}
        except CallerError:  # a bad file the operator overrode with --tracker-key (`beside` refused it otherwise)
            pins = {}
        if pins.get(self.tracker) != key:
            pins[self.tracker] = key
            write_private(self.path, json.dumps({"trackers": {url: key_text(k) for url, k in pins.items()}},
                                                indent=1).encode(), durable=True)


def _read_pins(path: Path) -> dict[str, bytes]:
    """The pin file's keys by tracker URL.

    Raises:
        CallerError(INVALID_REQUEST): a pin file that is unreadable, writable by others or malformed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(_MAX_PIN_BYTES + 1)
    except OSError as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot read the tracker pin {path}: "
                                                  f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or st.st_uid != os.geteuid():
        raise CallerError(Reason.INVALID_REQUEST, f"the tracker pin {path} can be changed by others: chmod 600 it "
                                                  "(or delete it to pin the tracker's key again)")
    try:
        if len(raw) > _MAX_PIN_BYTES:
            raise ValueError("too long")
        trackers = json.loads(raw)["trackers"]
        return {url: key_from_text(text) for url, text in trackers.items() if isinstance(url, str)}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CallerError(Reason.INVALID_REQUEST, f"the tracker pin {path} is malformed: delete it to pin the "
                                                  "tracker's key again, or pass --tracker-key") from None
