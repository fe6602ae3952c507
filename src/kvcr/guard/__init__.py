"""Guard service: wire protocol, client, service and pool groups (contract section 10)."""
