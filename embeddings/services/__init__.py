"""Business logic shared by views, tasks and management commands, in wings.

    accounts/     tenants, their API keys and the secrets kept for them
    quotas/       quotas and rate limits (one Redis script a request) and usage counted once
    inference/    the model catalog, tokenizers and exports, Triton clients, fair scheduling,
                  coalescing, embedding a request, what Triton serves
    jobs/         the asynchronous job engine: submission, chunks, storage, leases, callbacks,
                  events; it knows job kinds, not the APIs built on it
    openai_api/   OpenAI's contracts: files, batches (a job kind), request lines, the embeddings body
    operations/   what the service is doing now, for operators: the admin's operations overview
    errors.py     the errors services raise; pages.py: one page of a tenant's objects

A wing imports only the wings above it in this list (accounts and quotas import no wing; operations
reads every wing but openai_api), the shared modules here, and what sits below services (models,
callers, redis, triton, tokenization); never the API, the tooling or the tasks.
tests/test_layering.py holds the house to it.
"""
