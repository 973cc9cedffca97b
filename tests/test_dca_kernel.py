"""``dca``'s reuse layers read in place by the attention kernel (:func:`cache_backends.dca.paged.
attend_in_place_through_map`: the layer's own pages with :func:`kernels.attention_lse`, its source's with the map
folded in, :func:`kernels.mixed_attention`, merged by their log-sum-exp) against the torch path over the same pages
gathered (:func:`cache_backends.dca.paged.attend_through_map`), inside the engine's own steps: every reuse layer's
output of every decode step (rows reading their source, their window, or falling back) compared."""

from __future__ import annotations

import pytest
import torch

from cache_backends import kernels
from cache_backends.dca import backend as dca_backend
from cache_backends.dca.paged import attend_through_map, gathered
from cache_backends.geometry import ModelGeometry
from tests.conftest import fits

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"the attention kernel is not available: "
                                                           f"{kernels.status()['reason']}")


@pytest.fixture(scope="module")
def setup(ref_model):
    from cache_backends.calibration import calibration_ids

    model, tok = ref_model
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    return model, tok, geometry, calibration_ids(model, tok, max_tokens=4096)


@pytest.mark.parametrize("name,options", [
    ("dca", {"threshold": -1.0, "window": 32}), ("dca", {"threshold": -1.0, "window": 0, "align": "none"}),
    ("dca", {"probe_interval": 2}), ("dca+int8", {"threshold": -1.0}), ("dca+int4", {"threshold": -1.0}),
    ("dca+int8", {"probe_interval": 3, "window": 0})],
    ids=["reuse-window", "reuse-no-map", "fallbacks", "int8-reuse", "int4-reuse", "int8-fallbacks"])
def test_a_reuse_layer_read_in_place_gives_the_gathered_attention(setup, name, options, monkeypatch):
    """Three prompts served together: each reuse layer's attention through the kernel (the source's and its own pages
    in place) equals, within fp32 rounding, the torch path's over the same pages gathered, in every step; the kernel
    path is the one the engine takes."""
    from cache_backends.registry import create
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence
    from tests.engine_helpers import make_engine, run_all

    model, tok, geometry, calib = setup
    backend = create(name, geometry, **options)
    backend.prepare(model, calib, fits(model))
    in_place = dca_backend.attend_in_place_through_map
    calls = []

    def checked(layer_map, query, src, src_meta, own, own_meta, own_from, scaling, limit):
        got = in_place(layer_map, query, src, src_meta, own, own_meta, own_from, scaling, limit)
        src_kv = backend.inner.stored_kv(0, gathered(src, src_meta), src_meta)
        own_kv = backend.inner.stored_kv(0, gathered(own, own_meta), own_meta)
        want = attend_through_map(layer_map, query, src_kv, src_meta, own_kv, own_meta, own_from, scaling, limit)
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
        calls.append((query.shape[2], bool((own_from > 0).any()), bool((own_from == 0).any())))
        return got

    monkeypatch.setattr(dca_backend, "attend_in_place_through_map", checked)
    prompts, n = [calib[:100], calib[300:345], calib[600:700]], 24
    engine = make_engine(model, tok, name, prepared=backend)
    seqs = [Sequence(request_id=str(i), prompt_ids=list(p), max_new_tokens=n, params=SamplingParams(), stop=[],
                     backend_name=name) for i, p in enumerate(prompts)]
    run_all(engine, seqs)
    assert calls, "no reuse layer went through the kernel"
    assert all(n_new == 1 for n_new, _, _ in calls)  # a prompt attends its own K/V (own_from 0): no source read


def test_ranges_before_and_from_split_a_steps_tokens_at_a_position():
    """:meth:`StepMeta.ranges_before` and :meth:`ranges_from` cut each query's visible tokens at a position: the
    two together see what the step's ranges see, and nothing twice (exact and quantized layouts)."""
    from cache_backends.page_plan import SeqBlocks
    from tests.test_kernels import Pool, _grow

    for tier in ("exact", "int8"):
        pool = Pool(tier, 2, 64, torch.float32, tokens_per_page=16, seed=3)
        rows = [SeqBlocks() for _ in range(3)]
        _grow(pool, rows, [40, 70, 100], chunk=50)
        meta = pool.write(rows, [1, 1, 1], commit=False)
        cut = torch.tensor([[0], [33], [80]])
        before, after = meta.ranges_before(cut), meta.ranges_from(cut)

        def seen(r):  # per row, the positions the ranges let the query see
            out = []
            for b in range(3):
                q, lo, hi = (int(x) for x in r[b, 0, :3])
                q0 = int(r[b, 0, 3]) if r.shape[-1] > 3 else 0
                codes = meta.positions[b, q0:q].tolist()
                exact = meta.positions[b, meta.q_width + lo: meta.q_width + hi].tolist()
                out.append(sorted(codes + exact))
            return out

        whole, b_seen, a_seen = seen(meta.ranges), seen(before), seen(after)
        for b in range(3):
            assert sorted(b_seen[b] + a_seen[b]) == whole[b]
            assert all(p < int(cut[b]) for p in b_seen[b]) and all(p >= int(cut[b]) for p in a_seen[b])
        pool.commit()
