"""The hub: `from_pretrained` (pretrained), its interface over a loaded model (hub_utils), text in and out (text) and
the interface's argument checks (hub_inputs).
A top-layer component beside training and export: it loads checkpoints and drives the generator."""
