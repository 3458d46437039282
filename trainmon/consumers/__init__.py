"""Consumers: each its own consumer group turning the record streams into a view."""
