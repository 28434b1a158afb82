"""Loading weights: GGUF files (metadata, tensors, and quantized blocks served as stored)
and Hugging Face safetensors directories, into a model and its identity (its fingerprint).
"""
