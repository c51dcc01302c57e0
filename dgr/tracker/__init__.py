"""The Tracker Node and Gateway: registry, routing, Route Session drivers."""
