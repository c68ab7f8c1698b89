"""REALM (retrieval-augmented language model pre-training) in JAX/Flax."""

from realm_jax import log as _log

_log.install()
