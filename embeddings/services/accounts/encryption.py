"""Encryption at rest for secrets the server must read back (tenants' webhook signing secrets).

Fernet (AES-128-CBC + HMAC-SHA256, from `cryptography`) with a key derived from SECRET_KEY by HKDF,
labelled for this use only. SECRET_KEY_FALLBACKS are tried for decryption as Django tries them for
signatures, so SECRET_KEY can be rotated: values still decrypt, and re-encrypt under the new key.
"""

from __future__ import annotations

import base64
import functools

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from embeddings.errors import EmbedsiteError

KEY_LABEL = b"embedsite/webhook-secrets/v1"


class SecretUndecryptable(EmbedsiteError):
    """Stored ciphertext that no current key opens (SECRET_KEY changed without a fallback)."""


def _fernet_key(secret_key: str) -> bytes:
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=KEY_LABEL).derive(
        secret_key.encode()
    )
    return base64.urlsafe_b64encode(derived)


@functools.lru_cache(maxsize=4)
def _fernet(secret_keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(_fernet_key(key)) for key in secret_keys])


def _current() -> MultiFernet:
    return _fernet((settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", ())))


def secret_encrypt(plaintext: str) -> str:
    return _current().encrypt(plaintext.encode()).decode("ascii")


def secret_decrypt(ciphertext: str) -> str:
    try:
        return _current().decrypt(ciphertext.encode("ascii")).decode()
    except (InvalidToken, UnicodeError) as error:
        raise SecretUndecryptable(
            "a stored secret cannot be decrypted with SECRET_KEY or SECRET_KEY_FALLBACKS"
        ) from error
