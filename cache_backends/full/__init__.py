"""``full``: exact K/V, the baseline every other backend is measured against.

The backend is :mod:`cache_backends.full.backend`; what the rest of kvserve reads about it is declared in
:mod:`cache_backends.full.spec` (torch-free).
"""
