"""Synthetic stages and helpers for tests, demos and benchmarks (no model needed)."""
