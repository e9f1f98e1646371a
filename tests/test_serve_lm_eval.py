"""lm-eval (EleutherAI's harness) against a real ``zerospeed serve`` (issue #31): its
``local-completions`` model runs a loglikelihood task (multiple choice) and a generate_until task,
both local YAML tasks over local JSON-lines files (no download), with lm-eval's remote tokenizer
(our ``/tokenizer_info``, ``/tokenize``, ``/detokenize``), and the results are compared with lm-eval's
``hf`` backend on the same model folder:

* every choice's loglikelihood to 1e-4 absolute (float32 logits of a ragged paged forward vs HF's
  SDPA; see tests/test_serve_prompt_logprobs.py), so the accuracies are equal;
* every greedy generation equal (and so exact_match).
"""

from __future__ import annotations

import json
import os

import pytest

from serve_cases import ServerProcess, build_model_dir, serve_argv

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.timeout(600)
ATOL = 1e-4

MC = [
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " gold", " worm"], "answer": 0},
    {"question": "All that glitters is not", "choices": [" gold", " power", " a banana"], "answer": 0},
    {"question": "The early bird catches the", "choices": [" worm", " arrow", " question"], "answer": 0},
    {"question": "Knowledge is", "choices": [" power", " gut", " gold"], "answer": 0},
    {"question": "Time flies like an", "choices": [" arrow", " dog", " bird"], "answer": 0},
    {"question": "To be or not to be, that is the", "choices": [" question", " fox", " step"], "answer": 0},
]
GEN = [{"question": q["question"], "answer": q["choices"][0]} for q in MC]


def write_tasks(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mc", MC), ("gen", GEN)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {{path}}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (folder / "zs_mc.yaml").write_text(
        "task: zs_mc\n" + common.replace("{path}", str(folder / "mc.jsonl"))
        + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "zs_gen.yaml").write_text(
        "task: zs_gen\n" + common.replace("{path}", str(folder / "gen.jsonl"))
        + "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def evaluate(model, model_args, task_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["zs_mc", "zs_gen"],
                           task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                           batch_size=2, num_fewshot=0, random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0)


def by_doc(result, task):
    return {s["doc_id"]: s for s in result["samples"][task]}


def test_local_completions_matches_hf_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    model_dir = build_model_dir(tmp_path / "tiny-llama")
    task_dir = tmp_path / "tasks"
    write_tasks(task_dir)
    srv = ServerProcess(serve_argv(model_dir, "--served-model-name", "tiny", "--num-blocks", "64",
                                   "--block-size", "8"))
    try:
        served = evaluate("local-completions", {
            "model": "tiny", "base_url": srv.url + "/v1/completions", "tokenizer_backend": "remote",
            "num_concurrent": 1, "max_retries": 1, "max_length": 128}, task_dir)
    finally:
        assert srv.stop() == 0, srv.output
    # lm-eval's API models never add BOS (its remote tokenizer encodes without special tokens);
    # the hf backend is told the same, so both score the same token sequences
    hf = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu",
                         "max_length": 128, "add_bos_token": False}, task_dir)
    for task in ("zs_mc", "zs_gen"):
        a, b = by_doc(served, task), by_doc(hf, task)
        assert sorted(a) == sorted(b) == list(range(len(MC)))
        for doc in a:
            if task == "zs_mc":
                got = [r[0][0] for r in a[doc]["resps"]]
                want = [r[0][0] for r in b[doc]["resps"]]
                assert all(abs(x - y) < ATOL for x, y in zip(got, want)), (doc, got, want)
            else:
                assert a[doc]["resps"] == b[doc]["resps"], doc
    assert served["results"]["zs_mc"]["acc,none"] == hf["results"]["zs_mc"]["acc,none"]
    assert served["results"]["zs_gen"]["exact_match,none"] == hf["results"]["zs_gen"]["exact_match,none"]
