"""lm-evaluation-harness ``local-completions``, unchanged, against a real server on 127.0.0.1.

Two small local tasks (10 items each, written here): a multiple-choice task (loglikelihood requests:
``echo`` + ``logprobs`` over the prompt) and a ``generate_until`` task. Run once with tokenized requests
(token-id prompts) at batch size 4 (a list of 4 prompts per request), once with string prompts at
batch size 1, and once with no tokenizer argument (lm-eval then uses the server's tokenizer routes). The loglikelihoods lm-eval receives equal the model's own log-probabilities within 1e-4,
and its generations equal the server's greedy completions.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import MODEL_DIR

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MC = [("In the beginning God created the heaven and the", ["earth", "sea"]), ("The LORD is my", ["shepherd", "table"]),
      ("And God said, Let there be", ["light", "bread"]), ("Thou shalt love thy", ["neighbour", "stone"]),
      ("Blessed are the", ["meek", "iron"]), ("For God so loved the", ["world", "wheel"]),
      ("Our Father which art in", ["heaven", "Egypt"]), ("And the children of", ["Israel", "cattle"]),
      ("The king of", ["Judah", "sand"]), ("Thus saith the", ["LORD", "sheep"])]
GEN = ["And God said", "In the beginning", "The LORD is my shepherd", "Blessed are the", "And it came to pass",
       "Thus saith the LORD", "And the children of Israel", "Hear, O Israel", "The heavens declare", "Let there be"]
UNTIL = ["\n", "."]
MAX_GEN = 8

MC_TASK = """task: kjv_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: kjv_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    (d / "mc.jsonl").write_text("".join(json.dumps({"query": q, "choices": c}) + "\n" for q, c in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps({"query": q, "answer": "x"}) + "\n" for q in GEN))
    (d / "kjv_mc.yaml").write_text(MC_TASK.format(data=d / "mc.jsonl"))
    (d / "kjv_gen.yaml").write_text(GEN_TASK.format(data=d / "gen.jsonl", until=json.dumps(UNTIL), max_gen=MAX_GEN))
    return d


def model_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """Sum of log p(continuation tokens), split as lm-eval splits a request."""
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


@pytest.mark.parametrize("tokenized,batch_size", [(True, 4), (False, 1), (None, 1)],
                         ids=["tokenized-local-tokenizer", "strings-local-tokenizer", "no-tokenizer-argument"])
def test_lm_eval_local_completions(server, ref_model, task_dir, tokenized, batch_size):
    """``tokenized=None``: no tokenizer argument at all, as a vLLM user runs it: lm-eval finds the server's
    ``/tokenizer_info`` and ``/tokenize`` and tokenizes through them (#26: it looked the served name up on the hub)."""
    import httpx
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tok = ref_model
    args = f"base_url={server.url}/v1/completions,model=kjv-llama-mha,max_retries=1,num_concurrent=1"
    if tokenized is not None:
        args += f",tokenizer_backend=huggingface,tokenizer={MODEL_DIR},tokenized_requests={tokenized}"
    result = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["kjv_mc", "kjv_gen"],
                                     task_manager=TaskManager(include_path=str(task_dir)), batch_size=batch_size,
                                     log_samples=True)
    mc = result["samples"]["kjv_mc"]
    assert len(mc) == len(MC)
    for sample in mc:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            loglik, _ = resp[0]
            assert loglik == pytest.approx(model_loglikelihood(model, tok, context, continuation), abs=1e-4)
    assert result["results"]["kjv_mc"]["acc,none"] >= 0.5  # the model knows its KJV better than chance

    gens = result["samples"]["kjv_gen"]
    assert len(gens) == len(GEN)
    prompts = [sample["arguments"][0][0] for sample in gens]
    want = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": prompts, "max_tokens": MAX_GEN, "temperature": 0, "stop": UNTIL}).json()["choices"]
    assert [sample["resps"][0][0] for sample in gens] == [c["text"] for c in want]
