"""A node: one Shard served over the seam protocol."""
