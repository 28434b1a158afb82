"""lm-evaluation-harness end to end: its `local-completions` model scores a local 50-question
multiple-choice task (`lm_eval_task/`) through our `/v1/completions` (`echo`, `logprobs`,
`max_tokens: 1`) on the real SmolLM2, and the accuracy it reports is the one computed here from
our own echo scores (the sum of each choice's continuation logprobs, the argmax per question).

lm-eval runs as its own process (its imports warn, and the suite turns warnings into errors),
offline, with SmolLM2's tokenizer saved from the GGUF as a Hugging Face tokenizer folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from deepinfer.environment import default_model_path
from tests.api.live_server import LiveServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed"
    ),
]

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "deepinfer_mc50"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """SmolLM2's tokenizer as lm-eval loads it (a folder), and the tokenizer itself."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out, tok


def _docs() -> list[dict[str, Any]]:
    lines = (TASK_DIR / "mc50.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into ids (`TemplateLM._encode_pair`): the whole text
    encoded once, the context's ids a prefix of it (a trailing space moves to the
    continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def _our_scores(url: str, tok: Any) -> list[list[float]]:
    """Per question, each choice's log-likelihood from our echo scores (max_tokens 0)."""
    scores = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for doc in _docs():
            context = f"Question: {doc['question']}\nAnswer:"
            row = []
            for choice in doc["choices"]:
                ctx, cont = _encode_pair(tok, context, " " + choice)
                body = {"prompt": ctx + cont, "echo": True, "logprobs": 1, "max_tokens": 0}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
                assert len(lps) == len(ctx) + len(cont)
                row.append(sum(lps[len(ctx) :]))
            scores.append(row)
    return scores


def _run_lm_eval(url: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    args = (
        f"model=smollm2,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={tokenizer},num_concurrent=1,max_retries=1,tokenized_requests=True"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions"]
    command += ["--model_args", args, "--tasks", TASK, "--include_path", str(TASK_DIR)]
    command += ["--output_path", str(out / "results"), "--log_samples", "--batch_size", "1"]
    proc = subprocess.run(
        command,
        cwd=TASK_DIR,  # the task's data_files are relative to it
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results,) = (out / "results").rglob("results_*.json")
    (samples,) = (out / "results").rglob(f"samples_{TASK}_*.jsonl")
    lines = samples.read_text().splitlines()
    return {"results": json.loads(results.read_text()), "samples": [json.loads(x) for x in lines]}


def test_lm_eval_accuracy_equals_ours(
    real_server: LiveServer, tokenizer_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    folder, tok = tokenizer_dir
    ours = _our_scores(real_server.url, tok)
    docs = _docs()
    our_acc = sum(
        max(range(len(row)), key=row.__getitem__) == doc["answer"]
        for row, doc in zip(ours, docs, strict=True)
    ) / len(docs)
    run = _run_lm_eval(real_server.url, folder, tmp_path)
    acc = run["results"]["results"][TASK]["acc,none"]
    print(f"lm-eval acc {acc:.4f}, ours {our_acc:.4f}")
    assert acc == pytest.approx(our_acc, abs=1e-12)
    assert acc > 0.5  # the model knows most answers: the scores mean something
    # question by question, the same log-likelihoods (the same server, the same ids)
    samples = sorted(run["samples"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for sample, row in zip(samples, ours, strict=True):
        theirs = [float(ll) for (ll, _greedy) in sample["filtered_resps"]]
        assert theirs == pytest.approx(row, abs=1e-3)
