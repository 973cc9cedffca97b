"""Pluggable KV-cache backends for kvserve.

This package's face imports nothing: Python runs it before any of its modules, so an import here would put every
backend (and torch) under the tensor-free planning modules. Backends are made by
:func:`cache_backends.registry.create`; their shapes are :class:`cache_backends.geometry.ModelGeometry`.
"""
