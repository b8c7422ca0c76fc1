"""Structured output through xgrammar (docs/sampling.md#structured-output).

`spec` (the `StructuredOutputs` constraint, no heavy imports) is what hosts use;
`compiler` and `manager` run in the engine core; `bitmask` masks logits in the
workers. xgrammar and torch are imported only when a structured request arrives.
"""

from asyncllm.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
