"""Sampling: per-request parameters and the batched tensor sampler."""

from tokenmill.sample.params import SamplingParams, StructuredOutputs
from tokenmill.sample.sampler import Sampler, SamplerOutput, SamplingBatch

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SamplingParams", "StructuredOutputs"]
