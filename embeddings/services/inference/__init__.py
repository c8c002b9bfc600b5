"""Inference: which models exist (`catalog`, `exports` on disk, what Triton serves: `serving`),
the Triton clients and tokenizers of a process (`clients`), fair scheduling and coalescing of
Triton calls, embedding one request under its quota (`embedding`), the output types its vectors
can be given in (`quantization`: int8/uint8 on the export's calibration, binary), ranking documents
against a query with a model that ranks (`ranking`), and tokenising texts and decoding token ids
with a model's tokenizer alone (`tokenizing`).

Imports the quotas wing only."""
