"""Speculative decoding: n-gram drafts proposed by the core or a draft model's by the workers, verified by the
workers (docs/speculative.md)."""
