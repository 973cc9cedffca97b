"""Property-based tests of the incremental detokenizer over random token streams of the real tokenizer.

For any token stream and any stop list (no U+FFFD in a stop: the detokenizer cannot tell an invalid
byte from an unfinished character until the next token, and no user writes U+FFFD as a stop):
- after every token, the released text is exactly what a brute-force oracle over the whole decoded
  text allows: cut before the earliest occurrence of any stop, else everything but the longest tail
  that could still start a stop (an unfinished UTF-8 character at the end is not yet visible);
- the output never contains a stop, is the longest prefix before the earliest match in the text
  generated until the first stop appeared, and the streamed pieces concatenate to it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from server.engine.detokenize import IncrementalDetokenizer
from tests.conftest import MODEL_DIR

TOK = AutoTokenizer.from_pretrained(MODEL_DIR)  # models/kjv-llama-mha/tokenizer.json
SPECIAL = {TOK.eos_token_id}
TEXTS = [
    "And God said, Let there be light: and there was light. And God saw the light, that it was good.",
    "The LORD is my shepherd; I shall not want.\nHe maketh me to lie down in green pastures.",
    "In the beginning — “God” said: café ☃ 日本 🙂 and it was so.\n\nAnd the evening",
]
TEXT_IDS = [TOK.encode(t, add_special_tokens=False) for t in TEXTS]
MULTIBYTE_IDS = sorted({i for t in ("—“”é☃日本🙂", "ü€𝄞") for i in TOK.encode(t, add_special_tokens=False)})
ALPHABET = "aehst ,.:\n;AGLdnoru—é☃"


def decode(ids: list[int]) -> str:
    return TOK.decode([i for i in ids if i not in SPECIAL], skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)


def oracle(visible: str, stops: list[str]) -> tuple[str, bool]:
    """What may be released of ``visible`` by now, and whether a stop occurred."""
    starts = [visible.find(s) for s in stops if s in visible]
    if starts:
        return visible[: min(starts)], True
    held = max((n for s in stops for n in range(1, len(s)) if visible.endswith(s[:n])), default=0)
    return visible[: len(visible) - held], False


token = st.one_of(st.integers(0, TOK.vocab_size - 1), st.sampled_from(MULTIBYTE_IDS), st.just(TOK.eos_token_id))
streams = st.one_of(
    st.lists(token, max_size=40),  # random ids: byte tokens in any order, invalid UTF-8 included
    st.builds(lambda ids, a, n: ids[a: a + n], st.sampled_from(TEXT_IDS), st.integers(0, 40), st.integers(0, 40)),
    st.builds(lambda a, b: a + b, st.sampled_from(TEXT_IDS), st.lists(token, max_size=10)),
)


@st.composite
def stream_and_stops(draw):
    ids = draw(streams)
    text = decode(ids)

    def substring():
        if not text:
            return draw(st.text(ALPHABET, min_size=1, max_size=4))
        a = draw(st.integers(0, len(text) - 1))
        return text[a: a + draw(st.integers(1, 6))]

    stop = st.one_of(st.text(ALPHABET, min_size=1, max_size=4), st.builds(lambda _: substring(), st.none()))
    stops = draw(st.lists(stop, min_size=0, max_size=4))
    return ids, [s for s in stops if "\ufffd" not in s]


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(stream_and_stops())
def test_stream_matches_the_oracle_at_every_token(case):
    ids, stops = case
    d = IncrementalDetokenizer(TOK, stops, SPECIAL)
    released, pieces, visible, used = "", [], "", 0
    for used, i in enumerate(ids, 1):
        piece = d.add(i)
        pieces.append(piece)
        released += piece
        now = decode(ids[:used])
        if not now.endswith("\ufffd"):  # an unfinished character at the end stays invisible
            visible = now
        expected, stopped = oracle(visible, stops)
        assert released == expected, (ids[:used], stops)
        assert d.stopped == stopped
        if stopped:
            break
    else:
        pieces.append(d.flush())  # the end: everything held back is released
        released = "".join(pieces)

    generated = decode(ids[:used])
    assert not any(s in released for s in stops)
    matches = [generated.find(s) for s in stops if s in generated]
    assert released == (generated[: min(matches)] if matches else generated)
    assert "".join(pieces) == released == d.generated_text()


@pytest.mark.parametrize("stops", [["e", "h"], ["h", "e"], ["light", "ght"], ["And", "\nAnd"], ["\nAnd", "And"]])
def test_every_stop_order_gives_the_same_result(stops):
    ids = TOK.encode(TEXTS[0] + "\nAnd God", add_special_tokens=False)
    outs = []
    for order in (stops, stops[::-1]):
        d = IncrementalDetokenizer(TOK, order, SPECIAL)
        outs.append("".join(d.add(i) for i in ids if not d.stopped) + d.flush())
    text = TEXTS[0] + "\nAnd God"
    assert outs[0] == outs[1] == text[: min(text.find(s) for s in stops)]
