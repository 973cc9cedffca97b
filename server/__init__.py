"""kvserve: an HTTP LLM inference server with pluggable KV-cache backends."""

__version__ = "0.1.0"
