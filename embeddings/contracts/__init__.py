"""Request contracts: how a request's body is read and validated, shared by the API (which answers
it) and the workers (a batch's lines are embeddings requests too), below both.

    fields.py               JSON types taken as sent, ids, cursors, `validated`
    embeddings_request.py   the body of an embeddings request: model, input, dimensions, encoding
    rerank_request.py       the bodies of rerank requests in Cohere's, Jina's and TEI's shapes
    tokenize_request.py     the bodies of TEI's /tokenize and /decode

Imports DRF and errors/ only: no service, no view.
"""
