"""Block hashes for the prefix cache: what makes two sequences' full blocks interchangeable.

A full block's key chains the previous block's key, the block's token ids, and a root that names everything
else that sets the stored form: the backend (name and options; its calibration is fixed for the life of the
server, and the cache lives only as long as the server) and the request's ``cache_salt``. Equal keys mean the
same tokens at the same positions after the same prefix, stored the same way (vLLM's automatic prefix
caching; SGLang's RadixAttention keeps a tree of the same information). BLAKE2b, 16-byte digests.
"""

from __future__ import annotations

import hashlib
import json
from array import array

DIGEST = 16  # bytes


def root_key(backend_name: str, params: dict, salt: str | None) -> bytes:
    """The key before a sequence's first block: its backend, the backend's options and the request's salt."""
    text = json.dumps([backend_name, params, salt], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST).digest()


def group_root(root: bytes, group: int) -> bytes:
    """The root of group ``group``'s chain on a hybrid model (:mod:`cache_backends.hybrid`): each window group keys
    its own blocks (its pages hold its layers), so the same tokens make one entry per group."""
    return hashlib.blake2b(root + group.to_bytes(4, "little"), digest_size=DIGEST).digest()


def extend_hashes(hashes: list[bytes], root: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    """Append to ``hashes`` (the keys of the first ``len(hashes)`` blocks) the key of every further full block of
    ``block_tokens`` tokens in ``tokens``; return ``hashes``."""
    for i in range(len(hashes), len(tokens) // block_tokens):
        prev = hashes[-1] if hashes else root
        block = array("q", tokens[i * block_tokens : (i + 1) * block_tokens]).tobytes()
        hashes.append(hashlib.blake2b(prev + block, digest_size=DIGEST).digest())
    return hashes
