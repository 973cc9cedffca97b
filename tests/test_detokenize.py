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


def test_earliest_stop_wins_whatever_the_list_order(tok):
    """The stop that occurs first in the text ends it, not the first one listed (issue #14)."""
    for stop in (["e", "h"], ["h", "e"]):
        pieces, d = run(tok, "and there was light", stop=stop)
        assert d.stopped and "".join(pieces) == d.generated_text() == "and t"
    for stop in (["And", "\nAnd"], ["\nAnd", "And"]):
        pieces, d = run(tok, "light.\nAnd God saw", stop=stop)
        assert "".join(pieces) == "light."
    # a longer stop that starts earlier wins over a shorter one inside it, once both are in the text
    pieces, d = run(tok, "and there was light", stop=["was", "there was"])
    assert "".join(pieces) == "and "


def test_a_stop_that_never_completes_is_not_a_match(tok):
    """Generation stops as soon as any stop occurs: a longer stop that the text would only have
    completed later does not pull the cut back."""
    d = IncrementalDetokenizer(tok, ["there was", "th"], {tok.eos_token_id})
    out = "".join(d.add(i) for i in tok.encode("and there was", add_special_tokens=False) if not d.stopped)
    assert d.stopped and out == "and "


def test_detokenization_decodes_a_bounded_window_per_token(tok):
    """Each token decodes only the ids since the last release (and the chunk before it), never all ids."""
    lengths = []

    class Counting:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tok.decode(ids, **kw)

    text = "In the beginning God created the heaven and the earth. " * 40
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 400
    d = IncrementalDetokenizer(Counting(), [], {tok.eos_token_id})
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert out == text
    assert max(lengths) <= 4
