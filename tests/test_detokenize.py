"""Incremental detokenization: exact concatenation, split UTF-8 characters, stop sequences held back."""

import pytest
from transformers import AutoTokenizer

from server.engine.detokenize import IncrementalDetokenizer
from tests.conftest import MODEL_DIR


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def run(tok, text, stop=()):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, list(stop), {tok.eos_token_id})
    pieces = []
    for i in ids:
        pieces.append(d.add(i))
        if d.stopped:
            break
    else:
        pieces.append(d.flush())
    return pieces, d


def test_concatenation_equals_text_with_multibyte_characters(tok):
    text = "In the beginning — “God” said: café ☃ 日本 🙂 and it was so."
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # non-ASCII characters are split into byte tokens
    pieces, d = run(tok, text)
    assert "".join(pieces) == text == d.generated_text()
    assert all("\ufffd" not in p for p in pieces)


def test_stop_sequence_never_released_even_partly(tok):
    text = "And God said, Let there be light: and there was light."
    pieces, d = run(tok, text, stop=["there was"])
    assert d.stopped
    out = "".join(pieces)
    assert out == "And God said, Let there be light: and "
    assert "there was" not in out
    # text that starts like the stop sequence but does not finish it is released at the end
    pieces, d = run(tok, "and there be light", stop=["there was"])
    assert not d.stopped and "".join(pieces) == "and there be light"


def test_special_tokens_release_no_text(tok):
    d = IncrementalDetokenizer(tok, [], {tok.eos_token_id})
    assert d.add(tok.eos_token_id) == ""
