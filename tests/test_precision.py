"""The value tests' device and dtype selection (``DEVICE``, ``DTYPE``: :mod:`tests.precision`) reaches the
model and the backends' stores, and ``DEVICE=cuda`` without a CUDA device stops pytest with one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.store_path import StorePath
from tests.conftest import REPO
from tests.precision import selected
from tests.test_backends import buffers_of

NO_CUDA = not torch.cuda.is_available()


def test_defaults_and_explicit_choices():
    cpu = torch.device("cpu")
    assert [(p.device, p.dtype) for p in selected(None, None)] == [(cpu, torch.float32), (cpu, torch.bfloat16)]
    assert [(p.device, p.dtype) for p in selected("auto", "auto")] == [(cpu, torch.float32), (cpu, torch.bfloat16)]
    assert [(p.device, p.dtype) for p in selected("cpu", "bfloat16")] == [(cpu, torch.bfloat16)]
    with pytest.raises(ValueError, match="DEVICE='tpu'"):
        selected("tpu", None)
    with pytest.raises(ValueError, match="DTYPE='float64'"):
        selected("cpu", "float64")


def test_tolerance_is_eps_times_the_stated_factor():
    fp32, bf16 = selected("cpu", "float32")[0], selected("cpu", "bfloat16")[0]
    assert fp32.tol(10.0, 16) == 16 * torch.finfo(torch.float32).eps * 10.0
    assert bf16.tol(0.5, 16) == 16 * 2.0 ** -7  # below 1 the scale is 1
    assert bf16.tol(10.0, 16) / fp32.tol(10.0, 16) == 2.0 ** 16  # the epsilons' ratio, nothing tuned


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")
def test_cuda_without_a_device_stops_pytest_with_one_line():
    env = {**os.environ, "DEVICE": "cuda"}
    env.pop("DTYPE", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "value",
                          "tests/test_precision.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 4, out.stdout + out.stderr
    assert "DEVICE=cuda but no CUDA device is present" in out.stderr and "nothing was tested" in out.stderr


@pytest.mark.parametrize("backend", ["full", "int8"])
def test_selection_reaches_the_model_and_the_stores(value_model, precision, backend):
    model, tok = value_model
    params = list(model.parameters())
    assert {p.device.type for p in params} == {precision.device.type}
    assert {p.dtype for p in params} == {precision.dtype}
    geometry = ModelGeometry.from_config(model.config, model.dtype)
    assert geometry.dtype_bytes == precision.dtype.itemsize
    options = {"residual": 0, "group_size": 16} if backend == "int8" else {}
    store = create(backend, geometry, **options).new_store()
    ids = tok.encode("And God said, Let there be light: and there was light. " * 3)  # > 16 tokens: int8 codes
    logits = StorePath(model, geometry.num_layers).prefill(ids, store)
    assert logits.dtype == precision.dtype and logits.device.type == precision.device.type
    buffers = [b for layer in store.layers for b in buffers_of(layer)]
    assert buffers and {b.data.device.type for b in buffers} == {precision.device.type}
    # full precision streams (K/V; int8's scales and zero points) in the dtype under test, codes in int8
    want = {precision.dtype} if backend == "full" else {precision.dtype, torch.int8}
    assert {b.data.dtype for b in buffers} == want
