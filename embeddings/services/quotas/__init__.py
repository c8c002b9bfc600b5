"""Quotas and usage: `limits` checks and reserves every rate, budget and concurrency limit of a
request in one Redis script; `usage` counts what was served once; `reports` folds it for the
admin and /v1/usage.

Imports no other wing."""
