"""``snapkv``: after a prompt's prefill, each layer's K/V heads keep the prompt tokens its last queries attend to most
(SnapKV, Li et al., arXiv 2404.14469).

The backend is :mod:`cache_backends.snapkv.backend`; what the rest of kvserve reads about it is declared in
:mod:`cache_backends.snapkv.spec` (torch-free).
"""
