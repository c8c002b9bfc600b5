"""Tenants and their API keys: creation, rotation, the webhook secret kept encrypted for a tenant.

Imports no other wing."""
