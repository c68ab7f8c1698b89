"""The demo driver's own logic (the demo itself runs in `make demo`)."""

from realm_jax import demo


def test_split_host_applies_keeps_or_leaves_the_device_count():
  env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "HOME": "/h"}
  applied, count = demo.split_host(env, 2)
  assert count == 2 and applied["HOME"] == "/h"
  assert applied["XLA_FLAGS"] == ("--xla_cpu_enable_fast_math=false "
                                  "--xla_force_host_platform_device_count=2")
  assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"   # the caller's env untouched
  user = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"}
  assert demo.split_host(user, 2) == (user, 8)                     # the user's count wins
  assert demo.split_host({}, 0) == ({}, 0)                         # JAX's default


def test_devices_names_the_realm_stage_count_only_when_it_differs():
  import jax
  here = f"{jax.device_count()} x cpu"
  assert demo.devices(0) == here
  assert demo.devices(jax.device_count()) == here
  assert demo.devices(jax.device_count() + 1) == f"{here} (REALM stage: " \
                                                 f"{jax.device_count() + 1} x cpu)"
