"""Models. Each module here registers its model and architectures when the registry first loads it
(build one with `task.build_model(cfg.model)`, which looks up `--arch`)."""
