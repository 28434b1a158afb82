"""`runner/prompt_logprobs.py`: prompt rows scored against a plain log_softmax, in slices, and
gathered over a prompt's chunks (restarted chunks replace what they recompute)."""

from __future__ import annotations

import torch

from deepinfer.request import Request, SamplingParams
from deepinfer.runner.prompt_logprobs import SLICE_ROWS, PromptLogprobTable, score_rows
from deepinfer.scheduler.output import ScheduledChunk

VOCAB, HIDDEN = 97, 8


def _head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def test_score_rows_equal_log_softmax_across_slices() -> None:
    head = _head()
    n = SLICE_ROWS + 40  # two slices
    hidden = torch.randn(n, HIDDEN)
    targets = torch.randint(0, VOCAB, (n,)).tolist()
    with torch.no_grad():
        got = score_rows(hidden, targets, 4, head)
        want = torch.log_softmax(head(hidden), dim=1)
    for i, e in enumerate(got):
        row = want[i]
        assert e.token_id == targets[i]
        assert abs(e.logprob - row[targets[i]].item()) < 1e-5
        assert e.rank == 1 + int((row > row[targets[i]]).sum())
        top = row.topk(4)
        assert [t for t, _ in e.top_logprobs] == top.indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in e.top_logprobs]), top.values)


def _chunk(request: Request, start: int, n: int) -> ScheduledChunk:
    sample = start + n == request.num_prompt_tokens
    return ScheduledChunk(request, start, n, (1, 2, 3, 4), sample)


def test_table_gathers_chunks_and_restarts() -> None:
    """A prompt of 10 in chunks of 4, 4, 2 (7 prompt rows before the last position), restarted
    once after its first two chunks: the entries are each position's once, then handed out
    with the chunk that samples, each request with its own number of alternatives."""
    head = _head()
    prompt = [5, 9, 2, 40, 41, 3, 7, 7, 60, 1]
    request = Request("a", prompt, SamplingParams(prompt_logprobs=1))
    other = Request("b", prompt[:3], SamplingParams(prompt_logprobs=3))
    hidden = torch.randn(len(prompt), HIDDEN)
    table = PromptLogprobTable()
    plan = [(0, 4), (4, 4), (0, 4), (4, 4), (8, 2)]  # a restart after two chunks
    for start, n in plan:
        chunks = [_chunk(request, start, n)]
        if start == 8:
            chunks.append(_chunk(other, 0, 3))
        rows = [c.num_prompt_logits for c in chunks]
        assert rows[0] == min(start + n, len(prompt) - 1) - start
        parts = [hidden[start : start + rows[0]]] + ([hidden[:2]] if len(chunks) > 1 else [])
        with torch.no_grad():
            table.add(chunks, torch.cat(parts), head)
        out = table.take(chunks)
        assert (request.request_id in out) == (start == 8)
    with torch.no_grad():
        want = torch.log_softmax(head(hidden), dim=1)
    entries = out["a"]
    assert [e.token_id for e in entries] == prompt[1:]
    for i, e in enumerate(entries):
        assert abs(e.logprob - want[i, prompt[i + 1]].item()) < 1e-5
        assert len(e.top_logprobs) == 1
    assert [len(e.top_logprobs) for e in out["b"]] == [3, 3]
    table.release(["a", "b"])
