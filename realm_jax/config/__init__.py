"""The config's schema, below every job: its defaults (`defaults`), the presets `configs/`
share (`presets`), how a config reads (`reading`), its validation (`validation`), loading a
config file (`loading`), overrides from the command line or code (`overrides`), which options a
workdir's checkpoints fix (`compatibility`) and the options renamed since release
(`option_names`). `python -m realm_jax.config.reference` writes docs/config_reference.md."""
