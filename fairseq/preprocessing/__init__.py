"""Preprocessing: what fairseq-preprocess runs (the binarizer, its line workers and file chunks)."""
