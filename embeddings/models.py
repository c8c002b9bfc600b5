"""Database models (tenants, keys and usage arrive with the API issue)."""
