"""``full``'s declaration: the exact baseline, per-head K and V in the model's dtype."""

from cache_backends.declaration import BackendDecl

DECLARATIONS = (
    BackendDecl(name="full", backend="cache_backends.full.backend:FullBackend",
                summary="exact; the baseline when memory allows", native_mla=True, windowed_pool=True, order=0),
)
