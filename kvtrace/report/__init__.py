"""Reporters: they consume replay and diff results and never read traces."""
