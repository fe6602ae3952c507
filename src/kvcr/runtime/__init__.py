"""The runtime thread and everything it owns."""
