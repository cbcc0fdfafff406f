"""fairseq-serve's server: OpenAI's completions API over the decode engine (docs/serving.md)."""
