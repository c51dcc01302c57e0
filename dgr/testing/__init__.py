"""Test doubles and the fault-injection harness, shipped so every backend reuses them."""
