"""The hub: `from_pretrained`'s interface over a loaded model (hub_utils) and its argument checks (hub_inputs).
A top-layer component beside training and export: it loads checkpoints and drives the generator."""
