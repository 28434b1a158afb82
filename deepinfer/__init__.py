"""deepinfer: an LLM serving engine in one asyncio process."""

__version__ = "0.1.0"
