"""`hf_parameter_names` maps a BertEncoder's Flax parameters onto the HF BertModel state dict."""

import jax
import jax.numpy as jnp
import flax.linen as nn

from realm_jax.models.bert import BertConfig, BertEncoder, hf_parameter_names


def hf_bert_model_keys(num_layers):
  """The parameter keys of `transformers.BertModel(...).state_dict()` (buffers excluded)."""
  keys = [f"embeddings.{e}.weight" for e in ("word_embeddings", "position_embeddings",
                                            "token_type_embeddings")]
  keys += ["embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
  for i in range(num_layers):
    p = f"encoder.layer.{i}."
    for m in ("attention.self.query", "attention.self.key", "attention.self.value",
              "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
              "output.dense", "output.LayerNorm"):
      keys += [p + m + ".weight", p + m + ".bias"]
  keys += ["pooler.dense.weight", "pooler.dense.bias"]
  return keys


def test_hf_parameter_names_cover_the_hf_state_dict_exactly():
  cfg = BertConfig(vocab_size=50, hidden_size=8, num_layers=3, num_heads=2,
                   intermediate_size=16, max_position=16)
  ids = jnp.ones((1, 4), jnp.int32)
  params = jax.eval_shape(lambda r: BertEncoder(cfg).init(r, ids, ids * 0),
                          jax.random.PRNGKey(0))["params"]
  names = hf_parameter_names(nn.meta.unbox(params), prefix="bert.")
  assert sorted(names.values()) == sorted("bert." + k for k in hf_bert_model_keys(3))
  assert names["encoder/2/attention/self/query/kernel"] == \
      "bert.encoder.layer.2.attention.self.query.weight"
  assert names["embeddings/LayerNorm/scale"] == "bert.embeddings.LayerNorm.weight"
