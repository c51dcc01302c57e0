"""Who may talk to a route: cluster membership, session capabilities, API keys."""
