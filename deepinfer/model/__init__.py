"""Models: architectures, loaders (GGUF, safetensors), the ForwardBatch, kernel backends."""

from deepinfer.model.arch import ModelArch
from deepinfer.model.forward_batch import BatchChunk, ForwardBatch, build_forward_batch
from deepinfer.model.kv_layout import allocate_kv_caches, kv_bytes_per_block
from deepinfer.model.loading.loader import LoadedModel, load_model, model_fingerprint

__all__ = [
    "BatchChunk",
    "ForwardBatch",
    "LoadedModel",
    "ModelArch",
    "allocate_kv_caches",
    "build_forward_batch",
    "kv_bytes_per_block",
    "load_model",
    "model_fingerprint",
]
