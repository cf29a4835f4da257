"""JetSpec-JAX: tree speculative decoding (causal parallel drafting) for Qwen3 in JAX."""
__version__ = "0.1.0"
