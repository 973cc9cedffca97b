"""``int8`` and ``int4``: quantized K/V with a full-precision residual window, optionally rotated.

The backend is :mod:`cache_backends.int8.backend`; what the rest of kvserve reads about it is declared in
:mod:`cache_backends.int8.spec` (torch-free).
"""
