"""``window``: attention sinks plus a window of recent tokens on every layer (StreamingLLM, Xiao et al., arXiv

The backend is :mod:`cache_backends.window.backend`; what the rest of kvserve reads about it is declared in
:mod:`cache_backends.window.spec` (torch-free).
"""
