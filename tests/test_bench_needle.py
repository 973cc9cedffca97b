"""bench.needle: each probe's prompt fits its context with the needle at its depth, and every backend answers the
same prompts through the engine (the reference model, whose 1,024 positions hold a short probe)."""

import json

import pytest

from bench import needle
from bench.budget import load_reference

MODEL = "models/kjv-llama-mha"


@pytest.fixture(scope="module")
def tok():
    return load_reference(MODEL)[1]


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_needle_sits_at_its_depth_in_a_prompt_that_fits(tok, depth):
    lines = needle.filler_lines()
    ids = needle.build_prompt(tok, lines, 600, depth, "amber-harbor", "1234567")
    assert 560 < len(ids) <= 600  # filled to the context, a line short at most
    text = tok.decode(ids)
    at = text.index(needle.needle("amber-harbor", "1234567"))
    where = at / text.index(needle.question("amber-harbor"))  # the needle's place in the filler, 0-1
    assert abs(where - depth) < 0.05, where
    assert text.endswith(needle.answer_start("amber-harbor"))


def test_a_context_the_question_does_not_fit_is_refused(tok):
    with pytest.raises(ValueError, match="too short for the question"):
        needle.build_prompt(tok, needle.filler_lines(), 10, 0.5, "amber-harbor", "1234567")
    with pytest.raises(ValueError, match="fewer than"):
        needle.build_prompt(tok, needle.filler_lines()[:5], 600, 0.5, "amber-harbor", "1234567")


def test_probes_are_seeded_and_differ_by_trial(tok):
    a, b = needle.probes(tok, [300], [0.5], 2), needle.probes(tok, [300], [0.5], 2)
    assert [p["ids"] for p in a] == [p["ids"] for p in b]
    assert a[0]["ids"] != a[1]["ids"] and all(len(p["value"]) == 7 for p in a)


def test_the_table_counts_each_backend():
    rows = [{"backend": b, "context": 100, "depth": d, "found": f}
            for b, d, f in [("full", 0.1, True), ("full", 0.9, True), ("int4", 0.1, True), ("int4", 0.9, False)]]
    assert needle.table(rows, ["full", "int4"]).splitlines()[2:] == [
        "| 100 | 0.1 | 1/1 | 1/1 |", "| 100 | 0.9 | 1/1 | 0/1 |", "| all | | **2/2** | **1/2** |"]


def test_every_backend_answers_the_same_prompts(tmp_path):
    out = tmp_path / "needle.json"
    assert needle.main(["--model", MODEL, "--contexts", "300", "--depths", "0.5", "--trials", "2",
                        "--backends", "full", "int8", "--chunk", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["full", "full", "int8", "int8"]
    assert [r["value"] for r in rows[:2]] == [r["value"] for r in rows[2:]]
    assert all(r["prompt_tokens"] <= 300 and isinstance(r["found"], bool) and r["answer"] for r in rows)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        needle.main(["--model", MODEL, "--depths", "1.5"])
    assert needle.main(["--model", MODEL, "--backends", "int8:bits"]) == 2
    with pytest.raises(SystemExit):
        needle.main(["--model", MODEL, "--contexts", "5000"])
