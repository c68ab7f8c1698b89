"""Test-wide setup: 8 host CPU devices (set before anything imports jax) and one tiny world."""

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()
# XLA:CPU compiles the tests' programs without LLVM optimisation and with its older fusion
# emitters: compiling is most of what the suite does (its programs are tiny: running them
# takes milliseconds), and these two cut the compile of test_model_execution's REALM loss and
# gradients 3.5x (9.5 -> 2.7 s on the AVX-512 Xeon; docs/testing.md). The third compiles each
# program's LLVM module whole on one thread instead of split across the thread pool: the
# processes of the suite keep both cores busy already, and the split's own work cost ~8% of
# the CPU time of a compile-bound test. Same semantics; float results differ from an
# optimised build's in the last bits, and every comparison in the suite is between programs
# compiled alike. REALM_JAX_TEST_FAST_COMPILE=0: XLA's defaults.
_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                       "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("REALM_JAX_TEST_FAST_COMPILE", "1") != "0" and \
    _FAST_COMPILE_FLAGS not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " " + _FAST_COMPILE_FLAGS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A compilation cache private to this test session: the Trainer runs (and CLI subprocesses)
# that compile the same programs again pay for XLA only once. pytest-xdist workers inherit the
# variable from the controlling process, so they share it. Removed when the session ends.
# Every program is cached, however small: each process the tests start compiles the eager ops
# of its start-up (hundreds of tiny programs) again otherwise. The cache key holds XLA_FLAGS
# and the devices, so processes with another device count get programs of their own.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  _CACHE_DIR = tempfile.mkdtemp(prefix="realm_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The bucket tests' server speaks only the GCS JSON API: gcsfs must not probe the bucket type
# over gRPC (read when gcsfs is imported, which may happen before their fixture runs).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest  # noqa: E402  (after the environment above, on purpose)

from tests import gcs_server, helpers  # noqa: E402


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory) -> str:
  """A prepared data dir of a 60-entity world (about 240 blocks), in the data shapes of the
  demo configs (block_len, query_len) so that they run on it unchanged."""
  from realm_jax.data.world_corpus import prepare_world
  demo = helpers.load_config_module("demo_realm").get_config().data
  out = str(tmp_path_factory.mktemp("world"))
  prepare_world(out, num_entities=helpers.WORLD_ENTITIES, seed=0, block_len=demo.block_len,
                max_sentence_len=demo.query_len - 2, vocab_size=helpers.VOCAB_SIZE)
  return out


@pytest.fixture(scope="session")
def world_data(world_dir):
  from realm_jax.data.prepared import PreparedData
  return PreparedData(world_dir)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
  """The GCS JSON API server of the bucket tests (tests/gcs_server.py), one per test process,
  with the local data cache in a temp dir; skipped with the reason where it cannot start."""
  started, why = gcs_server.start_or_skip_reason(str(tmp_path_factory.mktemp("gcs")))
  if started is None:
    pytest.skip(why)
  saved = os.environ.get("REALM_JAX_CACHE")
  os.environ["REALM_JAX_CACHE"] = str(tmp_path_factory.mktemp("cache"))
  yield started
  started.stop()
  if saved is None:
    os.environ.pop("REALM_JAX_CACHE", None)
  else:
    os.environ["REALM_JAX_CACHE"] = saved


@pytest.fixture
def gcs(server):
  """The bucket URL."""
  return f"gs://{gcs_server.BUCKET}"


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: the slow tier (multi-process runs, builder kills, "
                          "end-to-end training); `make test-fast` leaves it out")
  # ml_collections' config_flags loads a --config file with the deprecated
  # SourceFileLoader.load_module (its code, not ours): the one warning every run printed
  config.addinivalue_line("filterwarnings",
                          r"ignore:the load_module\(\) method is deprecated:DeprecationWarning")


# The test files that take longest (seconds of test time in the whole suite, 2 workers, 2-core
# Zen 5 EPYC with AVX-512, 2026-12-07, from pytest's junit times), started first. `make test`
# hands whole files to its workers in the order of the collection (`--dist loadfile
# --no-loadscope-reorder`); xdist's own order, files with the most tests first, started these
# last, and one worker ran test_refresh alone for the last 15 s. Longest first, the short files
# fill in at the end and the workers finish together.
LONGEST_FILES_FIRST = (
    "test_multihost.py",           # 134 s
    "test_train.py",               # 74 s
    "test_refresh.py",             # 65 s
    "test_cli.py",                 # 59 s
    "test_index_builder.py",       # 48 s
    "test_gcs.py",                 # 40 s
    "test_openqa.py",              # 30 s
    "test_retriever_learning.py",  # 30 s
    "test_faults.py",              # 29 s
    "test_model_execution.py",     # 25 s
    "test_hf_realm.py",            # 25 s
    "test_sharding.py",            # 23 s
    "test_sweep.py",               # 19 s
    "test_launch_local.py",        # 18 s
    "test_bench_scripts.py",       # 15 s
    "test_optimizer.py",           # 13 s (Zen 5 EPYC)
    "test_hf_bert.py",             # 12 s
    "test_processes.py",           # 12 s
    "test_base_configs.py",        # 12 s
    "test_restore_topology.py",    # 10 s
    "test_init_parts.py",          # 9 s
    # files without slow tests, timed in `make test-fast` on the AVX2 EPYC (2026-11-27):
    # started early so that none of them is begun when the other worker has run out of files
    # (no gain measurable within that machine's run-to-run spread; kept as the rule above)
    "test_prepare.py",             # 15 s on the EPYC
    "test_losses.py",              # 10 s on the EPYC
    "test_hf_ner.py",              # 9 s on the EPYC
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest as found
