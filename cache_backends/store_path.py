"""Running a model over per-sequence KV stores (each backend's ``new_store()``): the reference path.

Serving runs every backend from the paged pool (:mod:`server.engine.runner`). Each backend also keeps a
per-sequence store (its ``KVLayer`` classes: one object a layer, its own buffers and attention), which is what the
paged path is checked against (``tests/``), what calibration, the quality budget and the fidelity benchmarks
measure through, and what ``generate()``-style tools can use. :class:`StorePath` prefills one store at a time
and decodes a batch of them in one forward: :class:`RaggedView` presents in-place stores to the model as one
``transformers.Cache`` (each row attends to its own store at its own length, in its stored form); models whose
attention needs K/V tensors after the cache read (native MLA) use :class:`BatchedView`, which left-pads rebuilt
K/V to the longest sequence under a 4-D mask.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cache_backends.attention import BatchRead, as_read
from cache_backends.attention import install as install_attention
from cache_backends.kv_store import KVStore


class _BatchedLayerView(CacheLayerMixin):
    """One layer of :class:`BatchedView`: fans the batch's new K/V out to each sequence's store."""

    is_sliding = False
    is_compileable = False

    def __init__(self, stores: list[KVStore], layer_idx: int, past_len: int):
        super().__init__()
        self.stores = stores
        self.layer_idx = layer_idx
        self.past_len = past_len  # longest cached length in the batch, before this step
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - never lazy
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write each row's new K/V to its store; return padded K/V of every row.

        Args:
            key_states: (batch, num_key_value_heads, q_len, head_dim), after RoPE.
            value_states: (batch, num_key_value_heads, q_len, v_head_dim).

        Returns:
            keys (batch, num_key_value_heads, past_len + q_len, head_dim) and values likewise,
            each row right-aligned (left-padded with zeros).
        """
        q_len = 1 if key_states is None else key_states.shape[-2]  # None: projections skipped (dca)
        total = self.past_len + q_len
        keys = values = None
        for row, store in enumerate(self.stores):
            k, v = store.layers[self.layer_idx].update(
                None if key_states is None else key_states[row : row + 1],
                None if value_states is None else value_states[row : row + 1], *args, **kwargs)
            if keys is None:
                keys = k.new_empty(len(self.stores), k.shape[1], total, k.shape[-1])
                values = v.new_empty(len(self.stores), v.shape[1], total, v.shape[-1])
            pad = total - k.shape[-2]
            keys[row, :, pad:] = k[0]
            values[row, :, pad:] = v[0]
            if pad:  # masked, but must be finite: 0 * NaN garbage would still poison the output
                keys[row, :, :pad] = 0
                values[row, :, :pad] = 0
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.past_len

    def get_max_length(self) -> int:
        return -1


class _RaggedLayerView(_BatchedLayerView):
    """One layer of :class:`RaggedView`: each row's new K/V go to its own store; the reads go to attention."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append row i's (1, num_key_value_heads, 1, head_dim) K/V to store i; return ``(BatchRead, None)``."""
        reads = []
        for row, store in enumerate(self.stores):
            k, v = store.layers[self.layer_idx].update(
                None if key_states is None else key_states[row : row + 1],
                None if value_states is None else value_states[row : row + 1], *args, **kwargs)
            reads.append(as_read(k, v))
        return BatchRead(reads), None


class BatchedView(Cache):
    """Several sequences' KV stores seen by the model as one left-padded batch cache (one decode step)."""

    layer_view = _BatchedLayerView

    def __init__(self, stores: list[KVStore], num_layers: int):
        self.stores = stores
        self.lengths = [s.num_tokens() for s in stores]
        past = max(self.lengths)
        super().__init__(layers=[self.layer_view(stores, i, past) for i in range(num_layers)])

    def skip_kv_projection(self, layer_idx: int) -> bool:
        """Skip only when every sequence in the batch may skip (else all compute, and those that reuse ignore it)."""
        return all(s.skip_kv_projection(layer_idx) for s in self.stores)


class RaggedView(BatchedView):
    """Several sequences' KV stores seen by the model as one cache for a decode step (no padding)."""

    layer_view = _RaggedLayerView


class StorePath:
    """Prefill and decode through per-sequence stores.

    Args:
        model: a loaded causal LM (``eval()`` mode).
        num_layers: decoder layers of ``model``.
    """

    def __init__(self, model, num_layers: int):
        self.model = model
        install_attention(model)  # kvserve's stores are read by kvserve's attention function
        self.num_layers = num_layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], store: KVStore, all_logits: bool = False) -> torch.Tensor:
        """Run prompt tokens through the model into ``store``: the whole prompt, or the next chunk of it
        (positions continue from the tokens ``store`` already holds).

        Returns:
            (1, vocab_size) logits of the last prompt position, or (prompt_len, vocab_size) logits of
            every position when ``all_logits`` (for prompt log-probabilities).
        """
        ids = torch.tensor([prompt_ids], device=self.device)  # (1, prompt_len)
        out = self.model(input_ids=ids, cache=store, use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits[0]

    @torch.inference_mode()
    def decode(self, last_ids: list[int], stores: list[KVStore]) -> torch.Tensor:
        """One decode step for a batch of sequences.

        Args:
            last_ids: the newest token of each sequence (not yet in its store).
            stores: each sequence's KV store, in the same order.

        Returns:
            (batch, vocab_size) logits.
        """
        ids = torch.tensor(last_ids, device=self.device).unsqueeze(1)  # (batch, 1)
        if len(stores) == 1:
            out = self.model(input_ids=ids, cache=stores[0], use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        if all(s.in_place for s in stores):
            ragged = RaggedView(stores, self.num_layers)
            positions = torch.tensor(ragged.lengths, device=self.device).unsqueeze(1)  # (batch, 1)
            out = self.model(input_ids=ids, position_ids=positions, cache=ragged, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        view = BatchedView(stores, self.num_layers)
        lengths = torch.tensor(view.lengths, device=self.device)  # (batch,)
        past = max(view.lengths)
        positions = lengths.unsqueeze(1)  # (batch, 1): each sequence's next position
        # (batch, 1, 1, past + 1) additive mask: 0 where a row has a real cached token, -inf on padding.
        columns = torch.arange(past + 1, device=self.device)
        visible = columns.unsqueeze(0) >= (past - lengths).unsqueeze(1)  # (batch, past + 1)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None, None, :]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=view,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]
