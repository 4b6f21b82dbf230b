"""Start vLLM on CPU with Intel OpenMP preloaded when speculative decoding is requested."""

__version__ = "0.1.0"
