"""Upstream's module path of `SinusoidalPositionalEmbedding` (fairseq.modules.positional_embedding)."""

from fairseq.modules.positional_embedding import SinusoidalPositionalEmbedding  # noqa: F401
