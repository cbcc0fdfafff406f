"""Exporting trained models to other libraries' formats (`fairseq.export.hf`: Hugging Face transformers)."""
