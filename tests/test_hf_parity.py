"""Our model against transformers' own REALM classes, on small random checkpoints that
transformers writes itself (four layouts x safetensors / pytorch_model.bin, with RealmConfig's
default tanh GELU `gelu_new`, and a BertForMaskedLM with erf `gelu`), in the interop env
(`make interop-env`: torch + transformers 4.x); torch's own files through the torch-free
reader; and the importer's one-line errors (main env, no torch needed)."""

import json
import os
import re
import subprocess
import sys

import pytest

from realm_jax.interop import hf_realm, hf_realm_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4
CHECKPOINTS = [(arch, fmt) for arch in hf_realm_weights.REALM_ARCHITECTURES
               for fmt in ("safetensors", "bin")] + [("bert", "safetensors")]
# The activation hf_parity's checkpoints are made with (HF RealmConfig's default; BERT's).
HIDDEN_ACT = {**{arch: "gelu_new" for arch in hf_realm_weights.REALM_ARCHITECTURES}, "bert": "gelu"}
# Outputs each layout must report (names printed by hf_parity).
EXPECTED = {
    "RealmEmbedder": {"projected_score_block_inputs", "projected_score_query_inputs"},
    "RealmKnowledgeAugEncoder": {"mlm_log_probs", "marginal_mlm_loss"},
    "RealmReader": {"span_logits_valid_spans", "span_plus_retrieval_logits",
                    "answer_block_start_end"},
    "RealmForOpenQA": {"question_embedding", "retrieval_logits", "span_logits_valid_spans",
                       "answer_score", "retrieved_blocks", "reader_input_ids",
                       "answer_block_row_start_end", "question_wordpieces"},
    "bert": {"last_hidden_state", "mlm_log_probs"},
}


def interop_python():
  """The interop env's python (REALM_INTEROP_PYTHON, else REPO/.venv-interop), or None."""
  python = os.environ.get("REALM_INTEROP_PYTHON") or os.path.join(REPO, ".venv-interop", "bin",
                                                                   "python")
  return python if os.path.exists(python) else None


def run_interop(args, timeout=1200):
  python = interop_python()
  if python is None:
    pytest.skip("no interop env (torch + transformers 4.x): create it with `make interop-env` "
                "or point REALM_INTEROP_PYTHON at its python")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([python, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)


@pytest.fixture(scope="module")
def parity_output(tmp_path_factory):
  """Writes the nine checkpoints with transformers, then runs hf_parity over all of them
  (one process: torch, transformers and jax are imported once)."""
  root = str(tmp_path_factory.mktemp("hf_random"))
  made = run_interop(["-m", "realm_jax.interop.hf_parity", "--make-random", "all", "--out", root])
  assert made.returncode == 0, made.stdout + made.stderr
  dirs = [os.path.join(root, f"{arch}-{fmt}") for arch, fmt in CHECKPOINTS]
  for d, (arch, fmt) in zip(dirs, CHECKPOINTS):
    assert os.path.exists(os.path.join(d, "model.safetensors" if fmt == "safetensors"
                                       else "pytorch_model.bin")), os.listdir(d)
    with open(os.path.join(d, "config.json")) as f:
      assert json.load(f)["hidden_act"] == HIDDEN_ACT[arch], d
  args = ["-m", "realm_jax.interop.hf_parity"] + [a for d in dirs for a in ("--hf-dir", d)]
  result = run_interop(args)
  sections = re.split(r"^hf_parity: (\S+) \(\w+\)$", result.stdout, flags=re.M)
  by_dir = {d: text for d, text in zip(sections[1::2], sections[2::2])}
  return (result, {ckpt: by_dir.get(d, "") for ckpt, d in zip(CHECKPOINTS, dirs)},
          dict(zip(CHECKPOINTS, dirs)))


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=[f"{a}-{f}" for a, f in CHECKPOINTS])
def test_parity_with_transformers(parity_output, checkpoint):
  result, sections, _ = parity_output
  arch, _ = checkpoint
  text = sections[checkpoint]
  assert text, result.stdout[-3000:] + result.stderr[-3000:]
  diffs = {m[0]: float(m[1]) for m in re.findall(rf"^\[{arch}\] max_abs_diff (\S+) (\S+)$",
                                                 text, flags=re.M)}
  matches = dict(re.findall(rf"^\[{arch}\] match (\S+) (\S+)$", text, flags=re.M))
  assert set(diffs) | set(matches) == EXPECTED[arch], text
  assert all(v <= TOLERANCE for v in diffs.values()), diffs
  assert all(v == "True" for v in matches.values()), matches
  assert f"[{arch}] PASS" in text
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("arch", hf_realm_weights.REALM_ARCHITECTURES)
def test_transformers_bin_files_read_without_torch(parity_output, arch, monkeypatch):
  """pytorch_model.bin written by transformers holds, read torch-free, what its
  model.safetensors twin (same seed) holds."""
  import numpy as np
  from realm_jax.interop import hf_bert
  root = os.path.dirname(parity_output[2][(arch, "bin")])
  monkeypatch.setitem(sys.modules, "torch", None)      # as in an env without torch
  from_bin, _ = hf_bert.read_weights(os.path.join(root, f"{arch}-bin"))
  from_safe, _ = hf_bert.read_weights(os.path.join(root, f"{arch}-safetensors"))
  assert set(from_safe) <= set(from_bin) and len(from_safe) > 50
  for name, value in from_safe.items():
    np.testing.assert_array_equal(from_bin[name], value, err_msg=name)


TORCH_FILES = r"""
import sys, numpy as np, torch
from realm_jax.interop import torch_pickle
base = torch.randn(5, 7)
state = {"w": base, "w_t": base.t(), "row": base[3], "cols": base[:, 1::3],
         "h": torch.randn(4, 3).half()[1:], "b": torch.randn(6, dtype=torch.bfloat16),
         "d": torch.randn(3, dtype=torch.float64), "ids": torch.arange(9).view(3, 3),
         "mask": torch.tensor([True, False, True]), "p": torch.nn.Parameter(torch.ones(2))}
torch.save(state, sys.argv[1])
got = torch_pickle.load_state_dict(sys.argv[1])
for k, v in state.items():
  want = v.detach().float().numpy() if v.dtype == torch.bfloat16 else v.detach().numpy()
  have = got[k].astype(np.float32) if v.dtype == torch.bfloat16 else got[k]
  assert have.shape == want.shape and have.dtype == want.dtype, (k, have.dtype, want.dtype)
  np.testing.assert_array_equal(have, want, err_msg=k)
torch.save(state, sys.argv[1] + ".legacy", _use_new_zipfile_serialization=False)
try:
  torch_pickle.load_state_dict(sys.argv[1] + ".legacy")
except ValueError as e:
  assert "legacy" in str(e) and sys.argv[1] in str(e), e
else:
  raise AssertionError("a legacy file was read")
print("torch files read:", sorted(got))
"""


def test_files_written_by_torch_read_without_it(tmp_path):
  result = run_interop(["-c", TORCH_FILES, str(tmp_path / "state.bin")], timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "torch files read:" in result.stdout


# -- the importer's errors (main env) -----------------------------------------------------
def _write_config(path, config):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return str(path)


def _import_error(argv, capsys):
  with pytest.raises(SystemExit) as e:
    hf_realm.main(argv)
  err = capsys.readouterr().err.strip()
  return e.value.code, err


def test_the_parity_check_without_transformers_says_how_to_get_it(tmp_path, capsys,
                                                                   monkeypatch):
  """Checked before anything is imported: one line naming `make interop-env`, exit 2."""
  import importlib.util
  from realm_jax.interop import hf_parity
  found = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "transformers" else found(name, *a))
  with pytest.raises(SystemExit) as stopped:
    hf_parity.main(["--hf-dir", str(tmp_path)])
  err = capsys.readouterr().err
  assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
  assert "error: needs " in err and "transformers (not installed here): `make interop-env`" in err


def test_make_random_without_out_names_the_flag(capsys):
  """`--make-random ARCH` needs `--out DIR` (a TypeError from os.path before)."""
  from realm_jax.interop import hf_parity
  with pytest.raises(SystemExit) as stopped:
    hf_parity.main(["-v", "1", "--make-random", "bert"])   # (-v: as every command takes it)
  err = capsys.readouterr().err
  assert stopped.value.code == 2 and "--make-random needs --out DIR" in err, err


def test_unknown_model_type_is_one_clear_line(tmp_path, capsys):
  hf_dir = _write_config(tmp_path / "gpt", {"model_type": "gpt2",
                                            "architectures": ["GPT2LMHeadModel"]})
  code, err = _import_error(["--hf-dir", hf_dir, "--out", str(tmp_path / "w2")], capsys)
  assert code == 2
  assert err == (f"realm-import-hf: error: {hf_dir}: model_type 'gpt2' in config.json is not "
                 "supported (expected 'realm' or 'bert')")


@pytest.mark.parametrize("architectures", [None, ["RealmScorer"]], ids=["missing", "other"])
def test_realm_without_a_known_architecture_is_one_clear_line(tmp_path, capsys, architectures):
  config = {"model_type": "realm"}
  if architectures:
    config["architectures"] = architectures
  hf_dir = _write_config(tmp_path / "realm", config)
  code, err = _import_error(["--hf-dir", hf_dir, "--out", str(tmp_path / "w2")], capsys)
  assert code == 2 and len(err.splitlines()) == 1
  assert err.startswith(f"realm-import-hf: error: {hf_dir}: config.json architectures "
                        f"{architectures or []} name none of RealmEmbedder, "
                        "RealmKnowledgeAugEncoder, RealmReader, RealmForOpenQA")
  assert not os.path.exists(tmp_path / "w2")


def test_a_dir_without_config_is_a_clear_error(tmp_path, capsys):
  code, err = _import_error(["--hf-dir", str(tmp_path), "--out", str(tmp_path / "w2")], capsys)
  assert code == 2 and err == (f"realm-import-hf: error: {tmp_path} has no config.json (not a "
                               "Hugging Face checkpoint dir)")
