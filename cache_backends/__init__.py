"""Pluggable KV-cache backends for kvserve."""

from cache_backends.base import KVBackend, KVLayer, KVStore, ModelGeometry
from cache_backends.registry import available, create, get_backend_class

__all__ = ["KVBackend", "KVLayer", "KVStore", "ModelGeometry", "available", "create", "get_backend_class"]
