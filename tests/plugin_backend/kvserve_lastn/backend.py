"""``lastn``: :class:`~cache_backends.window.backend.WindowBackend` with no sinks (StreamingLLM's window alone,
arXiv 2309.17453), under its own name and option; its pages report the tokens it no longer keeps, which its
declaration exports as the gauge ``kvserve_lastn_dropped_tokens``."""

from cache_backends.hybrid import HybridLayout
from cache_backends.window.backend import WindowBackend


class LastNLayout(HybridLayout):
    """Window's pages, whose stats count the tokens older than the newest ``n`` (gone from every layer)."""

    n = 0

    def stats(self, blocks) -> dict:
        return {"dropped_tokens": max(0, blocks.length - self.n)}


class LastNBackend(WindowBackend):
    """The newest ``n`` tokens of every layer (itself included); older pages go back to the pool."""

    name = "lastn"
    spelled = {"window": "n"}

    def __init__(self, geometry, n: int = 64, inner=None):
        super().__init__(geometry, sinks=0, window=n, inner=inner)

    def sums_spec(self) -> tuple[str, dict]:
        name, options = self.inner.sums_spec()
        return ("lastn" if name == "full" else f"lastn+{name}"), {"n": self.window, **options}

    def page_layout(self, dtype, page_bytes: int) -> LastNLayout:
        layout = super().page_layout(dtype, page_bytes)
        ours = LastNLayout(layout.groups, layout.windows, layout.layers, layout.sinks)
        ours.n = self.window
        return ours
