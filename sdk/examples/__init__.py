"""Runnable examples of the SDK's delivery semantics (docs/groups.md)."""
