"""Generation: the sequence generator and its searches, the scorer, the CUDA-graph decode step; the hub interface over them is fairseq.hub."""
