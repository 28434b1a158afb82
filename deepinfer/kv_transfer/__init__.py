"""KV transfer between replicas: a prompt prefilled on one replica (the producer) is decoded on
another (the consumer), which pulls the prompt's KV blocks over NIXL instead of computing them.

The protocol is vLLM's `kv_transfer_params` (what `vllm-router --vllm-pd-disaggregation` sends):
the router sends the prompt to a producer with `max_tokens: 1` and `do_remote_decode`; the
producer answers with `do_remote_prefill`, its engine id, side-channel address and the block ids
it keeps for the consumer; the router copies those into the consumer's request. Pulled blocks
become prefix-cache hits on the consumer, so it pulls only what its own cache lacks, and a pull
that fails or times out leaves the prompt to be computed there: never a wrong answer.
"""
