"""Stages as data: the op registry's math (NumPy oracle, finite differences), spec parsing, weight caching."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gradcoll.errors import UsageError
from gradcoll.node import OPS, OpSpec, StageSpec, WeightCache, compile_stage, weight_cache
from gradcoll.node.stage import backward, bind, forward


def _naive_gelu(x: np.ndarray) -> np.ndarray:
    return np.array([0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))) for v in x.ravel()]
                    ).reshape(x.shape)


def test_stage_runs_every_op_like_the_numpy_oracle() -> None:
    rng = np.random.default_rng(1)
    w, b, bias = rng.normal(size=(3, 4)), rng.normal(size=3), rng.normal(size=3)
    arrays = {"mem://w": w, "mem://b": b, "mem://bias": bias}
    spec = StageSpec([OpSpec.of("linear", weight="mem://w", bias="mem://b"), OpSpec.of("gelu"),
                      OpSpec.of("scale", factor=2.5), OpSpec.of("add_bias", bias="mem://bias"), OpSpec.of("relu"),
                      OpSpec.of("softmax")], stage_id="all", dtype="float64")
    stage = compile_stage(spec, arrays.__getitem__)
    x = rng.normal(size=(5, 4))
    h = np.maximum(_naive_gelu(x @ w.T + b) * 2.5 + bias, 0)
    want = np.exp(h) / np.exp(h).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(stage(x), want, rtol=1e-12)
    np.testing.assert_allclose(stage(x[0]), want[0], rtol=1e-12)  # one activation vector, same ops


@pytest.mark.parametrize("name", sorted(OPS))
def test_backward_matches_finite_differences(name: str) -> None:
    rng = np.random.default_rng(2)
    params = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=3), "v": rng.normal(size=4)}
    args = {"linear": {"weight": "w", "bias": "b"}, "scale": {"factor": -1.5}, "add_bias": {"bias": "v"}}.get(name, {})
    bound = bind([OpSpec.of(name, **args)], params.__getitem__, "float64")
    x = rng.normal(size=(2, 4))
    out, caches = forward(bound, x)
    g = rng.normal(size=out.shape)
    dx, _ = bound[0].defn.backward(g, caches[0], bound[0].args)
    analytic = {"x": dx, **backward(bound, caches, g)}
    # d(sum(g * f(x))) by central differences, for the input and every parameter
    for ref, arr in [("x", x)] + [(r, params[r]) for r in bound[0].refs.values()]:
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + 1e-6
            hi = (g * forward(bound, x)[0]).sum()
            arr[i] = old - 1e-6
            lo = (g * forward(bound, x)[0]).sum()
            arr[i] = old
            num[i] = (hi - lo) / 2e-6
        np.testing.assert_allclose(analytic[ref], num, rtol=1e-5, atol=1e-7, err_msg=f"{name} d/d{ref}")


def test_shared_parameter_gradients_add_up() -> None:
    w = np.eye(2)
    bound = bind([OpSpec.of("linear", weight="w"), OpSpec.of("linear", weight="w")], {"w": w}.__getitem__, "float64")
    out, caches = forward(bound, np.array([[1.0, 2.0]]))
    grads = backward(bound, caches, np.ones_like(out))
    np.testing.assert_allclose(grads["w"], [[2.0, 4.0], [2.0, 4.0]])  # two uses of w, both counted


def test_spec_round_trips_through_json() -> None:
    spec = StageSpec([OpSpec.of("linear", weight="file:///w.npy"), OpSpec.of("scale", factor=3)], stage_id="s1",
                     device="cpu", dtype="float16")
    assert StageSpec.from_json(spec.to_json()) == spec
    assert StageSpec.from_dict({"ops": [{"op": "relu"}]}) == StageSpec([OpSpec.of("relu")])


@pytest.mark.parametrize("doc, words", [
    ({"ops": [{"op": "exec", "code": "rm -rf /"}]}, "unknown op 'exec'"),
    ({"ops": [{"op": "linear"}]}, "missing: weight"),
    ({"ops": [{"op": "relu", "weight": "x"}]}, "unknown: weight"),
    ({"ops": [{"op": "scale", "factor": "3"}]}, "finite number"),
    ({"ops": [{"op": "scale", "factor": float("nan")}]}, "finite number"),
    ({"ops": [{"op": "linear", "weight": 7}]}, "string reference"),
    ({"ops": "relu"}, "list of ops"),
    ({"ops": [], "shell": "x"}, "unknown keys"),
    ({"ops": [], "dtype": "int32"}, "dtype must be"),
    ({"ops": [], "stage_id": ""}, "stage_id"),
])
def test_spec_parsing_refuses_anything_outside_the_registry(doc: dict, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        StageSpec.from_json(json.dumps(doc))


def test_shape_errors_name_the_op() -> None:
    stage = compile_stage(StageSpec([OpSpec.of("relu"), OpSpec.of("linear", weight="w")]), {"w": np.ones((2, 3))}.get)
    with pytest.raises(UsageError, match=r"op 1 \(linear\).*takes 3 features, the input has 4"):
        stage(np.ones(4))


def test_weight_cache_resolves_each_uri_once_and_shares_a_read_only_array() -> None:
    calls: list[str] = []

    def resolve(uri: str) -> list[float]:
        calls.append(uri)
        return [1.0, 2.0]

    cache = weight_cache(resolve)
    spec = StageSpec([OpSpec.of("add_bias", bias="u://b"), OpSpec.of("add_bias", bias="u://b")])
    stage = compile_stage(spec, cache)
    compile_stage(spec, cache)  # a second stage naming the same URI
    np.testing.assert_array_equal(stage([0, 0]), [2, 4])
    assert calls == ["u://b"] and cache.loads == 1 and "u://b" in cache and len(cache) == 1
    assert not cache("u://b").flags.writeable
    assert weight_cache(cache) is cache


def test_default_resolver_reads_npy_files_and_never_unpickles(tmp_path) -> None:
    np.save(tmp_path / "w.npy", np.arange(6.0).reshape(2, 3))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cache = WeightCache()
    assert cache(f"file://{tmp_path}/w.npy").shape == (2, 3)
    with pytest.raises(UsageError, match="cannot load weight"):
        cache(f"file://{tmp_path}/obj.npy")
    with pytest.raises(UsageError, match="pass resolve="):
        cache("https://example.invalid/w.npy")
