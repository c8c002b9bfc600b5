"""Inference: which models exist (`catalog`, `exports` on disk, what Triton serves: `serving`),
the Triton clients and tokenizers of a process (`clients`), fair scheduling and coalescing of
Triton calls, and embedding one request under its quota (`embedding`).

Imports the quotas wing only."""
