"""Authentication (and later authorization) of the agents' connections (docs/security.md)."""
