"""The project's multiple-choice task (bench/tasks/kvserve_mc) and ``bench.lm_eval_backends``.

The task parses with lm-eval's task manager and has at least 60 well-formed items; one end-to-end run of the
script on the bundled model (``full``, 10 items, lm-eval ``local-completions`` against a real server) writes
an accuracy.
"""

from __future__ import annotations

import json
import os

import pytest

from bench import lm_eval_backends as lmb
from tests.conftest import MODEL_DIR, REPO

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def task():
    """The task as lm-eval's task manager loads it from the YAML (``include_path``; the YAML's data file is
    relative to the repository root)."""
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return TaskManager(include_path=str(lmb.TASK_DIR)).load([lmb.TASK])["tasks"][lmb.TASK]
    finally:
        os.chdir(cwd)


def test_task_items_are_well_formed(task):
    docs = list(task.test_docs())
    assert len(docs) >= 60
    assert task.OUTPUT_TYPE == "multiple_choice"
    assert {m["metric"] for m in task.config.metric_list} == {"acc", "acc_norm"}
    for doc in docs:
        choices = task.doc_to_choice(doc)
        assert len(choices) == 4 and len(set(choices)) == 4, doc
        assert 0 <= task.doc_to_target(doc) < 4, doc
        assert task.doc_to_text(doc) == f"Question: {doc['question']}\nAnswer:"
    assert len({doc["question"] for doc in docs}) == len(docs)
    assert len({task.doc_to_target(doc) for doc in docs}) == 4  # the right answer is not always in one place


def test_task_config_makes_the_data_file_absolute():
    files = lmb.task_config()["dataset_kwargs"]["data_files"]
    assert files == {"test": str(lmb.TASK_DIR / "kvserve_mc.jsonl")}


def test_table_rows():
    ok = {"backend": "int8", "params": {"group_size": 32}, "kv_bytes_per_token": 4000.4, "acc": 0.5,
          "acc_stderr": 0.1, "acc_norm": 0.6, "acc_norm_stderr": 0.1, "delta_acc_vs_full": -0.25}
    rows = lmb.table([ok, {"backend": "mla", "error": "RuntimeError: server exited with 1"}]).splitlines()
    assert rows[2] == "| int8 | group_size=32 | 4000 | 0.500 ± 0.100 | 0.600 ± 0.100 | -0.250 |"
    assert rows[3].startswith("| mla | - | - | error: RuntimeError: server exited with 1 |")


def test_script_end_to_end_on_the_bundled_model(tmp_path):
    out = tmp_path / "lm_eval.json"
    assert lmb.main(["--model", str(MODEL_DIR), "--backends", "full", "--limit", "10", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (entry,) = result["backends"]
    assert "error" not in entry
    assert entry["backend"] == "full" and entry["served_model"] == str(MODEL_DIR) and entry["items"] == 10
    assert entry["kv_bytes_per_token"] > 0 and entry["params"] == {}
    for key in ("acc", "acc_norm"):
        assert 0 <= entry[key] <= 1 and entry[key] * 10 == pytest.approx(round(entry[key] * 10))
    assert entry["delta_acc_vs_full"] == 0
