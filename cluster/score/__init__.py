"""Scoring: scorers, the code_exec sandbox, a shard's scoring, the summary."""
