"""``lastn``: :class:`~cache_backends.window.backend.WindowBackend` with no sinks (StreamingLLM's window alone,
arXiv 2309.17453), under its own name and option."""

from cache_backends.window.backend import WindowBackend


class LastNBackend(WindowBackend):
    """The newest ``n`` tokens of every layer (itself included); older pages go back to the pool."""

    name = "lastn"
    spelled = {"window": "n"}

    def __init__(self, geometry, n: int = 64, inner=None):
        super().__init__(geometry, sinks=0, window=n, inner=inner)

    def sums_spec(self) -> tuple[str, dict]:
        name, options = self.inner.sums_spec()
        return ("lastn" if name == "full" else f"lastn+{name}"), {"n": self.window, **options}
