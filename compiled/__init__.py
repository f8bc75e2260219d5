"""compiled: a compiled-graph inference runtime for Qwen3 and Qwen3-MoE.
Public API: `LLM`, `SamplingParams`, `RequestOutput`."""

from compiled.runtime.llm import LLM
from compiled.runtime.request import RequestOutput
from compiled.runtime.sampling_params import SamplingParams
from compiled.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]
