"""``mla``: a low-rank latent KV cache.

The backend is :mod:`cache_backends.mla.backend`; what the rest of kvserve reads about it is declared in
:mod:`cache_backends.mla.spec` (torch-free).
"""
