"""``lastn``: a backend declared outside kvserve, found through the ``kvserve.backends`` entry point (the tests'
plug-in; ``tests/test_backend_plugin.py``). It keeps the newest ``n`` tokens on every layer and no sinks."""
