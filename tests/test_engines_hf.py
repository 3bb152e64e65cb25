"""The transformers engine's graphed decode path and --follow adapter versions, on CPU.

--cuda-graph on CPU runs the capture's warm-up steps and replays the step eagerly: the graphed path's
indexing (which crashed on CUDA at --max-tokens 1 and 2) is exercised without a GPU. In the loop the
engine wraps its model once in a zero LoRA of the trainer's shape; a new version's weights then land in the
same tensors, so no graph is captured again and the compiled forward is not rebuilt.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_rollout import load_model, make_lora_adapter

from opd_common.engines import SampleRequest
from opd_rollout.config import RolloutConfig

PROMPTS = [[5, 17, 33, 9, 2], [7, 7, 40], [12, 3, 91, 8, 6, 30, 2]]


def engine(model, lm=None, **overrides):
    """An hf engine on CPU (its model loaded from `model`, or `lm`)."""
    from opd_common.engines.hf import HfEngine

    settings = {"model": str(model), "engine": "hf", "device": "cpu", "temperature": 1.0, "max_tokens": 6,
                "batch_size": 4, **overrides}
    config = RolloutConfig(**settings)
    return HfEngine(config, model=lm)


def sample(eng, prompts=PROMPTS):
    return eng.generate([SampleRequest(prompt_ids=p, seed=100 + i) for i, p in enumerate(prompts)])


def same(a, b, atol=1e-5):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=atol)
        assert x.finish_reason == y.finish_reason


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_the_graphed_path_matches_eager_decoding_at_any_length(tiny_model, max_tokens):
    """The capture runs 3 steps past the prefill; at --max-tokens 1 or 2 they used to write past the history
    buffers (a device-side assert on CUDA). Graphed and eager decoding give the same samples."""
    graphed = engine(tiny_model, max_tokens=max_tokens, cuda_graph=True)
    out = sample(graphed)
    assert graphed.captures == 1
    assert all(1 <= len(c.response_ids) <= max_tokens for c in out)
    same(out, sample(engine(tiny_model, max_tokens=max_tokens, cuda_graph=False)))


@pytest.mark.slow  # four adapters saved, two engines
def test_adapter_versions_load_in_place_without_a_new_capture_or_compile(tiny_model, tmp_path):
    """prepare_adapter (the trainer's LoRA shape, B = 0) samples as the base model does; three versions then
    load into the same tensors: one capture for the bucket in all, the compiled forward built once and traced
    once, and each version samples as a fresh PeftModel.from_pretrained of it does."""
    import torch

    shape = {"r": 8, "alpha": 16, "targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"}
    base = sample(engine(tiny_model, cuda_graph=True))
    zero = engine(tiny_model, cuda_graph=True)
    zero.prepare_adapter(shape)
    same(sample(zero), base, atol=1e-6)  # a zero LoRA adds exact zeros: the base model (to BLAS rounding)
    eng = engine(tiny_model, cuda_graph=True, compile=True)
    eng.prepare_adapter(shape)
    forward = eng._decode_forward
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    same(sample(eng), base)  # compiled: the same samples, log-probs to float rounding
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1
    for version in (1, 2, 3):
        adapter = make_lora_adapter(tiny_model, tmp_path / f"v{version}", seed=version, scale=0.3)
        eng.set_adapter(str(adapter), version)
        out = sample(eng)
        same(out, sample(engine(tiny_model, lm=load_model(tiny_model, adapter).eval(), cuda_graph=True)), atol=1e-4)
        assert not all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(out, base, strict=True))
    assert eng.captures == 1
    assert eng._decode_forward is forward
    assert counters["stats"]["unique_graphs"] == compiled  # no version traced the forward again


@pytest.mark.parametrize("graph", [True, False])
def test_one_cache_is_held_the_longest_needed(tiny_model, graph):
    """A batch that needs a longer cache replaces the held buffers, which are freed (one graph captured for the
    new ones); shorter batches, and eagerly another batch size, then decode in a cache that long, as they would
    in their own: the engine's memory is its longest cache, not the sum of one per length seen (which ran a
    rollout sharing an H100 with the trainer out of memory)."""
    import weakref

    from opd_common.engines.hf import LENGTH_BUCKET

    short_L, long_L = LENGTH_BUCKET, 2 * LENGTH_BUCKET
    long_prompts = [[5 + i % 50 for i in range(short_L - 6 + 1)], [7, 7, 40]]  # + 6 tokens: one past short_L
    eng = engine(tiny_model, cuda_graph=graph)
    short = sample(eng)
    assert eng._bucket.L == short_L
    first = weakref.ref(eng._bucket.cache)
    longer = sample(eng, long_prompts)
    assert eng._bucket.L == long_L and first() is None  # the shorter cache was let go (no collector needed)
    same(sample(eng), short)  # 3 prompts (eagerly: another batch size) in the longer cache
    same(sample(eng, long_prompts), longer)
    assert eng._bucket.L == long_L
    assert eng.captures == (2 if graph else 0)
    fresh = engine(tiny_model, cuda_graph=graph)
    same(sample(fresh, long_prompts), longer)


def test_an_adapter_of_another_shape_is_refused(tiny_model, tmp_path):
    eng = engine(tiny_model)
    eng.prepare_adapter({"r": 8, "alpha": 16, "targets": "q_proj,v_proj"})
    adapter = make_lora_adapter(tiny_model, tmp_path / "v1")  # all seven projections
    from opd_common.errors import ConfigError

    with pytest.raises(ConfigError, match="does not fit the LoRA the engine prepared from the run's config.json"):
        eng.set_adapter(str(adapter), 1)
