"""The project's own exceptions, under one root, and what each one is answered with.

    EmbedsiteError
    ├── ApiError            an HTTP answer in OpenAI's error shape (errors/answers.py)
    ├── ServiceError        what the services refuse (errors/service.py)
    ├── TritonError         a call to Triton without a usable answer (embeddings/triton/errors.py)
    ├── TokenizationError   a text or token ids the tokenizer refuses (embeddings/tokenization.py)
    └── the rest            a catalog, an export, a callback target, the local stack ...

(Not under it: what runs inside Triton's process, embeddings/in_triton/, which imports nothing of
ours, and private exceptions that never leave their module.)

errors/answers.py holds the one table from an exception to its answer (HTTP status, code) and to
whether a worker retries it; the API's renderer and the Celery tasks both read it. This module
imports nothing, so that the Triton client and the tokenizer (no Django) can subclass the root.
"""


class EmbedsiteError(Exception):
    """The root of every exception the project raises on purpose."""
