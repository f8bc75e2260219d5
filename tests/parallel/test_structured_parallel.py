"""Constrained decoding under tensor and context parallelism (CPU, gloo): rank 0 alone compiles,
masks and samples, so the outputs, constrained rows and free rows alike, are those of one process."""

from __future__ import annotations

import json

import jsonschema
import pytest

from compiled import LLM, SamplingParams
from compiled.demo import EXAMPLE_PROMPTS

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}
ENGINE = dict(max_num_batched_tokens=64, cp_min_tokens=8, kv_cache_tokens=2048, max_model_len=256)
PROMPTS = [EXAMPLE_PROMPTS[i] for i in (11, 7, 10)]
PARAMS = [SamplingParams(max_new_tokens=40, temperature=0.0, structured_outputs={"json": SCHEMA}),
          SamplingParams(max_new_tokens=8, temperature=0.0),
          SamplingParams(max_new_tokens=40, temperature=0.0, structured_outputs={"regex": "[a-z]{2,5}-[0-9]{1,3}"})]


def _generate(**parallel):
    llm = LLM(None, device="cpu", dtype="float32", **ENGINE, **parallel)
    try:
        return llm.generate(PROMPTS, PARAMS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "context_parallel_size"])
def test_constrained_rows_under_parallelism_equal_one_process(parallel, one_intra_op_thread):
    reference = _generate()
    outputs = _generate(**{parallel: 2})
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    jsonschema.validate(json.loads(outputs[0].text), SCHEMA)
    assert outputs[0].finish_reason == outputs[2].finish_reason == "stop"
