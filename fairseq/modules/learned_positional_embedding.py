"""Upstream's module path of `LearnedPositionalEmbedding` (fairseq.modules.positional_embedding)."""

from fairseq.modules.positional_embedding import LearnedPositionalEmbedding  # noqa: F401
