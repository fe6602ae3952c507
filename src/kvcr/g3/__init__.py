"""The G3 tier: local files behind the G2 pool."""
