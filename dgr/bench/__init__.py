"""`dgr bench`: side-by-side measurements, each figure next to its single-node baseline."""
