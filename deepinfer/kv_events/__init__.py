"""KV cache events in vLLM's wire format (ZMQ PUB, msgpack), for cache-aware routers."""
