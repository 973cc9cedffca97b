"""TGI's ``truncate`` from the tail of the text (server.prompt_tail): the same ids as tokenizing it whole, and only
the tail tokenized."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from server.prompt_tail import tail_ids
from server.service import max_bytes_per_token
from tests.conftest import MODEL_DIR

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep.\nAnd God said, Let there be light: and there was light. ") * 300


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.mark.parametrize("keep", [1, 2, 17, 100, 1000])
@pytest.mark.parametrize("cut", [0, 1, 9, 123])
def test_the_last_tokens_are_those_of_the_whole_text(tok, keep, cut):
    text = TEXT[: len(TEXT) - cut]
    for special in (True, False):
        want = tok.encode(text, add_special_tokens=special)[-keep:]
        assert tail_ids(tok, text, keep, special, max_bytes_per_token(tok)) == want


def test_only_the_tail_is_tokenized(tok, monkeypatch):
    seen = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    most = max_bytes_per_token(tok)
    ids = tail_ids(tok, TEXT * 20, 10, True, most)
    assert len(ids) == 10 and max(seen) <= (10 + 16) * most < len(TEXT)
    seen.clear()
    assert tail_ids(tok, TEXT, 10, True, None) == tok.encode(TEXT)[-10:] and seen[0] == len(TEXT)  # unbounded
