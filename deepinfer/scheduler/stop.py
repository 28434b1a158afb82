"""When a request is done, decided from token ids alone (stop strings are the text layer's job)."""

from __future__ import annotations

from deepinfer.request import FinishReason, Request


def check_finished(request: Request, max_model_len: int) -> FinishReason | None:
    """The finish reason after the request's latest token was appended, or None to go on.

    A stop token (`request.stop_token_ids`: end-of-turn unless `ignore_eos`, plus the request's
    own stop ids) ends generation only past `min_tokens`: the sampler suppresses them for the
    first `min_tokens` outputs, and this check agrees with it. The stop token stays in the output
    ids (it is counted in usage; the text layer does not render it).
    """
    num_output = len(request.output_token_ids)
    if (
        num_output > request.sampling.min_tokens
        and request.output_token_ids[-1] in request.stop_token_ids
    ):
        return FinishReason.STOP
    if num_output >= request.sampling.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
