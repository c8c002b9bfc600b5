"""The storage collectstatic writes STATIC_ROOT with: WhiteNoise's, each distinct content compressed
once.

Django's manifest storage keeps every file twice, under its own name and under a name with its
content's hash, and WhiteNoise compresses both (Brotli at its highest level, then gzip). The two
are the same bytes unless hashing rewrote the file's references (some CSS and JS), so half of that
work, most of collectstatic's time, was done twice. Here a file whose bytes another file already
has gets copies of that file's compressed siblings instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator

from whitenoise.storage import CompressedManifestStaticFilesStorage

COMPRESSED_SUFFIXES = (".br", ".gz")


class CompressedOnceManifestStaticFilesStorage(CompressedManifestStaticFilesStorage):
    def compress_files(self, paths: Iterable[str]) -> Iterator[tuple[str, str]]:
        twins: dict[str, list[str]] = {}  # content digest -> the paths holding it
        for path in paths:
            with open(self.path(path), "rb") as file:
                digest = hashlib.file_digest(file, "sha256").hexdigest()
            twins.setdefault(digest, []).append(path)
        yield from super().compress_files(holders[0] for holders in twins.values())
        for first, *others in twins.values():
            for suffix in COMPRESSED_SUFFIXES:
                compressed = self.path(first) + suffix
                if not os.path.exists(compressed):
                    continue  # not worth compressing (WhiteNoise's call), nor is its twin
                for other in others:
                    shutil.copyfile(compressed, self.path(other) + suffix)
                    # As WhiteNoise stamps what it writes: the times of the file it compressed.
                    stat = os.stat(self.path(other))
                    os.utime(self.path(other) + suffix, (stat.st_atime, stat.st_mtime))
                    yield other, other + suffix
