"""``elastic``: exact K/V while the KV pool has room, int8 for the oldest tokens only when it runs out.

The backend is :mod:`cache_backends.elastic.backend`; what the rest of kvserve reads about it is declared in
:mod:`cache_backends.elastic.spec` (torch-free).
"""
