"""HF REALM checkpoints -> a realm_jax workdir, without torch: checkpoints written here in HF's
layout from our own random params (a round trip through the name mapping, plus spot checks of
HF's key names), for every layout; the written checkpoint restores; a RealmForOpenQA import
publishes an index that verifies and loads; and torch's zip format read by the restricted
unpickler (files made here by hand)."""

import collections
import json
import os
import pickle
import re
import shutil
import sys
import types
import zipfile

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import save_file

from realm_jax.data.prepared import PreparedData
from realm_jax.data.tokenizer import load_tokenizer
from realm_jax.errors import DataError
from realm_jax.interop import hf_bert, hf_realm, hf_realm_weights, torch_pickle
from realm_jax.retrieval import published, subscriber
from realm_jax.runtime import state as state_lib, embedders
from realm_jax.runtime.checkpoints import restore_run
from realm_jax.train.openqa_inputs import reader_length

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["alpha", "beta", "gamma", "delta", "river", "city", "north", "born", "king", "year",
         "the", "of", "in", "was", "a", "is", "town", "lake", "south", "queen"]
VOCAB = SPECIALS + WORDS + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + [".", ","]
SIZES = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
             max_position_embeddings=64, retriever_proj_size=24, span_hidden_size=20,
             max_span_width=4, reader_layer_norm_eps=2e-3, reader_seq_len=40,
             reader_beam_size=3, num_candidates=4, hidden_act="gelu", type_vocab_size=2,
             layer_norm_eps=1e-12, vocab_size=len(VOCAB), model_type="realm")
NUM_RECORDS = 12


def write_vocab(path):
  with open(os.path.join(path, "vocab.txt"), "w") as f:
    f.write("\n".join(VOCAB) + "\n")


def random_params(architecture, seed, **model_fields):
  """Our params for the layout's import config (`model_fields` set on its `model`), every
  leaf random (so that no two leaves are alike and a misplaced tensor cannot go unnoticed)."""
  hf = {**hf_realm_weights.REALM_DEFAULTS, **SIZES}
  block_len = 40 if architecture == "RealmForOpenQA" else None
  config = hf_realm.make_config(architecture, hf, block_len=block_len)
  config.model.update(model_fields)
  model = state_lib.build_model(config, 0)
  inputs = state_lib.dummy_inputs(config, config.data.block_len)
  shapes = jax.eval_shape(lambda r: nn.meta.unbox(model.init(r, **inputs)["params"]),
                          jax.random.PRNGKey(0))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.normal(0, 1, x.shape).astype(np.float32), shapes)


def to_hf(params, architecture):
  """HF-named tensors (torch layout) of the leaves the layout holds, via our own key map."""
  flat = traverse_util.flatten_dict(params, sep="/")
  out = {}
  for ours, hf in hf_realm_weights.realm_key_map(params, architecture).items():
    value = flat[ours]
    out[hf] = np.ascontiguousarray(value.T if ours.endswith("/kernel") else value)
  return out


def write_realm_checkpoint(path, architecture, tensors, records=None):
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**SIZES, "architectures": [architecture],
               "num_block_records": NUM_RECORDS}, f)
  write_vocab(path)
  if records is not None:
    np.save(os.path.join(path, hf_realm.BLOCK_RECORDS), records)
  return str(path)


def restore(workdir):
  run = restore_run(workdir, mesh_shape=(-1, 1))
  return run.config, run.abstract, jax.tree.map(np.asarray, run.params), run.step


def leaf(tree, path):
  for key in path.split("/"):
    tree = tree[key]
  return np.asarray(tree)


# Spot checks of HF's own key names (the round trip alone would accept a symmetric mistake).
SPOT_CHECKS = {
    "RealmEmbedder": [
        ("realm.encoder.layer.1.attention.self.key.weight",
         "retriever/tower/bert/encoder/1/attention/self/key/kernel", True),
        ("realm.pooler.dense.bias", "retriever/tower/bert/pooler/dense/bias", False),
        ("cls.dense.weight", "retriever/tower/projection/kernel", True),
        ("cls.LayerNorm.weight", "retriever/tower/projection_norm/scale", False)],
    "RealmKnowledgeAugEncoder": [
        ("realm.embeddings.token_type_embeddings.weight",
         "reader/bert/embeddings/token_type_embeddings/embedding", False),
        ("cls.predictions.transform.dense.weight", "reader/cls/transform_dense/kernel", True),
        ("cls.predictions.transform.LayerNorm.bias", "reader/cls/transform_LayerNorm/bias",
         False),
        ("cls.predictions.bias", "reader/cls/bias", False)],
    "RealmReader": [
        ("realm.encoder.layer.1.output.LayerNorm.weight",
         "reader/bert/encoder/1/output/LayerNorm/scale", False),
        ("qa_outputs.dense_intermediate.weight", "reader/qa_outputs/dense_intermediate/kernel",
         True),
        ("qa_outputs.dense_output.bias", "reader/qa_outputs/dense_output/bias", False),
        ("qa_outputs.layer_normalization.weight", "reader/qa_outputs/layer_normalization/scale",
         False)],
    "RealmForOpenQA": [
        ("embedder.realm.encoder.layer.0.intermediate.dense.weight",
         "retriever/query_tower/bert/encoder/0/intermediate/dense/kernel", True),
        ("embedder.cls.dense.bias", "retriever/query_tower/projection/bias", False),
        ("reader.realm.embeddings.word_embeddings.weight",
         "reader/bert/embeddings/word_embeddings/embedding", False),
        ("reader.qa_outputs.dense_output.weight", "reader/qa_outputs/dense_output/kernel", True)],
}
# What each layout leaves initialised (top-level groups).
INITIALISED = {
    "RealmEmbedder": {"reader/bert", "reader/cls"},
    "RealmKnowledgeAugEncoder": {"retriever/tower/bert", "retriever/tower/projection",
                                 "retriever/tower/projection_norm"},
    "RealmReader": {"retriever/query_tower/bert", "retriever/query_tower/projection",
                    "retriever/query_tower/projection_norm", "retriever/block_tower/bert",
                    "retriever/block_tower/projection", "retriever/block_tower/projection_norm"},
    "RealmForOpenQA": {"retriever/block_tower/bert", "retriever/block_tower/projection",
                       "retriever/block_tower/projection_norm"},
}


def records_and_emb(rng):
  texts = [" ".join(rng.choice(WORDS, n)) for n in [3, 7, 12, 5, 60, 9, 2, 15, 4, 8, 11, 6]]
  return (np.array([t.encode() for t in texts], dtype=object),
          rng.normal(0, 1, (NUM_RECORDS, SIZES["retriever_proj_size"])).astype(np.float32))


def _import(path, architecture):
  """Writes a checkpoint of `architecture` in HF's layout from random params and imports it."""
  source = random_params(architecture, seed=1)
  tensors = to_hf(source, architecture)
  # What HF checkpoints hold besides: the reader's pooler, the tied decoder, the embedder's
  # unused LM head, int buffers.
  prefix = {"RealmForOpenQA": "reader."}.get(architecture, "")
  if architecture != "RealmEmbedder":
    tensors[prefix + "realm.pooler.dense.weight"] = np.ones((48, 48), np.float32)
    tensors[prefix + "cls.predictions.decoder.weight"] = tensors[
        prefix + "realm.embeddings.word_embeddings.weight"]
  if architecture in ("RealmEmbedder", "RealmForOpenQA"):
    head = {"RealmForOpenQA": "embedder."}.get(architecture, "")
    tensors[head + "cls.predictions.bias"] = np.zeros(len(VOCAB), np.float32)
  tensors[prefix + "realm.embeddings.position_ids"] = np.arange(64, dtype=np.int64)[None]
  records = None
  if architecture == "RealmForOpenQA":
    records, tensors["block_emb"] = records_and_emb(np.random.default_rng(2))
  hf_dir = write_realm_checkpoint(path / "hf", architecture, tensors, records)
  out = str(path / "w2")
  report = hf_realm.import_checkpoint(hf_dir, out)
  return types.SimpleNamespace(source=source, tensors=tensors, records=records, hf_dir=hf_dir,
                               out=out, report=report, prefix=prefix)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """architecture -> its import (made once per module)."""
  done = {}

  def get(architecture):
    if architecture not in done:
      done[architecture] = _import(tmp_path_factory.mktemp(architecture), architecture)
    return done[architecture]
  return get


@pytest.mark.slow
@pytest.mark.parametrize("architecture", hf_realm_weights.REALM_ARCHITECTURES)
def test_every_tensor_lands_in_its_place(imported, architecture):
  run = imported(architecture)
  source, report, prefix = run.source, run.report, run.prefix
  for hf_key, ours, transposed in SPOT_CHECKS[architecture]:
    expected = leaf(source, ours)
    np.testing.assert_array_equal(run.tensors[hf_key], expected.T if transposed else expected)
  config, abstract, restored, step = restore(run.out)
  assert step == 0
  flat_restored = traverse_util.flatten_dict(restored, sep="/")
  flat_source = traverse_util.flatten_dict(source, sep="/")
  assert report.from_hf == hf_realm_weights.realm_key_map(source, architecture)
  for ours in report.from_hf:                     # exactly the source values, in place
    np.testing.assert_array_equal(flat_restored[ours], flat_source[ours], err_msg=ours)
  assert set(report.from_hf) | set(report.initialised) == set(flat_restored)
  assert {report._group(p) for p in report.initialised} == INITIALISED[architecture]
  if architecture == "RealmForOpenQA":   # a whole block tower left at init: the model's own
    model = state_lib.build_model(config, config.model.vocab_size)   # whole init, bitwise
    init = traverse_util.flatten_dict(jax.jit(hf_realm._model_init(config, model))(
        jax.random.PRNGKey(config.seed)), sep="/")
    for ours in report.initialised:
      np.testing.assert_array_equal(flat_restored[ours], init[ours], err_msg=ours)
  with open(os.path.join(run.out, "import_report.json")) as f:
    saved = json.load(f)["params"]
  assert len(saved) == len(flat_restored)
  text = str(report)
  if architecture != "RealmEmbedder":
    assert prefix + "realm.pooler.dense.weight" in report.unused and "decoder" not in text
  if architecture in ("RealmEmbedder", "RealmForOpenQA"):
    assert "cls.predictions.* (an LM head inside HF's RealmScorerProjection)" in text
  m = config.model
  assert (m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size, m.retrieval_dim,
          m.span_hidden_size, m.max_span_width, m.span_layer_norm_eps, m.vocab_size,
          m.hidden_act) == (48, 2, 4, 80, 24, 20, 4, 2e-3, len(VOCAB), "gelu")
  assert m.share_towers == (architecture in ("RealmEmbedder", "RealmKnowledgeAugEncoder"))
  assert ("qa_outputs" in restored["reader"]) == (config.task == "openqa")


def test_block_records_are_tokenised_with_progress_lines_and_the_same_rows(tmp_path, capsys,
                                                                            monkeypatch):
  """RealmForOpenQA's 13.35M block records take minutes to tokenise: the import says so as it
  starts and then every PROGRESS_SECONDS with records/s and an ETA (before: one call, nothing
  said until the import's report), in chunks that give the rows one call gives."""
  records = records_and_emb(np.random.default_rng(2))[0]
  write_vocab(str(tmp_path))
  tokenizer = load_tokenizer(str(tmp_path / "vocab.txt"))
  hf_realm.write_block_store(records, tokenizer, str(tmp_path / "whole"), 32, "hf:test")
  monkeypatch.setattr(hf_realm, "TOKENISE_CHUNK", 5)
  monkeypatch.setattr(hf_realm, "PROGRESS_SECONDS", 0.0)
  capsys.readouterr()
  hf_realm.write_block_store(records, tokenizer, str(tmp_path / "chunks"), 32, "hf:test")
  lines = [l for l in capsys.readouterr().out.splitlines() if "block records" in l]
  assert "tokenising 12 block records of hf:test" in lines[0], lines
  assert [re.search(r"tokenised (\d+)/12 block records \| [\d,.]+ records/s ETA \d+s", l)
          .group(1) for l in lines[1:]] == ["5", "10"], lines
  for name in ("tokens", "lengths", "uids"):
    whole, chunks = (np.load(tmp_path / d / "blocks" / f"{name}.npy") for d in ("whole", "chunks"))
    np.testing.assert_array_equal(whole, chunks)


def test_open_qa_evidence_becomes_a_block_store_and_a_published_index(imported):
  run = imported("RealmForOpenQA")
  records, tensors, hf_dir, out, report = (run.records, run.tensors, run.hf_dir, run.out,
                                           run.report)
  config, abstract, restored, _ = restore(out)

  data = PreparedData(config.data.dir)
  blocks = data.blocks
  tokenizer = load_tokenizer(os.path.join(hf_dir, "vocab.txt"))
  assert blocks.num_blocks == NUM_RECORDS and blocks.block_len == SIZES["reader_seq_len"]
  assert report.block_store["records_cut"] == 1        # the 60-word record
  # realm-eval and realm-predict read HF's reader_seq_len wordpieces, as HF's RealmForOpenQA
  # and the parity check's forward do (the longest record fills the block: query_len 16 after
  # it would read 54)
  assert reader_length(config, blocks.block_len) == SIZES["reader_seq_len"]
  for row, record in enumerate(records):
    body = tokenizer.encode_batch([record.decode()])[0][0][:blocks.block_len - 3]
    assert blocks.tokens[row][:blocks.lengths[row]].tolist() == [
        tokenizer.cls_id, tokenizer.sep_id, *body, tokenizer.sep_id]
  assert blocks.title(0) == "" and blocks.segments(np.arange(2))[0, 2] == 1

  root = published.index_root(out)
  version = published.read_latest(root)
  manifest = published.verify(root, version, fingerprint=blocks.fingerprint,
                              dim=SIZES["retriever_proj_size"])
  assert manifest["step"] == 0 and manifest["backend"] == "exact"
  template = embedders.query_tower_params(abstract.params["retriever"])
  loaded = subscriber.load_version(root, version, config=config, fingerprint=blocks.fingerprint,
                                   query_template=template, make_encoder=lambda p: p)
  table = np.asarray(loaded.index.table).reshape(-1, SIZES["retriever_proj_size"])
  np.testing.assert_array_equal(table[:NUM_RECORDS], tensors["block_emb"])
  query_params = loaded.encode_queries     # make_encoder above hands back the params
  np.testing.assert_array_equal(
      query_params["query_tower"]["projection"]["kernel"],
      restored["retriever"]["query_tower"]["projection"]["kernel"])


def test_an_open_qa_checkpoint_reading_all_its_positions_imports(tmp_path):
  """reader_seq_len = max_position_embeddings (allowed: `unsupported` refuses only a longer
  one): the longest record filled a block of 63 and the question's 16 after it overran the 64
  positions, refused as `config.model.max_position: 64 < query_len + block_len = 79`. Blocks
  now leave the question its 16 (the record cut, and counted, as a longer one is)."""
  layout = "RealmForOpenQA"
  tensors = to_hf(random_params(layout, seed=1), layout)
  records, tensors["block_emb"] = records_and_emb(np.random.default_rng(2))
  hf_dir = write_realm_checkpoint(tmp_path / "hf", layout, tensors, records)
  written = json.loads((tmp_path / "hf" / "config.json").read_text())
  (tmp_path / "hf" / "config.json").write_text(json.dumps({**written, "reader_seq_len": 64}))
  report = hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w2"))
  config = restore(str(tmp_path / "w2"))[0]
  assert (config.data.query_len, config.data.block_len, config.qa.reader_len) == (16, 48, 64)
  assert report.block_store["records_cut"] == 1       # the 60-word record
  assert PreparedData(config.data.dir).blocks.block_len == 48


def test_an_embedder_starts_both_towers_of_a_retriever_with_two(tmp_path):
  """REALM's embedder is one BERT for queries and blocks (HF's RealmScorer embeds both with
  it): given to a retriever with a tower of each (`model.share_towers` False, as
  `init.retriever` may), it starts both, as a BERT checkpoint does."""
  source = random_params("RealmEmbedder", seed=3)
  tensors = to_hf(source, "RealmEmbedder")
  params = random_params("RealmEmbedder", seed=4, share_towers=False)
  new, report = hf_realm_weights.convert(params, tensors, "RealmEmbedder", "model.safetensors",
                                         str(tmp_path), only="retriever")
  embedder = traverse_util.flatten_dict(source["retriever"]["tower"], sep="/")
  for tower in ("query_tower", "block_tower"):
    loaded = traverse_util.flatten_dict(new["retriever"][tower], sep="/")
    assert loaded.keys() == embedder.keys()
    for name, value in embedder.items():
      np.testing.assert_array_equal(loaded[name], value, err_msg=f"{tower}/{name}")
  assert not [p for p in report.initialised if p.startswith("retriever/")]
  assert not report.unused


@pytest.mark.slow
def test_plain_bert_loads_every_tower(tmp_path):
  from tests.test_hf_bert import hf_config, random_bert, write_checkpoint
  config = hf_config(len(VOCAB))
  weights = random_bert(config, mlm_head=True)
  hf_dir = write_checkpoint(tmp_path / "hf", weights, config, VOCAB)
  out = str(tmp_path / "w2")
  report = hf_realm.import_checkpoint(hf_dir, out)
  _, _, restored, _ = restore(out)
  for tower in ("retriever/query_tower/bert", "retriever/block_tower/bert", "reader/bert"):
    np.testing.assert_array_equal(leaf(restored, tower + "/encoder/1/output/dense/kernel"),
                                  weights["encoder.layer.1.output.dense.weight"].T)
  np.testing.assert_array_equal(leaf(restored, "reader/cls/bias"), weights["cls.predictions.bias"])
  assert {report._group(p) for p in report.initialised} == {
      "retriever/query_tower/projection", "retriever/query_tower/projection_norm",
      "retriever/block_tower/projection", "retriever/block_tower/projection_norm"}
  assert report.from_hf["reader/bert/encoder/0/attention/self/query/kernel"] == \
      "encoder.layer.0.attention.self.query.weight"


def test_a_sentence_encoders_mean_pooling_is_imported(tmp_path):
  """A sentence-transformers dir (all-MiniLM-L6-v2's layout) records mean pooling in
  1_Pooling/config.json: the import's retriever pools so (it was [CLS], through an untrained
  pooler: recall@5 0.010 against 0.869 for MiniLM)."""
  import json
  from tests.test_hf_bert import hf_config, random_bert, write_checkpoint
  config = hf_config(len(VOCAB))
  hf_dir = write_checkpoint(tmp_path / "hf", random_bert(config), config, VOCAB)
  os.makedirs(os.path.join(hf_dir, "1_Pooling"))
  with open(os.path.join(hf_dir, "1_Pooling", "config.json"), "w") as f:
    json.dump({"word_embedding_dimension": config["hidden_size"],
               "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, f)
  out = str(tmp_path / "w")
  report = hf_realm.import_checkpoint(hf_dir, out, task="ict")
  with open(os.path.join(out, "config.json")) as f:
    recorded = json.load(f)
  assert recorded["model"]["retriever"]["pooling"] == "mean"
  assert recorded["train"]["reader_lr_scale"] == 0.0   # ICT trains the retriever only
  assert any("model.retriever.pooling 'mean'" in note for note in report.notes), report.notes
  assert hf_realm.sentence_pooling(str(tmp_path)) == (None, [])   # a plain BERT dir: [CLS]


@pytest.mark.parametrize("modes, expected", [
    ({"pooling_mode_max_tokens": True}, (None, ["max_tokens"])),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
     ("mean", ["max_tokens"])),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_sqrt_len_tokens": False},
     ("cls", [])),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},   # [cls; mean]
     ("mean", ["cls_token"])),
])
def test_a_sentence_encoders_other_pooling_modes_are_named(tmp_path, modes, expected):
  """Pooling modes the retriever does not have (max, ...) are returned to be named in the
  import's report, not dropped unsaid."""
  import json
  os.makedirs(tmp_path / "1_Pooling")
  with open(tmp_path / "1_Pooling" / "config.json", "w") as f:
    json.dump({"word_embedding_dimension": 8, **modes}, f)
  assert hf_realm.sentence_pooling(str(tmp_path)) == expected


def test_a_damaged_pooling_record_is_one_error_naming_it(tmp_path):
  """realm-import-hf printed a JSONDecodeError's traceback (an AttributeError's for a list)."""
  os.makedirs(tmp_path / "1_Pooling")
  for text, reason in (('{"pooling_mode_mean_tokens": tru', "not valid JSON"),
                       ("[]", "not a JSON object")):
    (tmp_path / "1_Pooling" / "config.json").write_text(text)
    with pytest.raises(DataError, match=f"{tmp_path}/1_Pooling/config.json: {reason}"):
      hf_realm.sentence_pooling(str(tmp_path))


def _embedder_checkpoint(path, **config_changes):
  """A RealmEmbedder checkpoint whose config.json has `config_changes` (None: key removed)."""
  source = random_params("RealmEmbedder", seed=5)
  hf_dir = write_realm_checkpoint(path, "RealmEmbedder", to_hf(source, "RealmEmbedder"))
  with open(os.path.join(hf_dir, "config.json")) as f:
    config = json.load(f)
  for key, value in config_changes.items():
    if value is None:
      del config[key]
    else:
      config[key] = value
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump(config, f)
  return hf_dir


def test_reader_seq_len_is_checked_where_a_layout_reads_it(tmp_path):
  """RealmForOpenQA's reader reads reader_seq_len wordpieces: longer than the positions, it
  is refused. The other layouts never read it: an embedder of 64 positions whose config.json
  leaves it at RealmConfig's 320 was refused for it."""
  hf_dir = _embedder_checkpoint(tmp_path / "hf", reader_seq_len=None)
  hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w2"))
  assert restore(str(tmp_path / "w2"))[0].model.max_position == 64
  hf = {**hf_realm_weights.REALM_DEFAULTS, **SIZES, "reader_seq_len": 80}
  assert hf_realm_weights.unsupported(hf, "C", "RealmForOpenQA") == [
      "reader_seq_len: 80 > max_position_embeddings 64 (C)"]
  assert hf_realm_weights.unsupported(hf, "C", "RealmReader") == []


@pytest.mark.slow
def test_realm_default_activation_is_imported_as_the_config_value(tmp_path):
  hf_dir = _embedder_checkpoint(tmp_path / "hf", hidden_act=None)   # RealmConfig's: gelu_new
  hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w2"))
  config, _, _, _ = restore(str(tmp_path / "w2"))
  assert config.model.hidden_act == "gelu_new"
  assert state_lib.build_model(config, 0).cfg.hidden_act == "gelu_new"


@pytest.mark.slow
def test_attention_dropout_is_imported_apart_from_hidden_dropout(tmp_path):
  """HF's attention_probs_dropout_prob becomes model.attention_dropout_rate where it differs
  from hidden_dropout_prob (-1: the same rate), and the imported model drops at that rate."""
  hf_dir = _embedder_checkpoint(tmp_path / "hf", attention_probs_dropout_prob=0.0)
  hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w2"))
  config, _, _, _ = restore(str(tmp_path / "w2"))
  assert (config.model.dropout_rate, config.model.attention_dropout_rate) == (0.1, 0.0)
  assert state_lib.build_model(config, 0).cfg.attention_dropout == 0.0
  hf_realm.import_checkpoint(_embedder_checkpoint(tmp_path / "hf_same"), str(tmp_path / "w3"))
  assert restore(str(tmp_path / "w3"))[0].model.attention_dropout_rate == -1.0


@pytest.mark.parametrize("activation", ["relu", "swish"])
def test_an_activation_our_bert_lacks_is_a_clear_error(tmp_path, capsys, activation):
  hf_dir = _embedder_checkpoint(tmp_path / "hf", hidden_act=activation)
  with pytest.raises(SystemExit) as e:
    hf_realm.main(["--hf-dir", hf_dir, "--out", str(tmp_path / "w2")])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"{hf_dir} cannot be expressed by our model" in err
  assert (f"hidden_act: {activation!r} ({hf_dir}/config.json) is not supported: our BERT has "
          "'gelu', 'gelu_python' (erf GELU) or 'gelu_new', ") in err
  assert not os.path.exists(tmp_path / "w2" / "checkpoints")


# -- torch's zip format, written here without torch ---------------------------------------
class _Global:
  """A torch global by name (pickle wants reduce functions to be callable)."""

  def __init__(self, module, name):
    self.module, self.name = module, name

  def __call__(self, *args):
    raise NotImplementedError


class _Storage:
  def __init__(self, key, storage_type, data):
    self.key, self.storage_type, self.data = key, storage_type, data


class _Tensor:
  def __init__(self, storage, offset, size, stride):
    self.args = (storage, offset, size, stride)

  def __reduce__(self):
    return (_Global("torch._utils", "_rebuild_tensor_v2"),
            (*self.args, False, collections.OrderedDict()))


class _TorchLikePickler(pickle._Pickler):
  """Writes what torch.save writes: GLOBALs of torch names, storages by persistent id."""

  dispatch = dict(pickle._Pickler.dispatch)

  def _save_global(self, obj):
    self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
    self.memoize(obj)

  dispatch[_Global] = _save_global

  def persistent_id(self, obj):
    if isinstance(obj, _Storage):
      return ("storage", _Global("torch", obj.storage_type), obj.key, "cpu", obj.data.size)
    return None


def write_torch_zip(path, state, storages, byteorder="little"):
  import io
  buffer = io.BytesIO()
  _TorchLikePickler(buffer, protocol=2).dump(state)
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("archive/data.pkl", buffer.getvalue())
    z.writestr("archive/byteorder", byteorder)
    for s in storages:
      z.writestr(f"archive/data/{s.key}", s.data.tobytes())
    z.writestr("archive/version", "3\n")


def test_torch_zip_read_without_torch(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  base = rng.normal(size=(4, 6)).astype(np.float32)
  floats = _Storage("0", "FloatStorage", base.reshape(-1))
  halves = _Storage("1", "HalfStorage", rng.normal(size=10).astype(np.float16))
  brain = _Storage("2", "BFloat16Storage", rng.normal(size=5).astype(ml_dtypes.bfloat16))
  longs = _Storage("3", "LongStorage", np.arange(7, dtype=np.int64))
  state = collections.OrderedDict([
      ("w", _Tensor(floats, 0, (4, 6), (6, 1))),
      ("w_t", _Tensor(floats, 0, (6, 4), (1, 6))),             # a transposed view
      ("row2", _Tensor(floats, 12, (6,), (1,))),                # a view at an offset
      ("col", _Tensor(floats, 1, (4, 2), (6, 2))),              # strided both ways
      ("h", _Tensor(halves, 2, (2, 4), (4, 1))),
      ("b", _Tensor(brain, 0, (5,), (1,))),
      ("ids", _Tensor(longs, 0, (1, 7), (7, 1))),
      ("scalar", _Tensor(longs, 3, (), ()))])
  file = str(tmp_path / "pytorch_model.bin")
  write_torch_zip(file, state, [floats, halves, brain, longs])
  got = torch_pickle.load_state_dict(file)
  np.testing.assert_array_equal(got["w"], base)
  np.testing.assert_array_equal(got["w_t"], base.T)
  np.testing.assert_array_equal(got["row2"], base[2])
  np.testing.assert_array_equal(got["col"], base[:, 1::2][:, :2])
  np.testing.assert_array_equal(got["h"], halves.data[2:].reshape(2, 4))
  assert got["h"].dtype == np.float16 and got["b"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(got["b"], brain.data)
  np.testing.assert_array_equal(got["ids"], np.arange(7)[None])
  assert got["scalar"].shape == () and int(got["scalar"]) == 3
  as32 = torch_pickle.load_state_dict(file, floats_as=np.float32)
  assert as32["b"].dtype == np.float32 and as32["ids"].dtype == np.int64
  monkeypatch.setitem(sys.modules, "torch", None)   # as if torch were not installed
  tensors, source = hf_bert.read_weights(str(tmp_path))
  assert source == file and tensors["h"].dtype == np.float32


def test_torch_zip_refuses_legacy_files_and_foreign_globals(tmp_path, monkeypatch):
  legacy = tmp_path / "legacy.bin"
  legacy.write_bytes(pickle.dumps({"a": 1}, protocol=2))
  with pytest.raises(ValueError, match=f"{legacy} is not a zip-format torch checkpoint"):
    torch_pickle.load_state_dict(str(legacy))
  evil = str(tmp_path / "evil.bin")
  state = collections.OrderedDict([("x", _Global("os", "system"))])
  write_torch_zip(evil, state, [])
  with pytest.raises(pickle.UnpicklingError, match="refusing to load global os.system"):
    torch_pickle.load_state_dict(evil)
  os.makedirs(tmp_path / "hf")
  os.replace(legacy, tmp_path / "hf" / "pytorch_model.bin")
  monkeypatch.setitem(sys.modules, "torch", None)
  with pytest.raises(DataError, match="legacy torch.save file"):
    hf_bert.read_weights(str(tmp_path / "hf"))


def test_a_damaged_bin_read_by_torch_is_one_error_naming_it(tmp_path, monkeypatch):
  """Where torch is installed (the interop env) it reads the .bin: its own error for a cut
  download was a traceback, where the torch-free reader names the file in one line."""
  def load(file, **kwargs):
    raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding "
                       "central directory")
  monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(load=load))
  (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 cut short")
  with pytest.raises(DataError, match=f"{tmp_path}/pytorch_model.bin: not a readable torch "
                     r"checkpoint \(PytorchStreamReader failed .*\); a damaged or partial "
                     "download"):
    hf_bert.read_weights(str(tmp_path))


def _zip_with_pickle(path, data_pkl: bytes, storages=()):
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("archive/data.pkl", data_pkl)
    for key, data in storages:
      z.writestr(f"archive/data/{key}", data)
  return str(path)


def test_torch_zip_damaged_or_crafted_files_name_the_file_and_change_nothing(tmp_path,
                                                                             monkeypatch):
  # a BUILD on the shared torch.FloatStorage would give every later file another dtype
  text = lambda t: pickle.BINUNICODE + len(t).to_bytes(4, "little") + t.encode()
  poison = (pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + text("junk")
            + pickle.GLOBAL + b"torch\nFloatStorage\n" + pickle.EMPTY_DICT + text("dtype")
            + text("u1") + pickle.SETITEM + pickle.BUILD + pickle.SETITEM + pickle.STOP)
  evil = _zip_with_pickle(tmp_path / "evil.bin", poison)
  with pytest.raises(pickle.UnpicklingError, match=f"{evil}: torch.FloatStorage cannot be"):
    torch_pickle.load_state_dict(evil)
  floats = _Storage("0", "FloatStorage", np.arange(6, dtype=np.float32) + 0.5)
  honest = str(tmp_path / "honest.bin")
  write_torch_zip(honest, collections.OrderedDict(w=_Tensor(floats, 0, (6,), (1,))), [floats])
  got = torch_pickle.load_state_dict(honest)["w"]
  assert got.dtype == np.float32 and got.tolist() == floats.data.tolist()

  buffer = __import__("io").BytesIO()
  _TorchLikePickler(buffer, protocol=2).dump(
      collections.OrderedDict(w=_Tensor(floats, 0, (7,), (1,))))
  for name, storages, expected in (
      ("past_end.bin", [("0", floats.data.tobytes())], "lies outside its storage"),
      ("missing.bin", [], "no item named 'archive/data/0'"),
      ("truncated.bin", [("0", floats.data.tobytes()[:5])], "storage 0 holds 5 bytes")):
    path = _zip_with_pickle(tmp_path / name, buffer.getvalue(), storages)
    with pytest.raises((ValueError, pickle.UnpicklingError), match=f"^{path}: .*{expected}"):
      torch_pickle.load_state_dict(path)
    os.makedirs(tmp_path / name[:-4])
    os.replace(path, tmp_path / name[:-4] / "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(DataError, match=expected):     # realm-import-hf: one line
      hf_bert.read_weights(str(tmp_path / name[:-4]))


def test_safetensors_floats_are_read_as_float32_like_torch_files(tmp_path):
  """bfloat16 is no np.floating: read as such, the import report left such tensors out."""
  save_file({"w": np.ones((2, 3), ml_dtypes.bfloat16), "h": np.ones(4, np.float16),
             "ids": np.arange(3, dtype=np.int64)}, str(tmp_path / "model.safetensors"))
  tensors, _ = hf_bert.read_weights(str(tmp_path))
  assert {k: str(v.dtype) for k, v in tensors.items()} == {
      "w": "float32", "h": "float32", "ids": "int64"}


def test_a_realm_checkpoint_larger_than_the_model_gives_its_first_layers_and_positions():
  """As from a plain BERT: a model with fewer positions and layers than a REALM checkpoint
  takes the first rows and layers, and the report says so (realm.* names included)."""
  layout = "RealmKnowledgeAugEncoder"
  source = random_params(layout, seed=3, num_layers=3, max_position=128)
  tensors = to_hf(source, layout)
  smaller = jax.tree.map(np.zeros_like, random_params(layout, seed=4, num_layers=2,
                                                      max_position=64))
  new, report = hf_realm_weights.convert(smaller, tensors, layout, "ckpt/model.safetensors",
                                         "ckpt", only="reader", option="init.reader")
  positions = leaf(new, "reader/bert/embeddings/position_embeddings/embedding")
  np.testing.assert_array_equal(
      positions, leaf(source, "reader/bert/embeddings/position_embeddings/embedding")[:64])
  assert "layers of realm.encoder: the first 2 of the checkpoint's 3" in report.notes
  assert any("first 64 of the checkpoint's 128 rows" in note for note in report.notes)
  assert report.unused and all(".layer.2." in name for name in report.unused)


def test_a_weight_gone_from_a_realm_layer_is_an_incomplete_file(tmp_path):
  """As for a plain BERT: one tensor gone from a layer the checkpoint has (realm.*,
  reader.realm.* names) is called an incomplete file, not a checkpoint that is no BERT; a
  model deeper than the checkpoint is told to lower model.num_layers."""
  from realm_jax.errors import ConfigError
  for layout, gone in (("RealmReader", "realm.encoder.layer.1.attention.self.key.bias"),
                       ("RealmForOpenQA", "reader.realm.encoder.layer.0.output.dense.bias")):
    params = random_params(layout, seed=1)
    tensors = to_hf(params, layout)
    del tensors[gone]
    with pytest.raises(ConfigError, match=r"1 weights our BERT needs are not in ckpt "
                       r"\(it has BERT layers but not these: an incomplete or damaged file\?\): "
                       + re.escape(gone)):
      hf_realm_weights.convert(params, tensors, layout, "ckpt", "dir")
  layout = "RealmKnowledgeAugEncoder"
  tensors = to_hf(random_params(layout, seed=1), layout)
  with pytest.raises(ConfigError, match=r"not in ckpt \(our model has more layers than the "
                     r"checkpoint: lower model\.num_layers\): realm\.encoder\.layer\.2\."):
    hf_realm_weights.convert(random_params(layout, seed=1, num_layers=3), tensors, layout,
                             "ckpt", "dir")


def test_an_imported_workdir_keeps_the_vocab_a_run_started_from_it_is_checked_against(
    tmp_path):
  """init.from_workdir=W of an import: W has no data dir of its own, so the checkpoint's
  vocab.txt is kept in W, and data with another vocab of the same size is refused."""
  from realm_jax.errors import ConfigError
  from realm_jax.runtime import initialization
  hf_dir = _embedder_checkpoint(tmp_path / "hf")
  hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w"))
  src = initialization.resolve(str(tmp_path / "w"), "init.from_workdir", "retriever")
  initialization.check_run_vocab(src.path, src.option, os.path.join(hf_dir, "vocab.txt"))
  other = tmp_path / "other_vocab.txt"
  tokens = open(os.path.join(hf_dir, "vocab.txt")).read().splitlines()
  other.write_text("\n".join(tokens[:-2] + tokens[-1:] + tokens[-2:-1]) + "\n")
  with pytest.raises(ConfigError, match=r"config\.init\.from_workdir: the data's .*other_vocab"
                     r"\.txt .* differs from .*/w/vocab\.txt"):
    initialization.check_run_vocab(src.path, src.option, str(other))


def test_an_import_whose_vocab_or_config_cannot_be_trusted_is_refused(tmp_path):
  """Refused before anything is written, in one line naming the file: no vocab.txt (later
  runs from the workdir could not be checked), a vocab.txt of another size than config.json's
  vocab_size, a cased checkpoint, a config.json that is not JSON or holds a field of another
  type."""
  from realm_jax.errors import ConfigError
  from tests.test_hf_bert import hf_config, random_bert, write_checkpoint
  config = hf_config(len(VOCAB))
  source = write_checkpoint(tmp_path / "hf", random_bert(config), config, VOCAB)

  def variant(name, change):
    path = tmp_path / name
    shutil.copytree(source, path)
    change(path)
    return str(path)

  def refused(hf_dir, error, message):
    with pytest.raises(error, match=message):
      hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w" / os.path.basename(hf_dir)))
    assert not os.path.exists(tmp_path / "w" / os.path.basename(hf_dir))
  refused(variant("novocab", lambda p: (p / "vocab.txt").unlink()), ConfigError,
          r"novocab/vocab\.txt: no such file; the workdir keeps the checkpoint's vocab\.txt")
  refused(variant("longer", lambda p: (p / "vocab.txt").write_text(
      (p / "vocab.txt").read_text() + "extra\n")), ConfigError,
      rf"has {len(VOCAB) + 1} tokens but .*config\.json says vocab_size {len(VOCAB)}")
  refused(variant("cased", lambda p: (p / "tokenizer_config.json").write_text(
      '{"do_lower_case": false}')), ConfigError, r"cased is a cased checkpoint")
  cased = variant("cased_tokenizer", lambda p: (p / "tokenizer_config.json").write_text(
      '{"do_lower_case": false}'))
  with pytest.raises(ConfigError, match=r"^--vocab .*cased_tokenizer/vocab\.txt is a "
                     "cased checkpoint"):      # a --vocab from a cased tokenizer's dir
    hf_realm.import_checkpoint(source, str(tmp_path / "w" / "given"),
                               vocab=os.path.join(cased, "vocab.txt"))
  refused(variant("badjson", lambda p: (p / "config.json").write_text('{"model_type": bert}')),
          DataError, r"badjson/config\.json: not valid JSON")
  refused(variant("badtype", lambda p: (p / "config.json").write_text(json.dumps(
      {**json.loads((p / "config.json").read_text()), "hidden_size": "32"}))),
      DataError, r"badtype/config\.json: hidden_size is '32', not an int")


def test_an_open_qa_import_refused_for_its_weights_leaves_no_workdir_behind(tmp_path):
  """RealmForOpenQA's block store is written before its weights are read: an import refused
  for a quantised tensor left W2/data, and the retry was refused as `not empty`."""
  from realm_jax.errors import ConfigError
  layout = "RealmForOpenQA"
  tensors = to_hf(random_params(layout, seed=1), layout)
  records, tensors["block_emb"] = records_and_emb(np.random.default_rng(2))
  name = "reader.qa_outputs.dense_output.weight"
  tensors[name] = tensors[name].astype(np.int8)
  hf_dir = write_realm_checkpoint(tmp_path / "hf", layout, tensors, records)
  for out in (tmp_path / "new", tmp_path / "empty"):
    os.makedirs(tmp_path / "empty", exist_ok=True)
    with pytest.raises(ConfigError, match=f"{name}: int8 in the checkpoint"):
      hf_realm.import_checkpoint(hf_dir, str(out))
    assert os.listdir(out) == [] if out.name == "empty" else not out.exists()


def test_a_damaged_safetensors_file_is_one_error_naming_it(tmp_path):
  """An interrupted download, or an error page saved under the name: a DataError naming the
  file (the CLIs print it in one line), not the library's own exception."""
  save_file({"w": np.ones((64, 64), np.float32)}, str(tmp_path / "model.safetensors"))
  whole = (tmp_path / "model.safetensors").read_bytes()
  for damaged in (whole[:len(whole) // 2], b"<html>404</html>"):
    (tmp_path / "model.safetensors").write_bytes(damaged)
    with pytest.raises(DataError, match=r"model\.safetensors: not a readable safetensors file "
                       r".*damaged or partial download"):
      hf_bert.read_weights(str(tmp_path))


def test_a_reader_checkpoints_span_settings_must_be_the_configs(tmp_path):
  """max_span_width and the span scorer's LayerNorm epsilon change no shape, so no load would
  fail: a RealmReader whose settings differ from the Open-QA config's is refused, naming both."""
  from realm_jax.errors import ConfigError
  from realm_jax.runtime import initialization
  hf = {**hf_realm_weights.REALM_DEFAULTS, **SIZES}
  config = hf_realm.make_config("RealmReader", hf)
  config.task = "openqa"
  hf_dir = write_realm_checkpoint(tmp_path / "hf", "RealmReader", {})
  with open(os.path.join(hf_dir, "config.json")) as f:
    written = json.load(f)
  src = initialization.resolve(hf_dir, "init.reader", "reader")
  vocab = os.path.join(hf_dir, "vocab.txt")
  assert initialization.check_hf_source(config, src, vocab, SIZES["vocab_size"]) == "RealmReader"
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump({**written, "max_span_width": 6, "reader_layer_norm_eps": 5e-3}, f)
  with pytest.raises(ConfigError) as refused:
    initialization.check_hf_source(config, src, vocab, SIZES["vocab_size"])
  assert "model.max_span_width: 4 (config) != max_span_width 6" in str(refused.value)
  assert "model.span_layer_norm_eps: 0.002 (config) != reader_layer_norm_eps 0.005" in \
      str(refused.value)
  # The span scorer's width is a shape: named as the option, where the load would say
  # "change model.hidden_size" of each qa_outputs tensor (hidden_size fits)
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump(written, f)
  config.model.span_hidden_size = 32
  with pytest.raises(ConfigError, match=r"model\.span_hidden_size: 32 \(config\) != "
                     r"span_hidden_size 20 \("):
    initialization.check_hf_source(config, src, vocab, SIZES["vocab_size"])


def test_an_imported_open_qa_checkpoint_answers_with_evidence(imported):
  """realm-predict straight on the import: its own config, checkpoint, block store and index
  (no training questions needed)."""
  from realm_jax.predict import predict
  run = imported("RealmForOpenQA")
  item, = predict(run.out, ["what does the first record say"])
  assert isinstance(item["answer"], str) and np.isfinite(item["score"])
  assert len(item["evidence"]) == SIZES["reader_beam_size"]
  assert all({"retrieval_score", "span_score", "text"} <= set(e) for e in item["evidence"])


def _forged_records(path, dtype_args, dtype_state, data) -> str:
  """A block_records.npy whose pickle asks NumPy to rebuild an array from `data` under a
  dtype of the file's making (what a crafted file could use to forge object pointers)."""
  try:
    from numpy._core.multiarray import _reconstruct
  except ImportError:      # NumPy 1.x
    from numpy.core.multiarray import _reconstruct

  class Dtype:
    def __reduce__(self):
      return (np.dtype, dtype_args, dtype_state)

  class Array:
    def __reduce__(self):
      return (_reconstruct, (np.ndarray, (0,), b"b"), (1, (1,), Dtype(), False, data))

  with open(path, "wb") as f:
    np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False,
                                             "shape": (1,)})
    pickle.dump(Array(), f, protocol=3)
  return str(path)


def test_block_records_are_rebuilt_from_bytes_only(tmp_path):
  records = np.array([[b"first block", "second"], [b"", b"fourth \xc3\xa9"]], dtype=object)
  np.save(tmp_path / "good.npy", records)
  loaded = hf_realm.load_block_records(str(tmp_path / "good.npy"))
  assert loaded.dtype == object and loaded.shape == (2, 2) and loaded.tolist() == records.tolist()
  pointer = (0x4141414141).to_bytes(8, "little")
  forged = [  # an object field over raw bytes; object flags denied; not a list of items
      _forged_records(tmp_path / "a.npy", ("V8", False, True),
                      (3, "|", None, ("a", "b"), {"a": (np.dtype("<i8"), 0),
                                                  "b": (np.dtype("O"), 0)}, 8, 1, 0), pointer),
      _forged_records(tmp_path / "b.npy", ("O8", False, True),
                      (3, "|", None, None, None, -1, -1, 0), pointer),
      _forged_records(tmp_path / "c.npy", ("O8", False, True),
                      (3, "|", None, None, None, -1, -1, 63), [b"ok", 7])]
  for path, reason in zip(forged, ("dtype 'V8'", "not all bytes or str", "not all bytes")):
    with pytest.raises(DataError, match=f"{path}: not block records .*{reason}"):
      hf_realm.load_block_records(path)
  np.save(tmp_path / "d.npy", np.array([collections.OrderedDict()], dtype=object))
  with pytest.raises(DataError, match="refusing to load global collections.OrderedDict"):
    hf_realm.load_block_records(str(tmp_path / "d.npy"))
  np.save(tmp_path / "plain.npy", np.array([b"a block", b"another"]))   # not pickled
  plain = (tmp_path / "plain.npy").read_bytes()
  for source, size in (("good", 3), ("good", 20), ("plain", len(plain) - 4)):
    # cut short in its magic string, in its header, in a plain array's data
    (tmp_path / "cut.npy").write_bytes((tmp_path / f"{source}.npy").read_bytes()[:size])
    with pytest.raises(DataError, match=f"{tmp_path}/cut.npy: not a readable .npy file"):
      hf_realm.load_block_records(str(tmp_path / "cut.npy"))
  assert list(hf_realm.load_block_records(str(tmp_path / "plain.npy"))) == [b"a block",
                                                                             b"another"]


def test_the_import_report_names_whole_dotted_keys():
  """A group whose HF keys share no dotted name is `<- *`, not cut inside a word (`<- e*`);
  one key is named whole."""
  report = hf_realm_weights.ImportReport(
      source="S", layout="L", notes=[], unused=[], initialised=[],
      from_hf={"reader/encoder/a": "encoder.layer.0.w", "reader/encoder/b": "embeddings.w",
               "reader/head/c": "cls.predictions.dense.w", "reader/head/d": "cls.predictions.b",
               "reader/pool/e": "pooler.dense.weight"})
  assert report.lines()[1:] == ["  reader/encoder: 2 params <- *",
                                "  reader/head: 2 params <- cls.predictions.*",
                                "  reader/pool: 1 params <- pooler.dense.weight"]


def test_an_open_qa_checkpoint_given_to_init_retriever_says_its_index_is_not_read(tmp_path):
  """init.retriever given an HF RealmForOpenQA dir reads its query tower alone: block_emb, the
  blocks' embeddings, is read by realm-import-hf only (a published index). The start said
  nothing of it (block_emb counted as used), and an Open-QA run then froze the index of its
  block tower, left at init."""
  from realm_jax.runtime import initialization
  layout = "RealmForOpenQA"
  source = random_params(layout, seed=1)
  tensors = to_hf(source, layout)
  tensors["block_emb"] = records_and_emb(np.random.default_rng(2))[1]
  hf_dir = write_realm_checkpoint(tmp_path / "hf", layout, tensors)
  config = hf_realm.make_config(layout, {**hf_realm_weights.REALM_DEFAULTS, **SIZES},
                                block_len=40)
  src = initialization.Source("retriever", "init.retriever", "hf", hf_dir)
  params = random_params(layout, seed=4)
  new, lines = initialization._from_hf(config, src, params, os.path.join(hf_dir, "vocab.txt"),
                                       SIZES["vocab_size"])
  np.testing.assert_array_equal(new["query_tower"]["projection"]["kernel"],
                                source["retriever"]["query_tower"]["projection"]["kernel"])
  assert f"  note: block_emb (the blocks' embeddings) is not read by init.retriever: " \
         f"realm-import-hf --hf-dir {hf_dir} --out W2 publishes it as W2's index, and an " \
         "Open-QA run started from init.retriever=W2 retrieves from it" in lines, lines
  assert any(line.startswith("  not used: ") and "block_emb" in line for line in lines), lines


def test_a_vocab_given_beside_the_checkpoints_own_must_list_its_tokens(tmp_path):
  """--vocab is for a dir without vocab.txt. Beside the checkpoint's own, another vocab of the
  same size (realm-prepare trains 30,522 entries by default, bert-base's count) was taken: the
  block records tokenised with it and kept as W2/vocab.txt, so that runs on data of that vocab
  passed the check, every id meaning another word to the embeddings."""
  from realm_jax.errors import ConfigError
  hf_dir = _embedder_checkpoint(tmp_path / "hf")
  hf = hf_realm.read_hf_config(hf_dir)[1]
  other = tmp_path / "data_vocab.txt"
  other.write_text("\n".join(VOCAB[:5] + [VOCAB[6], VOCAB[5]] + VOCAB[7:]) + "\n")
  with pytest.raises(ConfigError, match=rf"^--vocab {other} lists other tokens than the "
                     rf"checkpoint's {hf_dir}/vocab\.txt \(first at line 6: 'beta' vs "
                     r"'alpha'\): .*leave --vocab out"):
    hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w2"), vocab=str(other))
  assert not os.path.exists(tmp_path / "w2")
  same = tmp_path / "copy.txt"
  shutil.copyfile(os.path.join(hf_dir, "vocab.txt"), same)
  assert hf_realm._checked_vocab(hf_dir, hf, str(same)) == str(same)


@pytest.mark.parametrize("key, value, kind", [("retriever_proj_size", None, "an int"),
                                              ("reader_seq_len", "320", "an int"),
                                              ("reader_layer_norm_eps", "1e-3", "a float"),
                                              ("hidden_dropout_prob", None, "a float")])
def test_a_realm_setting_of_another_type_is_one_error_naming_it(tmp_path, key, value, kind):
  """As BERT's sizes are: a REALM setting the import and init.* read as a number (null, a
  string) was a TypeError traceback (int(None), "320" > 64) or, for a string of digits, read."""
  hf_dir = _embedder_checkpoint(tmp_path / "hf")
  with open(os.path.join(hf_dir, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump({**config, key: value}, f)
  with pytest.raises(DataError, match=rf"^{hf_dir}/config\.json: {key} is {value!r}, not "
                     rf"{kind}$"):
    hf_realm.import_checkpoint(hf_dir, str(tmp_path / "w2"))
  assert not os.path.exists(tmp_path / "w2")
