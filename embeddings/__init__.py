"""The embeddings app: tenants, the embedding API and its Triton backend."""
