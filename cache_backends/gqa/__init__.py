"""``gqa``: post-hoc head sharing — keep G shared K/V heads instead of num_key_value_heads.

The backend is :mod:`cache_backends.gqa.backend`; what the rest of kvserve reads about it is declared in
:mod:`cache_backends.gqa.spec` (torch-free).
"""
