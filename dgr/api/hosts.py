"""What kind of address a host string names: a wildcard to bind on, or loopback.

Its own module, free of the HTTP stack, because the command line's defaults and
the registry's address checks need it in processes that never serve HTTP.
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback", "is_wildcard"]


def is_wildcard(host: str) -> bool:
    """True for the unspecified addresses (0.0.0.0, ::), which a server binds to listen on every interface."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback addresses; any name that must be resolved counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
