"""API keys: the clients' credential on the tracker's OpenAI API (`Authorization: Bearer KEY`).

Where the keys come from is dgr.security.secrets (API_KEYS_ENV); this is the
one check of a request's key. The HTTP layer only turns its error into a 401
with `WWW-Authenticate` (dgr.api.http, from the error's `bearer` detail).
"""

from __future__ import annotations

import hmac

from dgr.errors import CallerError, Reason

__all__ = ["check_bearer"]


def check_bearer(authorization: str | None, keys: frozenset[str]) -> None:
    """Accept `Authorization: Bearer KEY` for one of `keys` (constant-time per key).

    Raises:
        CallerError(UNAUTHENTICATED): missing or unknown key.
    """
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise CallerError(Reason.UNAUTHENTICATED, "this API needs a key: send 'Authorization: Bearer KEY'",
                          bearer=True)
    given = token.encode()
    if not any(hmac.compare_digest(given, k.encode()) for k in keys):
        raise CallerError(Reason.UNAUTHENTICATED, "incorrect API key provided", bearer=True)
