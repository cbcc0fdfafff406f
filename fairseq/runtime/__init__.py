"""What every layer may read about the process it runs in: the launch environment (env: torchrun, SLURM, the
device) and DTensor helpers (dtensor). Below the data layer; imports nothing of fairseq above the config layer."""
