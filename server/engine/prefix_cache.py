"""Block hashes for the prefix cache: what makes two sequences' full blocks interchangeable.

A full block's key chains the previous block's key, the block's token ids, and a root that names everything
else that sets the stored form: the backend (name and options; its calibration is fixed for the life of the
server, and the cache lives only as long as the server) and the request's ``cache_salt``. Equal keys mean the
same tokens at the same positions after the same prefix, stored the same way (vLLM's automatic prefix
caching; SGLang's RadixAttention keeps a tree of the same information). BLAKE2b, 16-byte digests.

:class:`PrefixIndex` is the KV cache manager's prefix-cache state: each live sequence's keys, by its ``seq_id``.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module imports no torch
    from server.engine.block_manager import BlockManager
    from server.engine.sequence import Sequence

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


@dataclass
class SeqKeys:
    """One sequence's prefix-cache keys (they depend on its tokens only, so they outlive a preemption).

    Attributes:
        root: its root key (:func:`root_key`: backend, options, salt).
        blocks: chained keys of its full blocks so far.
        groups: a hybrid model's: each window group's chain.
        registered: of the blocks of its current tables, those registered in the prefix cache.
    """

    root: bytes
    blocks: list[bytes] = field(default_factory=list)
    groups: list[list[bytes]] = field(default_factory=list)
    registered: int = 0


class PrefixIndex:
    """The prefix cache's per-sequence state, owned by the KV cache manager: each live sequence's
    :class:`SeqKeys`, by :attr:`~server.engine.sequence.Sequence.seq_id` (request ids may repeat in a process),
    from its first lookup until :meth:`forget`; the lookups and registrations against ``blocks``' table.

    Args:
        backends: served backends by name (``params()``: their options, in the root key).
        layouts: each backend's page layout (:class:`cache_backends.page_layout.PageLayout`, or a hybrid model's).
        blocks: the block manager whose table holds the cached blocks.
    """

    def __init__(self, backends: dict, layouts: dict, blocks: BlockManager):
        self.backends, self.layouts, self.blocks = backends, layouts, blocks
        self.keys: dict[int, SeqKeys] = {}

    def _keys(self, seq: Sequence) -> SeqKeys:
        keys = self.keys.get(seq.seq_id)
        if keys is None:
            root = root_key(seq.backend_name, self.backends[seq.backend_name].params(), seq.cache_salt)
            keys = self.keys[seq.seq_id] = SeqKeys(root)
        return keys

    def hashes(self, seq: Sequence, tokens: list[int]) -> list[bytes]:
        """The keys of ``seq``'s full blocks of ``tokens`` (a prefix of its tokens), extended as needed."""
        keys = self._keys(seq)
        return extend_hashes(keys.blocks, keys.root, tokens, self.layouts[seq.backend_name].cache_block_tokens)

    def group_hashes(self, seq: Sequence, tokens: list[int]) -> list[list[bytes]]:
        """A hybrid model's chains: each window group's keys of its full blocks of ``tokens``."""
        layout, keys = self.layouts[seq.backend_name], self._keys(seq)
        if not keys.groups:
            keys.groups = [[] for _ in layout.groups]
        return [extend_hashes(own, group_root(keys.root, g), tokens, group.cache_block_tokens)
                for g, (own, group) in enumerate(zip(keys.groups, layout.groups))]

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached pages of the longest run of full blocks ``seq``'s context starts with, leaving at least its
        last token to prefill; a hybrid model's: :meth:`cache_backends.hybrid.HybridLayout.cache_hit`."""
        context, layout = seq.context_ids, self.layouts[seq.backend_name]
        bt = layout.cache_block_tokens
        if hasattr(layout, "cache_hit"):
            most = (len(context) - 1) // bt * bt
            return layout.cache_hit(self.blocks.cached_page, self.group_hashes(seq, context[:most]), most)
        return self.blocks.lookup(self.hashes(seq, context)[: (len(context) - 1) // bt])

    def started(self, seq: Sequence, blocks: int) -> None:
        """``seq``'s tables start from ``blocks`` cached blocks: those are registered already."""
        if blocks or seq.seq_id in self.keys:
            self._keys(seq).registered = blocks

    def register(self, seq: Sequence, table) -> None:
        """Register the full blocks ``seq``'s tables ``table`` have completed since the last call."""
        layout = self.layouts[seq.backend_name]
        full = (table.q_len if layout.quantization else table.exact_len) // layout.cache_block_tokens
        keys = self._keys(seq)
        if full <= keys.registered:
            return
        pages = table.q if layout.quantization else table.exact
        hashes = self.hashes(seq, (seq.prompt_ids + seq.output_ids)[: full * layout.cache_block_tokens])
        for i in range(keys.registered, full):
            self.blocks.register(pages[i], hashes[i])
        keys.registered = full

    def register_hybrid(self, seq: Sequence, table, plan) -> None:
        """Register, under each group's chain, the blocks of a hybrid model's ``seq`` (tables ``table``) that the step
        of ``plan`` completed (:meth:`cache_backends.hybrid.HybridLayout.full_blocks`)."""
        done = self.layouts[seq.backend_name].full_blocks(table, plan)
        if done:
            hashes = self.group_hashes(seq, (seq.prompt_ids + seq.output_ids)[: table.length + plan.n])
            for g, b, page in done:
                self.blocks.register(page, hashes[g][b])

    def forget(self, seq: Sequence) -> None:
        """Drop ``seq``'s keys (it ended)."""
        self.keys.pop(seq.seq_id, None)
