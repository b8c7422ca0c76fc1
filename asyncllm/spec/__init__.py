"""Speculative decoding: n-gram drafts proposed by the core, verified by the workers (docs/speculative.md)."""
