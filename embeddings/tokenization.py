"""Tokenisation in the service: HF `tokenizers` (Rust) loaded from the model repository's tokenizer.json."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
from tokenizers import Encoding, Tokenizer

from embeddings.errors import EmbedsiteError

TruncationDirection = Literal["right", "left"]


class TokenizationError(EmbedsiteError, ValueError):
    """Base for inputs the tokenizer cannot take; `index` names the offending input, `param` the
    request field that holds it."""

    def __init__(self, message: str, *, index: int | None = None, param: str = "input") -> None:
        super().__init__(message)
        self.index = index
        self.param = param

    def restated(self, message: str, *, param: str) -> TokenizationError:
        """The same error in the terms of an endpoint whose inputs are not the `input` field (a
        rerank request's query and documents)."""
        self.args = (message,)
        self.param = param
        return self


class InvalidText(TokenizationError):
    """Not a string, or not encodable as UTF-8 (e.g. lone surrogates from undecodable bytes)."""


class TokenOutsideVocabulary(InvalidText):
    """A pre-tokenised input (or ids to decode) with an id this model's vocabulary does not have."""


class InputTooLong(TokenizationError):
    """The client asked not to truncate and an input has more tokens than the model takes."""

    def __init__(self, *, index: int, tokens: int, max_tokens: int, message: str | None = None) -> None:
        super().__init__(
            message
            or f"Input {index} has {tokens} tokens, more than the model's maximum of {max_tokens}; "
            "shorten it or allow truncation.",
            index=index,
        )
        self.tokens = tokens
        self.max_tokens = max_tokens


class InputTooManyChunks(InputTooLong):
    """An input to embed in chunks that needs more chunks than an input may have."""

    def __init__(self, *, index: int, tokens: int, chunks: int, max_chunks: int, max_tokens: int) -> None:
        super().__init__(
            index=index,
            tokens=tokens,
            max_tokens=max_tokens,
            message=f"Input {index} has {tokens} tokens: {chunks} chunks of at most {max_tokens} tokens, "
            f"more than the {max_chunks} an input may have (MAX_CHUNKS_PER_INPUT); shorten it or "
            "truncate it.",
        )
        self.chunks = chunks
        self.max_chunks = max_chunks


class DocumentTooLong(InputTooLong):
    """A ranked document longer than its pair leaves room for, and truncation not allowed."""

    def __init__(self, *, index: int, tokens: int, max_tokens: int) -> None:
        super().__init__(
            index=index,
            tokens=tokens,
            max_tokens=max_tokens,
            message=f"Input {index} has {tokens} tokens; with the query, a pair leaves it {max_tokens} (the "
            "model's maximum a pair, or max_tokens_per_doc); shorten it or allow truncation.",
        )


class QueryTooLong(InputTooLong):
    """A ranking query that leaves no room in a pair for a single document token (truncation never
    cuts the query)."""

    def __init__(self, *, tokens: int, max_tokens: int) -> None:
        super().__init__(
            index=0,
            tokens=tokens,
            max_tokens=max_tokens,
            message=f"Input 0 has {tokens} tokens with the pair's special tokens, leaving no room for a "
            f"document within the model's maximum of {max_tokens} tokens a pair; shorten it.",
        )


@dataclass(frozen=True)
class TokenizedBatch:
    """Padded INT64 tensors ready for Triton, and the real (unpadded) token count per input."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_counts: np.ndarray
    truncated: np.ndarray
    # A pair's segments (0: the query's, 1: the document's, where the tokenizer tells them apart);
    # None for single texts, whose token types are all 0.
    token_type_ids: np.ndarray | None = None

    @property
    def total_tokens(self) -> int:
        return int(self.token_counts.sum())

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class ChunkedBatch:
    """Inputs split into chunks that each fit the model: one row of `batch` per chunk (an input
    that fits is one chunk), input k's rows being `starts[k]:starts[k + 1]`."""

    batch: TokenizedBatch
    starts: np.ndarray

    @property
    def inputs(self) -> int:
        return len(self.starts) - 1

    @property
    def chunk_counts(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def input_token_counts(self) -> np.ndarray:
        """Each input's tokens: its chunks' together (the overlaps and special tokens counted in each
        chunk, as the model reads them)."""
        return np.add.reduceat(self.batch.token_counts, self.starts[:-1]) if self.inputs else self.starts[:0]


def chunk_spans(length: int, *, window: int, overlap: int) -> list[tuple[int, int]]:
    """Where the chunks of `length` content tokens lie: windows of `window` tokens, each starting
    `window - overlap` after the previous, the last one ending at `length` (it may be shorter)."""
    if not 0 <= overlap < window:
        raise ValueError(f"the overlap ({overlap}) must be at least 0 and below the window ({window})")
    if length <= window:
        return [(0, length)]
    stride = window - overlap
    count = -(-(length - window) // stride) + 1
    return [(index * stride, min(index * stride + window, length)) for index in range(count)]


class Token(NamedTuple):
    """One token of a text as TEI's /tokenize lists it: its id; the text it stands for (the token
    itself, e.g. "[CLS]", for a special token the tokenizer added); and where that text lies in the
    tokenized text, as UTF-8 byte offsets (Rust's `tokenizers`, and so TEI, count bytes; Python's
    binding counts characters), None for an added special token."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


def _utf8_width(character: str) -> int:
    code = ord(character)
    return 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4


def _tokens_of(text: str, encoding: Encoding) -> list[Token]:
    """An encoding of `text` (its character offsets) as Tokens with byte offsets."""
    # byte_at[i]: where character i starts in the UTF-8 bytes (and the end, at len(text)).
    byte_at = None if text.isascii() else [0, *itertools.accumulate(map(_utf8_width, text))]
    tokens = []
    for token_id, token, (start, stop), special in zip(
        encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask, strict=True
    ):
        if special:
            tokens.append(Token(token_id, token, True, None, None))
        elif byte_at is None:
            tokens.append(Token(token_id, text[start:stop], False, start, stop))
        else:
            tokens.append(Token(token_id, text[start:stop], False, byte_at[start], byte_at[stop]))
    return tokens


def padded_length(longest: int, buckets: tuple[int, ...]) -> int:
    """Pad to the smallest bucket that fits, so Triton's native batcher sees few distinct shapes."""
    for bucket in buckets:
        if bucket >= longest:
            return bucket
    return longest


class TextTokenizer:
    """A thread-safe batch tokenizer for one model, truncating at the model's maximum."""

    def __init__(self, tokenizer_json: str, *, max_tokens: int, pad_token_id: int = 0) -> None:
        if max_tokens < 2:
            raise ValueError("max_tokens must leave room for the special tokens")
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self._json = tokenizer_json
        # `tokenizers` objects hold their truncation setting as mutable state, so each direction
        # gets its own instance (plus an untruncated one for exact counts) instead of toggling.
        self._by_direction: dict[str | None, Tokenizer] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: Path, *, max_tokens: int | None = None) -> TextTokenizer:
        text = Path(path).read_text(encoding="utf-8")
        probe = Tokenizer.from_str(text)
        if max_tokens is None:
            stored = probe.truncation
            if not stored:
                raise ValueError(f"{path} sets no truncation length; pass max_tokens")
            max_tokens = int(stored["max_length"])
        padding = probe.padding or {}
        return cls(text, max_tokens=max_tokens, pad_token_id=int(padding.get("pad_id", 0)))

    def _tokenizer(self, direction: TruncationDirection | None) -> Tokenizer:
        tokenizer = self._by_direction.get(direction)
        if tokenizer is None:
            with self._lock:
                tokenizer = self._by_direction.get(direction)
                if tokenizer is None:
                    tokenizer = Tokenizer.from_str(self._json)
                    tokenizer.no_padding()
                    if direction is None:
                        tokenizer.no_truncation()
                    else:
                        tokenizer.enable_truncation(self.max_tokens, direction=direction)
                    self._by_direction[direction] = tokenizer
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer(None).get_vocab_size(with_added_tokens=True)

    def encode_ids(
        self, token_ids: list[list[int]], *, truncate: bool = True, direction: TruncationDirection = "right"
    ) -> TokenizedBatch:
        """Pre-tokenised input, used as given (special tokens included if the client added them)."""
        vocab_size = self.vocab_size
        lengths = np.fromiter((len(ids) for ids in token_ids), dtype=np.int64, count=len(token_ids))
        if not truncate and (lengths > self.max_tokens).any():
            index = int(np.flatnonzero(lengths > self.max_tokens)[0])
            raise InputTooLong(index=index, tokens=int(lengths[index]), max_tokens=self.max_tokens)
        truncated = lengths > self.max_tokens
        lengths = np.minimum(lengths, self.max_tokens)
        width = int(lengths.max()) if len(lengths) else 0
        input_ids = np.full((len(token_ids), width), self.pad_token_id, dtype=np.int64)
        for row, ids in enumerate(token_ids):
            if not ids:
                raise InvalidText(f"Input {row} is an empty list of token ids", index=row)
            kept = ids[: self.max_tokens] if direction == "right" else ids[-self.max_tokens :]
            try:
                input_ids[row, : lengths[row]] = kept
            except (TypeError, ValueError, OverflowError):
                raise InvalidText(f"Input {row} must be a list of integer token ids", index=row) from None
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
            row = int(np.flatnonzero(((input_ids < 0) | (input_ids >= vocab_size)).any(axis=1))[0])
            raise TokenOutsideVocabulary(
                f"Input {row} has token ids outside the vocabulary [0, {vocab_size})", index=row
            )
        attention_mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return TokenizedBatch(input_ids, attention_mask, lengths, truncated)

    def tokenize(
        self, texts: Sequence[str], *, add_special_tokens: bool = True, group_characters: int = 65_536
    ) -> Iterator[list[Token]]:
        """Each text's tokens in order, untruncated (as TEI's /tokenize gives them), with where each
        lies in its text (see Token). Texts are tokenised a group of about `group_characters` at a
        time, as the caller draws them: one who stops drawing (a request over its token limit)
        leaves the rest untokenised."""
        for index, text in enumerate(texts):
            _check_text(index, text)
        whole = self._tokenizer(None)
        start = 0
        while start < len(texts):
            end, characters = start, 0
            while end < len(texts) and (end == start or characters + len(texts[end]) <= group_characters):
                characters += len(texts[end])
                end += 1
            group = list(texts[start:end])
            for text, encoding in zip(
                group, whole.encode_batch(group, add_special_tokens=add_special_tokens), strict=True
            ):
                yield _tokens_of(text, encoding)
            start = end

    def decode(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
        """The texts of rows of token ids (TEI's /decode); an id outside the vocabulary is refused
        (the tokenizer would drop it silently), naming its row."""
        vocab_size = self.vocab_size
        for row, ids in enumerate(rows):
            if not ids:
                raise InvalidText(f"Sequence {row} is an empty list of token ids", index=row, param="ids")
            outside = next((token_id for token_id in ids if not 0 <= token_id < vocab_size), None)
            if outside is not None:
                raise TokenOutsideVocabulary(
                    f"Sequence {row} has the token id {outside}, outside this model's vocabulary "
                    f"[0, {vocab_size})",
                    index=row,
                    param="ids",
                )
        return self._tokenizer(None).decode_batch(
            [list(ids) for ids in rows], skip_special_tokens=skip_special_tokens
        )

    def count_tokens(self, text: str) -> int:
        """Untruncated length, special tokens included."""
        return len(self._tokenizer(None).encode(text).ids)

    def encode(
        self,
        texts: list[str],
        *,
        truncate: bool = True,
        direction: TruncationDirection = "right",
        buckets: tuple[int, ...] = (),
        max_tokens: int | Sequence[int] | None = None,
    ) -> TokenizedBatch:
        """The texts' ids (special tokens added), truncated (or, without `truncate`, refused) at the
        model's maximum, or below it at `max_tokens`: one limit for every text, or one per text
        (a rerank request's query and its documents)."""
        for index, text in enumerate(texts):
            _check_text(index, text)
        if not texts:
            empty = np.zeros((0, 0), dtype=np.int64)
            counts = np.zeros(0, dtype=np.int64)
            return TokenizedBatch(empty, empty.copy(), counts, counts.astype(bool))
        # The fast variant skips character offsets (unused here): ~18% less tokenising CPU.
        encodings = self._tokenizer(direction).encode_batch_fast(texts, add_special_tokens=True)
        rows = [encoding.ids for encoding in encodings]
        lengths = np.fromiter((len(ids) for ids in rows), dtype=np.int64, count=len(rows))
        truncated = np.fromiter((bool(e.overflowing) for e in encodings), dtype=bool, count=len(encodings))
        # Only a lower limit costs anything: the tokenizer itself truncates at the model's maximum.
        limits = None
        if max_tokens is not None:
            asked = np.broadcast_to(np.asarray(max_tokens, dtype=np.int64), lengths.shape)
            limits = np.minimum(asked, self.max_tokens)
            if (limits < 2).any():
                raise ValueError("max_tokens must leave room for the special tokens")
            for row in np.flatnonzero(lengths > limits):
                rows[row] = _cut(encodings[row], int(limits[row]), direction)
                lengths[row], truncated[row] = len(rows[row]), True
        if not truncate and truncated.any():
            index = int(np.flatnonzero(truncated)[0])
            raise InputTooLong(
                index=index,
                tokens=self.count_tokens(texts[index]),
                max_tokens=self.max_tokens if limits is None else int(limits[index]),
            )
        return self._padded(rows, lengths, truncated, buckets)

    def encode_chunks(
        self,
        texts: list[str],
        *,
        overlap: int,
        max_chunks: int,
        buckets: tuple[int, ...] = (),
    ) -> ChunkedBatch:
        """The texts' rows as `encode` gives them, except that a text longer than the model's maximum
        is not cut but split: its own tokens (special tokens aside) into windows that leave room for
        the special tokens, `overlap` tokens shared by neighbours, each window wrapped in the special
        tokens the tokenizer's template put around the whole text ([CLS] ... [SEP], <s> ... </s>).
        A text that would take more than `max_chunks` chunks is refused (InputTooManyChunks)."""
        for index, text in enumerate(texts):
            _check_text(index, text)
        if not texts:
            empty = self.encode([])
            return ChunkedBatch(empty, np.zeros(1, dtype=np.int64))
        encodings = self._tokenizer(None).encode_batch_fast(texts, add_special_tokens=True)
        rows: list[list[int]] = []
        starts = [0]
        for index, encoding in enumerate(encodings):
            ids = encoding.ids
            if len(ids) <= self.max_tokens:
                rows.append(ids)
            else:
                head, tail = _special_ends(encoding)
                window = self.max_tokens - head - (len(ids) - tail)
                spans = chunk_spans(tail - head, window=window, overlap=overlap)
                if len(spans) > max_chunks:
                    raise InputTooManyChunks(
                        index=index,
                        tokens=len(ids),
                        chunks=len(spans),
                        max_chunks=max_chunks,
                        max_tokens=self.max_tokens,
                    )
                rows += [ids[:head] + ids[head + start : head + stop] + ids[tail:] for start, stop in spans]
            starts.append(len(rows))
        truncated = np.zeros(len(rows), dtype=bool)
        lengths = np.fromiter((len(ids) for ids in rows), dtype=np.int64, count=len(rows))
        batch = self._padded(rows, lengths, truncated, buckets)
        return ChunkedBatch(batch, np.asarray(starts, dtype=np.int64))

    def encode_pairs(
        self,
        query: str,
        documents: list[str],
        *,
        truncate: bool = True,
        direction: TruncationDirection = "right",
        max_document_tokens: int | None = None,
        buckets: tuple[int, ...] = (),
    ) -> TokenizedBatch:
        """(query, document) pairs, one row per document, as a cross-encoder was trained on them: the
        tokenizer's own pair template ([CLS] q [SEP] d [SEP], <s> q </s></s> d </s>, ...) with its
        token types. Only the document is cut: to `max_document_tokens`, and to what the query leaves
        of the model's maximum. Errors name input 0 for the query and input k for document k - 1 (as
        a similarity ranking's, whose inputs are the query and then the documents)."""
        texts = [query, *documents]
        for index, text in enumerate(texts):
            _check_text(index, text)
        whole = self._tokenizer(None)
        max_tokens = self.max_tokens
        specials = whole.num_special_tokens_to_add(True)
        # The texts alone, without special tokens; the pair template adds them.
        encodings = whole.encode_batch_fast(texts, add_special_tokens=False)
        query_encoding, document_encodings = encodings[0], encodings[1:]
        room = max_tokens - specials - len(query_encoding.ids)
        if room < 1:
            raise QueryTooLong(tokens=len(query_encoding.ids) + specials, max_tokens=max_tokens)
        limit = room if max_document_tokens is None else min(room, max_document_tokens)
        lengths = np.fromiter((len(e.ids) for e in document_encodings), dtype=np.int64, count=len(documents))
        truncated = lengths > limit
        if not truncate and truncated.any():
            row = int(np.flatnonzero(truncated)[0])
            raise DocumentTooLong(index=row + 1, tokens=int(lengths[row]), max_tokens=limit)
        rows, types = [], []
        for row, encoding in enumerate(document_encodings):
            if truncated[row]:
                encoding.truncate(limit, direction=direction)
            pair = whole.post_process(query_encoding, encoding, add_special_tokens=True)
            rows.append(pair.ids)
            types.append(pair.type_ids)
        counts = np.fromiter((len(ids) for ids in rows), dtype=np.int64, count=len(rows))
        return self._padded(rows, counts, truncated, buckets, types=types)

    def _padded(
        self,
        rows: list[list[int]],
        lengths: np.ndarray,
        truncated: np.ndarray,
        buckets: tuple[int, ...],
        *,
        types: list[list[int]] | None = None,
    ) -> TokenizedBatch:
        """Rows of ids (and a pair batch's token types) right-padded to the longest, or to its bucket."""
        width = padded_length(int(lengths.max()), buckets) if len(rows) else 0
        input_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        for row, ids in enumerate(rows):
            input_ids[row, : lengths[row]] = ids
        token_type_ids = None
        if types is not None:
            token_type_ids = np.zeros((len(rows), width), dtype=np.int64)
            for row, row_types in enumerate(types):
                token_type_ids[row, : lengths[row]] = row_types
        attention_mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return TokenizedBatch(input_ids, attention_mask, lengths, truncated, token_type_ids)


def _check_text(index: int, text: object) -> None:
    if not isinstance(text, str):
        raise InvalidText(f"Input {index} is not a string", index=index)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidText(f"Input {index} is not valid UTF-8 text", index=index) from None


def _special_ends(encoding) -> tuple[int, int]:
    """Where the encoding's own tokens lie between its leading and trailing special tokens."""
    ids, special = encoding.ids, encoding.special_tokens_mask
    head = 0
    while head < len(ids) and special[head]:
        head += 1
    tail = len(ids)
    while tail > head and special[tail - 1]:
        tail -= 1
    return head, tail


def _cut(encoding, limit: int, direction: TruncationDirection) -> list[int]:
    """The encoding's ids cut to `limit`, its leading and trailing special tokens kept ([CLS] ...
    [SEP], <s> ... </s>): the text's own tokens are dropped from the end (or, "left", the start)."""
    ids = encoding.ids
    head, tail = _special_ends(encoding)
    keep = max(0, limit - head - (len(ids) - tail))
    content = ids[head:tail]
    content = content[:keep] if direction == "right" else content[len(content) - keep :]
    return ids[:head] + content + ids[tail:]


@cache
def tokenizer_for(path: str, max_tokens: int | None = None) -> TextTokenizer:
    """One tokenizer per file per process."""
    return TextTokenizer.from_file(Path(path), max_tokens=max_tokens)
