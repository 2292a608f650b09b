"""Scheduling core: plain Python, no device calls (block pool, radix cache, scheduler)."""
