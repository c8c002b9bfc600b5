"""Quotas and usage: `limits` checks and reserves every rate, budget and concurrency limit of a
request in one Redis script; `usage` counts what was served once; `reports` folds it for the
admin and /v1/usage; `activity` counts the last hour's requests of every process, per model and
minute, for the admin's operations overview.

Imports no other wing."""
