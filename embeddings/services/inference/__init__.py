"""Inference: which models exist (`catalog`, `exports` on disk, what Triton serves: `serving`),
the Triton clients and tokenizers of a process (`clients`), fair scheduling and coalescing of
Triton calls, embedding one request under its quota (`embedding`), and ranking documents against a
query with a model that ranks (`ranking`).

Imports the quotas wing only."""
