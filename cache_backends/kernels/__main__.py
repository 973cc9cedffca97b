"""``python -m cache_backends.kernels build``: compile the attention kernel into ``KVSERVE_KERNELS_DIR`` (what
``make install`` and the Docker image's build stage run); ``status``: print what a CPU server would attend with."""

from __future__ import annotations

import json
import sys

from cache_backends import kernels


def main(argv: list[str]) -> int:
    if argv[:1] not in (["build"], ["status"]):
        print("usage: python -m cache_backends.kernels {build|status}", file=sys.stderr)
        return 2
    if argv[0] == "build":
        try:
            print(kernels.build())
        except RuntimeError as exc:
            print(f"kvserve: {exc}", file=sys.stderr)
            return 1
        return 0
    print(json.dumps(kernels.status("cpu")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
