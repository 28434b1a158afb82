"""OpenAI chat completions, completions and models, and vLLM's /tokenize and /detokenize."""
