"""Embed text from the shell: tokenizer -> Triton -> vector, printed as JSON."""

import orjson
from django.core.management.base import BaseCommand, CommandError

from embeddings.errors.service import ServiceError
from embeddings.services.inference.embedding import EmbeddingOptions, EmbeddingTarget, embeddings_create_sync
from embeddings.tokenization import TokenizationError
from embeddings.triton.errors import TritonError


class Command(BaseCommand):
    help = 'Embed one or more texts through the real Triton and print the vectors: embed "some text"'

    def add_arguments(self, parser):
        parser.add_argument("texts", nargs="+", help="texts to embed")
        parser.add_argument("--model", default=None, help="Triton model (default: settings.MODEL_NAME)")
        parser.add_argument("--no-truncate", action="store_true", help="fail instead of truncating")

    def handle(self, *args, texts, model, no_truncate, **options):
        try:
            target = EmbeddingTarget.default()
            if model:
                target = EmbeddingTarget(model)
            result = embeddings_create_sync(
                target=target, texts=texts, options=EmbeddingOptions(truncate=not no_truncate)
            )
        except (TokenizationError, TritonError, ServiceError) as error:
            raise CommandError(f"{type(error).__name__}: {error}") from error
        for text, vector, tokens in zip(texts, result.vectors, result.token_counts, strict=True):
            line = {
                "model": result.model,
                "text": text,
                "tokens": int(tokens),
                "dimensions": int(vector.shape[0]),
                "norm": round(float((vector.astype("float64") ** 2).sum() ** 0.5), 6),
                "embedding": vector,
            }
            self.stdout.write(orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY).decode())
