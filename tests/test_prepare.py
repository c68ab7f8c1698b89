"""`realm-prepare`: blocks on real prose, bad records skipped and counted (or fatal in strict
mode, with file:line), restarts that reuse finished shards, parallel == in-process, TFDS."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from realm_jax.data import corpus, prepare as prepare_lib, sources
from realm_jax.data.prepared import PreparedData
from realm_jax.data.sentences import split_sentences
from realm_jax.data.tokenizer import load_tokenizer
from realm_jax.errors import ConfigError, DataError
from tests.helpers import REPO

SQUAD = os.path.join(REPO, "..", "shared", "data", "squadshifts_new_wiki_v1.0.json")
PROSE = [
    ("Apollo 11", "Apollo 11 was the spaceflight that first landed humans on the Moon. "
     "Commander Neil Armstrong and pilot Buzz Aldrin landed on 20 July 1969. "
     "They spent about 21 hours on the lunar surface."),
    ("Marie Curie", "Marie Curie was born in Warsaw in 1867. She moved to Paris in 1891. "
     "In 1903 she shared the Nobel Prize in Physics with Pierre Curie."),
    ("Danube", "The Danube flows through Vienna, Budapest and Belgrade. It is about 2,850 "
     "kilometres long. The river empties into the Black Sea in Romania."),
]


def config_for(source: str, out_dir: str, **overrides):
  config = prepare_lib.prepare_config()
  config.source, config.out_dir = source, out_dir
  config.vocab_size, config.num_workers, config.progress_every = 400, 0, 1e9
  for key, value in overrides.items():
    config[key] = value
  return config


def write_jsonl(path, lines: list[bytes]) -> str:
  with open(path, "wb") as f:
    f.write(b"\n".join(lines) + b"\n")
  return str(path)


def good_lines(n_copies=1) -> list[bytes]:
  return [json.dumps({"title": f"{t} {k}" if k else t, "text": x}).encode()
          for k in range(n_copies) for t, x in PROSE]


@pytest.fixture(scope="module")
def squad_dir(tmp_path_factory):
  if not os.path.exists(SQUAD):
    pytest.skip(f"{SQUAD} is absent (real data of ../shared/data)")
  out = str(tmp_path_factory.mktemp("squad"))
  stats = prepare_lib.prepare(config_for(f"squad:{SQUAD}", out, vocab_size=8000,
                                         shard_documents=400))
  return out, stats


def test_squadshifts_blocks_fit_and_have_title_and_body_segments(squad_dir):
  out, stats = squad_dir
  data = PreparedData(out)
  blocks, tok = data.blocks, data.tokenizer
  with open(SQUAD) as f:
    articles = json.load(f)["data"]
  paragraphs = [(a["title"], p["context"]) for a in articles for p in a["paragraphs"]]
  # Every paragraph is accounted for: kept as a document or skipped by reason.
  assert stats["read"] == len(paragraphs) == 1581
  assert stats["documents"] + sum(stats["skipped"].values()) == len(paragraphs)
  assert stats["blocks"] == blocks.num_blocks >= stats["documents"]
  assert stats["max_block_wordpieces"] <= 288 and blocks.lengths.max() <= 288
  assert stats["questions"] == sum(len(p["qas"]) for a in articles for p in a["paragraphs"])
  kept = dict.fromkeys(paragraphs)     # order of first occurrence = document ids
  kept_list = list(kept)
  rows = np.arange(blocks.num_blocks)
  tokens = np.asarray(blocks.tokens)
  assert (tokens[rows, 0] == tok.cls_id).all()
  assert (tokens[rows, blocks.body_start - 1] == tok.sep_id).all()
  assert (tokens[rows, blocks.lengths - 1] == tok.sep_id).all()
  assert (tokens[rows[:, None], np.arange(288)[None]] * (np.arange(288)[None] >=
                                                        blocks.lengths[:, None]) == 0).all()
  segments = blocks.segments(rows)
  for row in range(0, blocks.num_blocks, 7):
    title, text = kept_list[int(blocks.doc_ids[row])]
    start, end = int(blocks.body_start[row]), int(blocks.lengths[row])
    assert tok.decode(tokens[row, 1:start - 1]) == tok.decode(tok.encode_batch([title])[0][0])
    assert (segments[row, :start] == 0).all() and (segments[row, start:end] == 1).all()
    assert (segments[row, end:] == 0).all()
    body = tok.decode(tokens[row, start:end - 1])
    assert body.replace(" ", "") in tok.decode(tok.encode_batch([text])[0][0]).replace(" ", "")
  # Every pretraining example sits inside its block, at its offsets, with spans inside it.
  ex = data.examples("train")
  uid = np.load(os.path.join(out, "examples", "train", "block_uid.npy"))
  assert uid.dtype == np.uint64 and (uid == blocks.uids[ex.block]).all()
  for i in range(0, len(ex), 53):
    s, e = ex.block_offsets[i]
    assert (tokens[ex.block[i], s:e] == ex.tokens[i, :ex.lengths[i]]).all()
    for a, b in ex.spans[i, :ex.num_spans[i]]:
      assert 0 <= a < b <= ex.lengths[i] and b - a <= 10
  with open(os.path.join(out, "qa", "eval.jsonl")) as f:
    first = json.loads(f.readline())
  title, text = kept_list[first["doc_id"]]
  assert text[first["answer_start"][0]:].startswith(first["answer"][0])


def test_bad_records_are_skipped_and_counted(tmp_path):
  big = json.dumps({"title": "Big", "text": "word " * (2 * 2**20 + 10)}).encode()  # > 10 MB
  lines = good_lines() + [
      b'{"title": "Broken", "text": "no closing brace"',
      json.dumps({"text": "A text without a title."}).encode(),
      json.dumps({"title": "No text"}).encode(),
      json.dumps({"title": "Empty", "text": ""}).encode(),
      json.dumps({"title": "Blank", "text": " \n\t "}).encode(),
      b'{"title": "Latin-1", "text": "caf\xe9 au lait in Paris in 1950."}',
      big,
      good_lines()[0],                                  # duplicate of the first document
      b'["a list", "not an object"]',
  ]
  path = write_jsonl(tmp_path / "docs.jsonl", lines)
  stats = prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "out")))
  assert stats["documents"] == len(PROSE)
  assert stats["skipped"] == {
      sources.MALFORMED_JSON: 1, sources.MISSING_TITLE: 1, sources.MISSING_TEXT: 1,
      sources.EMPTY: 2, sources.INVALID_UTF8: 1, sources.TOO_LARGE: 1, sources.DUPLICATE: 1,
      sources.NOT_AN_OBJECT: 1}
  first = stats["skipped_first_at"]    # where to look, for each reason
  assert (first[sources.MALFORMED_JSON], first[sources.EMPTY], first[sources.DUPLICATE]) == (
      f"{path}:4", f"{path}:7", f"{path}:11")
  assert stats["read"] == len(lines)
  assert stats["sentences"] == 9              # three sentences per document (sentencex)
  assert stats["documents_without_blocks"] == 0
  assert stats["examples"]["train"] + stats["examples"]["eval"] > 0


@pytest.mark.parametrize("line, reason", [
    (b'{"title": "Broken"', sources.MALFORMED_JSON),
    (json.dumps({"text": "x"}).encode(), sources.MISSING_TITLE),
    (json.dumps({"title": "Blank", "text": "   "}).encode(), sources.EMPTY),
    (b'{"title": "x", "text": "\xff\xfe"}', sources.INVALID_UTF8),
    (b'{"title": "Lone", "text": "A surrogate \\ud800 in Paris in 1900."}',
     sources.INVALID_UTF8),                     # valid JSON, no UTF-8 text
    (good_lines()[1], sources.DUPLICATE),
    (b"[" * 100_000, sources.MALFORMED_JSON),   # deeper than json.loads recurses
    (b'{"title": "x", "text": "y", "n": ' + b"1" * 5000 + b"}", sources.MALFORMED_JSON),
])
def test_strict_mode_fails_naming_file_and_line(tmp_path, line, reason):
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines() + [line])
  with pytest.raises(DataError, match=f"{path}:{len(PROSE) + 1}: {reason}"):
    prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "out"), strict=True))


_KILL_SECOND_SHARD = """\
import os, signal
if os.environ.get("REALM_TEST_KILL_SHARD"):   # a prepare worker: dies on its shard's first doc
  from realm_jax.data import corpus
  build_shard = corpus.build_shard

  def dying(docs, *args, **kwargs):
    if docs[0][0] == int(os.environ["REALM_TEST_KILL_SHARD"]):
      os.kill(os.getpid(), signal.SIGKILL)   # as the OOM killer would
    return build_shard(docs, *args, **kwargs)
  corpus.build_shard = dying
"""


def test_a_worker_that_dies_fails_the_job_naming_its_shard(tmp_path):
  """A worker process killed mid-shard (its result never comes): one line and exit 1, not a
  job waiting for good; the rerun reuses the shards that finished."""
  inject = tmp_path / "inject"
  inject.mkdir()
  (inject / "sitecustomize.py").write_text(_KILL_SECOND_SHARD)
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(n_copies=4))   # 12 documents
  command = [sys.executable, "-m", "realm_jax.data.prepare", f"--config={REPO}/configs/prepare.py",
             f"--config.source=jsonl:{path}", f"--config.out_dir={tmp_path / 'out'}",
             "--config.vocab_size=300", "--config.num_workers=2", "--config.shard_documents=3"]
  env = {**os.environ, "REALM_TEST_KILL_SHARD": "3",
         "PYTHONPATH": os.pathsep.join([str(inject), REPO])}
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith("realm-prepare: error:")]
  shards = re.search(r"a worker process died while shards ([0-9, ]+) were being packed",
                     errors[0] if len(errors) == 1 else "")
  assert shards and "1" in shards.group(1).split(", "), result.stderr[-3000:]
  env.pop("REALM_TEST_KILL_SHARD")
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(PreparedData(str(tmp_path / "out")).blocks.titles) == 12


_SLOW_SHARDS = """\
import os, time
if os.environ.get("REALM_TEST_SLOW_SHARD"):   # a prepare worker: one shard takes a minute
  from realm_jax.data import corpus
  build_shard = corpus.build_shard

  def slow(docs, *args, **kwargs):
    print("packing", flush=True)
    time.sleep(60)
    return build_shard(docs, *args, **kwargs)
  corpus.build_shard = slow
"""


def _children(pid: int) -> set[int]:
  """The child processes of `pid`, whichever of its threads started them."""
  found = set()
  for task in os.listdir(f"/proc/{pid}/task"):
    with open(f"/proc/{pid}/task/{task}/children") as f:
      found |= {int(p) for p in f.read().split()}
  return found


def _gone(pids: set[int], seconds: float) -> bool:
  deadline = time.time() + seconds
  while time.time() < deadline:
    if not any(os.path.exists(f"/proc/{p}") and
               open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z" for p in pids):
      return True
    time.sleep(0.2)
  return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_workers_end_with_the_job_on_sigterm_or_sigkill(tmp_path, sig):
  """A scheduler's SIGTERM stops the job as Ctrl-C does; after a SIGKILL (the OOM killer) its
  workers exit by themselves. Both used to stay, orphaned, waiting on the task queue."""
  inject = tmp_path / "inject"
  inject.mkdir()
  (inject / "sitecustomize.py").write_text(_SLOW_SHARDS)
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(n_copies=4))
  job = subprocess.Popen(
      [sys.executable, "-m", "realm_jax.data.prepare", f"--config={REPO}/configs/prepare.py",
       f"--config.source=jsonl:{path}", f"--config.out_dir={tmp_path / 'out'}",
       "--config.vocab_size=300", "--config.num_workers=2", "--config.shard_documents=3"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "REALM_TEST_SLOW_SHARD": "1",
           "PYTHONPATH": os.pathsep.join([str(inject), REPO])})
  workers: set[int] = set()
  try:
    for line in iter(job.stdout.readline, ""):            # until a worker is in a shard
      if line.strip() == "packing":
        break
    workers = _children(job.pid)
    assert len(workers) >= 2, workers
    job.send_signal(sig)
    job.wait(timeout=60)
    assert _gone(workers, 20), f"workers {workers} outlived the job"
  finally:
    if job.poll() is None:
      job.kill()
    for pid in workers:                                   # none is left behind by a failure
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
  if sig == signal.SIGTERM:
    assert job.returncode == -signal.SIGINT   # the Ctrl-C path: "interrupted"
    assert "realm-prepare: interrupted" in job.stdout.read()


def test_a_shard_rebuilt_from_other_input_drops_its_old_marker_first(tmp_path, monkeypatch):
  """An unfinished preparation whose input changed rebuilds a shard in place; killed while
  it rewrites the arrays, the shard must not keep the marker of the earlier input (a rerun
  with that input would take the half-rewritten arrays for its own)."""
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(n_copies=2))
  out = str(tmp_path / "out")

  def stopped(*args, **kwargs):                        # stopped once the shards are packed
    raise KeyboardInterrupt
  monkeypatch.setattr(corpus, "merge_shards", stopped)
  with pytest.raises(KeyboardInterrupt):
    prepare_lib.prepare(config_for(f"jsonl:{path}", out, shard_documents=3))
  monkeypatch.undo()
  shard = os.path.join(out, "shards", "00000")
  assert corpus.shard_done(shard) is not None
  lines = good_lines(n_copies=2)
  write_jsonl(tmp_path / "docs.jsonl", [lines[1], lines[0]] + lines[2:])   # the input edited
  save, saved = np.save, []

  def killed_after_one_array(file, *args, **kwargs):
    if str(file).startswith(shard):
      if saved:
        raise KeyboardInterrupt
      saved.append(file)
    return save(file, *args, **kwargs)
  monkeypatch.setattr(np, "save", killed_after_one_array)
  with pytest.raises(KeyboardInterrupt):
    prepare_lib.prepare(config_for(f"jsonl:{path}", out, shard_documents=3))
  assert corpus.shard_done(shard) is None


def test_a_cased_checkpoints_vocab_is_refused(tmp_path):
  """The tokenizer here lowercases: a cased checkpoint's ids for 'Paris' would be those of
  'paris' (and one that keeps accents would see 'cafe' for 'café'). Its tokenizer_config.json
  says so; an uncased, accent-stripping one (or none) is taken."""
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines())
  prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "first")))
  checkpoint = tmp_path / "cased"
  checkpoint.mkdir()
  (checkpoint / "vocab.txt").write_text((tmp_path / "first" / "vocab.txt").read_text())
  for settings, refusal in (
      ({"do_lower_case": False}, r"cased is a cased checkpoint \(.*tokenizer_config\.json: "
                                 r"do_lower_case false\)"),
      # uncased but keeping accents: 'café' would be read as 'cafe'
      ({"do_lower_case": True, "strip_accents": False},
       r"cased keeps accents \(.*tokenizer_config\.json: strip_accents false\)")):
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=r"config\.vocab: .*" + refusal):
      prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "out"),
                                     vocab=str(checkpoint)))
  (checkpoint / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True,
                                                                "strip_accents": None}))
  stats = prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "out"),
                                         vocab=str(checkpoint)))
  assert stats["documents"] == len(PROSE)


@pytest.mark.parametrize("vocab, why", [
    (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\na\n", r"lacks special tokens \['\[MASK\]'\]"),
    (b"a\n[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n", r"\[PAD\] must have id 0"),
    (b"[PAD]\n[UNK]\n[MASK]\na\n", "sep_token not found"),
    (b"\xff\xfe\x00binary", "valid UTF-8"),
    # ids up to 7 in 7 entries: the model's table would have no row for the last
    (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\nb\na\n", "line 6's token is repeated")],
    ids=["no [MASK]", "[PAD] not 0", "no [SEP]", "binary", "a token twice"])
def test_a_vocab_without_berts_special_tokens_is_refused_naming_the_option(tmp_path, vocab,
                                                                            why):
  """A vocab.txt that is not BERT's (a special token missing, [PAD] not id 0, not text, a
  token twice) is refused naming the option, in one line, before it is copied (a traceback from the
  tokenizer, after the copy, before)."""
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines())
  (tmp_path / "vocab.txt").write_bytes(vocab)
  config = config_for(f"jsonl:{path}", str(tmp_path / "out"), vocab=str(tmp_path / "vocab.txt"))
  with pytest.raises(ConfigError, match=r"^config\.vocab: .*vocab\.txt: .*" + why):
    prepare_lib.prepare(config)
  assert not os.path.exists(tmp_path / "out" / "vocab.txt")


def test_cli_reports_a_bad_record_in_one_line(tmp_path):
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines() + [b"{oops"])
  result = subprocess.run(
      [sys.executable, "-m", "realm_jax.data.prepare", f"--config={REPO}/configs/prepare.py",
       f"--config.source=jsonl:{path}", f"--config.out_dir={tmp_path / 'out'}",
       "--config.strict=True", "--config.vocab_size=300", "--config.num_workers=0"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  errors = [l for l in result.stderr.splitlines() if l.startswith("realm-prepare: error:")]
  assert len(errors) == 1 and f"docs.jsonl:{len(PROSE) + 1}: malformed JSON" in errors[0]


@pytest.mark.parametrize("source, option", [
    ("bogus:1", "source"), ("world:x", "source"), ("jsonl:/no/such/file.jsonl", "source")])
def test_bad_options_name_the_option(tmp_path, source, option):
  with pytest.raises(ConfigError, match=f"config.{option}"):
    prepare_lib.prepare(config_for(source, str(tmp_path / "out")))


def test_a_source_dir_is_named_as_one_and_a_second_run_on_a_dir_is_refused(tmp_path):
  with pytest.raises(ConfigError, match=rf"'{tmp_path}' is a directory; give a file or a glob "
                     rf"\(jsonl:{tmp_path}/\*\.jsonl\)"):   # was "no such file"
    prepare_lib.prepare(config_for(f"jsonl:{tmp_path}", str(tmp_path / "out")))
  # squad: reads one file, as Open-QA's squad: does: a glob was let through, then opened as a
  # file name (FileNotFoundError), and a directory's message offered one
  with open(tmp_path / "a.json", "w") as f:
    json.dump({"data": []}, f)
  with pytest.raises(ConfigError, match=rf"'{tmp_path}' is a directory; give a file "
                     rf"\(squad:{tmp_path}/FILE\.json\)"):
    prepare_lib.prepare(config_for(f"squad:{tmp_path}", str(tmp_path / "out")))
  with pytest.raises(ConfigError, match=r"config\.source.*squad: reads one file, not a glob"):
    prepare_lib.prepare(config_for(f"squad:{tmp_path}/*.json", str(tmp_path / "out")))
  from realm_jax.workdir import JobLock
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines())
  config = config_for(f"jsonl:{path}", str(tmp_path / "out2"))
  with JobLock(config.out_dir, "prepare") as running:   # another realm-prepare on the dir
    running.acquire()
    with pytest.raises(ConfigError, match=r"out2 is in use: a realm-prepare \(pid \d+\)"):
      prepare_lib.prepare(config)
    other = config_for(f"jsonl:{path}", config.out_dir, block_len=64)
    with pytest.raises(ConfigError, match="is in use"):   # not: its settings written first
      prepare_lib.prepare(other)
    assert not os.path.exists(os.path.join(config.out_dir, "prepare.json"))
  assert prepare_lib.prepare(config)["documents"] == len(PROSE)


def test_a_file_whose_name_holds_glob_characters_is_read(tmp_path):
  """A file named as given is read though its name holds "[" (`squad[v2].json`): it was read
  as a glob that matched nothing, and refused as "no such file" (Open-QA's squad: read it)."""
  from realm_jax.data import qa
  squad = tmp_path / "squad[v2].json"
  squad.write_text(json.dumps({"data": [{"title": t, "paragraphs": [{"context": x, "qas": [
      {"id": t, "question": "What?", "answers": [{"text": t, "answer_start": 0}]}]}]}
      for t, x in PROSE]}))
  jsonl = write_jsonl(tmp_path / "part[1].jsonl", good_lines())
  assert qa.read_qa(f"squad:{squad}")[0]
  for source in (f"squad:{squad}", f"jsonl:{jsonl}"):
    stats = prepare_lib.prepare(config_for(source, str(tmp_path / source[:5])))
    assert stats["documents"] == len(PROSE)
  assert stats["questions"] == 0 and json.load(open(tmp_path / "squad" / "stats.json"))[
      "questions"] == len(PROSE)


@pytest.mark.parametrize("field, value, message", [
    ("tagger", "bogus", "config.tagger: unknown tagger 'bogus'"),   # was: after WordPiece
    ("max_doc_bytes", 0, "config.max_doc_bytes: must be >= 1"),      # skipped every document
    ("progress_every", -1.0, "config.progress_every: must be > 0"),
    # trained the vocab on the first document, not on none
    ("vocab_documents", 0, "config.vocab_documents: must be >= 1 (the documents the vocab"),
    # options the world never reads (it holds out no documents; it has no fields)
    ("eval_fraction", 0.2, "config.eval_fraction: 0.2 is not read by a world: source (only by "
                           "jsonl:, squad:, tfds:)"),
    ("title_field", "name", "config.title_field: 'name' is not read by a world: source"),
    ("tfds_data_dir", "/tmp/tfds", "config.tfds_data_dir: '/tmp/tfds' is not read by a world:"),
])
def test_bad_settings_are_refused_before_any_work(tmp_path, field, value, message):
  config = config_for("world:10", str(tmp_path / "out"))
  config[field] = value
  with pytest.raises(ConfigError, match=re.escape(message)):
    prepare_lib.prepare(config)
  assert not os.path.exists(tmp_path / "out")


def test_the_world_seed_is_refused_for_a_source_that_is_not_the_world(tmp_path):
  config = config_for(f"squad:{tmp_path}/s.json", str(tmp_path / "out"))
  (tmp_path / "s.json").write_text('{"data": []}')
  config.world_seed = 3
  with pytest.raises(ConfigError, match=r"config\.world_seed: 3 is not read by a squad: source "
                     r"\(only by world:\)"):
    prepare_lib.prepare(config)


def test_a_training_config_is_named_as_one():
  from tests.helpers import tiny_config
  with pytest.raises(ConfigError, match="--config is a training config .* read by realm-train"):
    prepare_lib.validate_prepare(tiny_config("ict"))


def _arrays(out_dir: str) -> dict:
  found = {}
  for root, _, files in os.walk(out_dir):
    for name in files:
      if name.endswith(".npy") or name in ("titles.json", "vocab.txt"):
        path = os.path.join(root, name)
        rel = os.path.relpath(path, out_dir)
        found[rel] = np.load(path) if name.endswith(".npy") else open(path).read()
  return found


def _assert_same(a: dict, b: dict):
  assert a.keys() == b.keys()
  for key in a:
    same = np.array_equal(a[key], b[key]) if isinstance(a[key], np.ndarray) else a[key] == b[key]
    assert same, key


def _crash_at_shard(monkeypatch, n: int):
  """Packing the `n`-th shard raises (a worker that died); returns the real build_shard."""
  build, calls = corpus.build_shard, []

  def crashing(docs, *args, **kwargs):
    calls.append(len(docs))
    if len(calls) == n:
      raise RuntimeError("worker died")
    return build(docs, *args, **kwargs)
  monkeypatch.setattr(corpus, "build_shard", crashing)
  return build


def test_a_reruns_progress_blocks_per_second_leaves_the_reused_shards_out(tmp_path,
                                                                         monkeypatch, capsys):
  """A rerun reusing 5 finished shards and packing 1 (0.5 s): its progress lines' blocks/s is
  that shard's blocks over the time (before: every block, the reused ones read in no time,
  as if packed at 6x the rate)."""
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(n_copies=2))   # 6 documents
  config = config_for(f"jsonl:{path}", str(tmp_path / "out"), shard_documents=1)
  build = _crash_at_shard(monkeypatch, 6)
  with pytest.raises(RuntimeError, match="worker died"):
    prepare_lib.prepare(config)
  packed = []

  def slow(docs, *args, **kwargs):
    time.sleep(0.5)
    result = build(docs, *args, **kwargs)
    packed.append(result["blocks"])
    return result
  monkeypatch.setattr(corpus, "build_shard", slow)
  capsys.readouterr()
  config.progress_every = 1e-6
  stats = prepare_lib.prepare(config)
  assert stats["shards_reused"] == 5 and len(packed) == 1, (stats, packed)
  lines = [l for l in capsys.readouterr().out.splitlines() if "docs read" in l]
  rates = [float(re.search(r"\(([\d,.]+) blocks/s\)", l).group(1).replace(",", ""))
           for l in lines]
  assert rates and max(rates) <= packed[0] / 0.5, (lines, packed)


def test_rerun_skips_finished_shards_and_gives_the_same_output(tmp_path, monkeypatch):
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(n_copies=5))   # 15 documents
  clean = config_for(f"jsonl:{path}", str(tmp_path / "clean"), shard_documents=4)
  prepare_lib.prepare(clean)
  # A crash while packing the third shard: the first two are finished on disk.
  build = _crash_at_shard(monkeypatch, 3)
  # The same vocab for both (HF's WordPiece trainer breaks ties differently run to run).
  crashed = config_for(f"jsonl:{path}", str(tmp_path / "crashed"), shard_documents=4,
                       vocab=os.path.join(clean.out_dir, "vocab.txt"))
  with pytest.raises(RuntimeError, match="worker died"):
    prepare_lib.prepare(crashed)
  assert not os.path.exists(os.path.join(crashed.out_dir, "stats.json"))
  monkeypatch.setattr(corpus, "build_shard", build)
  stats = prepare_lib.prepare(crashed)
  assert stats["shards"] == 4 and stats["shards_reused"] == 2
  _assert_same(_arrays(clean.out_dir), _arrays(crashed.out_dir))
  # A finished preparation is returned as is; other settings on the same dir are refused.
  assert prepare_lib.prepare(crashed)["blocks"] == stats["blocks"]
  crashed.block_len = 64
  with pytest.raises(ConfigError, match="block_len: 288"):
    prepare_lib.prepare(crashed)


def test_a_source_edited_after_a_crash_is_packed_again_where_it_changed(tmp_path,
                                                                         monkeypatch):
  """The natural workflow: the job died, the user fixed the file, re-runs. A finished shard
  whose documents changed is packed again, never mixed in."""
  lines = good_lines(n_copies=5)                                       # 15 documents
  vocab_from = config_for(f"jsonl:{write_jsonl(tmp_path / 'v.jsonl', lines)}",
                          str(tmp_path / "vocab"), shard_documents=4)
  prepare_lib.prepare(vocab_from)
  vocab = os.path.join(vocab_from.out_dir, "vocab.txt")
  path = write_jsonl(tmp_path / "docs.jsonl", lines)
  build = _crash_at_shard(monkeypatch, 4)
  edited = config_for(f"jsonl:{path}", str(tmp_path / "edited"), shard_documents=4,
                      vocab=vocab)
  with pytest.raises(RuntimeError, match="worker died"):
    prepare_lib.prepare(edited)
  monkeypatch.setattr(corpus, "build_shard", build)
  fixed = [json.dumps({"title": "Apollo 11", "text": "Apollo 11 landed in 1969."}).encode()]
  write_jsonl(tmp_path / "docs.jsonl", fixed + lines[1:])   # line 1 edited
  stats = prepare_lib.prepare(edited)
  clean = config_for(f"jsonl:{path}", str(tmp_path / "clean"), shard_documents=4, vocab=vocab)
  assert stats["blocks"] == prepare_lib.prepare(clean)["blocks"]
  assert stats["shards_reused"] == 2          # shards 1 and 2; shard 0 holds the edit
  _assert_same(_arrays(clean.out_dir), _arrays(edited.out_dir))


def test_a_vocab_is_made_again_when_its_documents_changed_after_a_crash(tmp_path,
                                                                        monkeypatch):
  """A crash after the vocab was trained, the source edited, a rerun: the vocab is trained
  again on the edited documents (it used to be reused, trained on the old ones); the same
  rerun without an edit reuses it."""
  lines = good_lines(n_copies=5)
  path = write_jsonl(tmp_path / "docs.jsonl", lines)
  config = config_for(f"jsonl:{path}", str(tmp_path / "out"), shard_documents=4)
  build = _crash_at_shard(monkeypatch, 3)
  with pytest.raises(RuntimeError, match="worker died"):
    prepare_lib.prepare(config)
  monkeypatch.setattr(corpus, "build_shard", build)
  trained = []
  train = prepare_lib.train_tokenizer
  monkeypatch.setattr(prepare_lib, "train_tokenizer",
                      lambda *args: trained.append(1) or train(*args))
  record = os.path.join(config.out_dir, prepare_lib.VOCAB_RECORD)
  before = json.load(open(record))
  edited = [json.dumps({"title": "Zyxomorphic", "text": "Zyxomorphic ouagadougou."}).encode()]
  write_jsonl(tmp_path / "docs.jsonl", edited + lines[1:])
  prepare_lib.prepare(config)
  assert trained == [1] and json.load(open(record)) != before
  fresh = config_for(f"jsonl:{path}", str(tmp_path / "fresh"), shard_documents=4)
  prepare_lib.prepare(fresh)
  assert json.load(open(record)) == json.load(open(os.path.join(fresh.out_dir,
                                                                prepare_lib.VOCAB_RECORD)))
  # unedited: reused, not trained again
  again = config_for(f"jsonl:{path}", str(tmp_path / "again"), shard_documents=4)
  trained.clear()
  build = _crash_at_shard(monkeypatch, 2)
  with pytest.raises(RuntimeError, match="worker died"):
    prepare_lib.prepare(again)
  monkeypatch.setattr(corpus, "build_shard", build)
  assert prepare_lib.prepare(again)["shards_reused"] == 1 and trained == [1]


def test_shards_packed_with_another_vocab_are_packed_again(tmp_path, monkeypatch):
  """The vocab file a crashed run copied was replaced before the rerun: every shard is packed
  again with the new vocab (the finished ones used to be reused: token ids of two vocabs)."""
  lines = good_lines(n_copies=5)
  vocab_from = config_for(f"jsonl:{write_jsonl(tmp_path / 'v.jsonl', lines)}",
                          str(tmp_path / "vocab"))
  prepare_lib.prepare(vocab_from)
  vocab = str(tmp_path / "vocab.txt")
  entries = open(os.path.join(vocab_from.out_dir, "vocab.txt")).read().splitlines()
  open(vocab, "w").write("\n".join(entries) + "\n")
  path = write_jsonl(tmp_path / "docs.jsonl", lines)
  config = config_for(f"jsonl:{path}", str(tmp_path / "out"), shard_documents=4, vocab=vocab)
  build = _crash_at_shard(monkeypatch, 3)
  with pytest.raises(RuntimeError, match="worker died"):
    prepare_lib.prepare(config)
  monkeypatch.setattr(corpus, "build_shard", build)
  entries[200], entries[201] = entries[201], entries[200]   # another vocab at the same path
  open(vocab, "w").write("\n".join(entries) + "\n")
  stats = prepare_lib.prepare(config)
  assert stats["shards_reused"] == 0
  clean = config_for(f"jsonl:{path}", str(tmp_path / "clean"), shard_documents=4, vocab=vocab)
  prepare_lib.prepare(clean)
  _assert_same(_arrays(clean.out_dir), _arrays(config.out_dir))


def test_a_source_with_no_usable_document_leaves_nothing_that_binds_the_rerun(tmp_path):
  """No document under a wrong text_field: refused before a vocab is made of nothing (a
  5-entry vocab used to stay, and lock the dir to the wrong field); the corrected command
  then prepares the dir."""
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines())
  config = config_for(f"jsonl:{path}", str(tmp_path / "out"), text_field="body")
  with pytest.raises(DataError, match=r"no usable document \(skipped: \{'missing text field"):
    prepare_lib.prepare(config)
  assert set(os.listdir(config.out_dir)) == {"prepare.json", prepare_lib.LOCK}
  config.text_field = "text"
  stats = prepare_lib.prepare(config)
  assert stats["documents"] == len(PROSE) and stats["vocab_size"] > 100
  # a copied vocab is written before the source is read: a SQuAD file that is not one leaves
  # it, and the corrected file (another source) still takes the dir
  vocab = os.path.join(config.out_dir, "vocab.txt")
  (tmp_path / "bad.json").write_text("not json")
  squad = config_for(f"squad:{tmp_path}/bad.json", str(tmp_path / "squad"), vocab=vocab)
  with pytest.raises(DataError, match="bad.json"):
    prepare_lib.prepare(squad)
  assert "vocab.txt" in os.listdir(squad.out_dir)
  good = tmp_path / "good.json"
  good.write_text(json.dumps({"data": [{"title": t, "paragraphs": [{"context": x, "qas": []}]}
                                       for t, x in PROSE]}))
  squad.source = f"squad:{good}"
  assert prepare_lib.prepare(squad)["documents"] == len(PROSE)


def test_a_run_killed_while_writing_its_settings_or_vocab_binds_no_rerun(tmp_path):
  """What a run killed (-9) in the middle of writing prepare.json, the copied vocab or the
  vocab's record leaves is a temp file beside them: the same command run again prepares the
  dir (it used to be refused as a dir realm-prepare never wrote), and before any shard is
  packed a rerun under other settings takes it, as it takes one that wrote them whole."""
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines())
  config = config_for(f"jsonl:{path}", str(tmp_path / "out"))
  os.makedirs(config.out_dir)
  for name in (prepare_lib.LOCK, "prepare.json.tmp"):   # killed in its first write
    open(os.path.join(config.out_dir, name), "w").close()
  assert prepare_lib.prepare(config)["documents"] == len(PROSE)
  vocab = os.path.join(config.out_dir, "vocab.txt")
  other = config_for(f"jsonl:{path}", str(tmp_path / "other"), vocab=vocab)
  os.makedirs(other.out_dir)
  with open(os.path.join(other.out_dir, "prepare.json"), "w") as f:
    json.dump({**prepare_lib._fingerprint(other), "block_len": 64}, f)
  for name in (prepare_lib.LOCK, "vocab.txt.tmp", f"{prepare_lib.VOCAB_RECORD}.tmp-12345"):
    open(os.path.join(other.out_dir, name), "w").close()   # killed while copying, recording
  assert prepare_lib.prepare(other)["documents"] == len(PROSE)
  for out in (config.out_dir, other.out_dir):   # gone (a bucket's data was uploaded with them)
    assert not [n for n in os.listdir(out) if ".tmp" in n], os.listdir(out)


def test_gzipped_jsonl_is_read_and_a_truncated_one_is_named(tmp_path):
  import gzip
  (tmp_path / "dump").mkdir()
  write_jsonl(tmp_path / "dump" / "a.jsonl", good_lines()[:1])
  with gzip.open(tmp_path / "dump" / "b.jsonl.gz", "wb") as f:
    f.write(b"\n".join(good_lines()[1:]) + b"\n")
  stats = prepare_lib.prepare(config_for(f"jsonl:{tmp_path}/dump/*", str(tmp_path / "out")))
  assert stats["documents"] == len(PROSE) and stats["skipped"] == {}   # was invalid UTF-8
  whole = gzip.compress(b"\n".join(good_lines(n_copies=40)) + b"\n")
  (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
  with pytest.raises(DataError, match=r"cut\.jsonl\.gz: a corrupt or truncated gzip file"):
    prepare_lib.prepare(config_for(f"jsonl:{tmp_path}/cut.jsonl.gz", str(tmp_path / "o2")))


def test_a_gzip_file_with_corrupt_data_is_named(tmp_path):
  """A gzip file whose compressed data is damaged (not cut short): zlib's own error, which is
  no OSError, stopped the job with a traceback; a JSONL and a SQuAD file alike now stop it
  with one line naming the file."""
  import gzip
  squad = json.dumps({"data": [{"title": t, "paragraphs": [{"context": x, "qas": []}]}
                               for t, x in PROSE * 40]}).encode()
  for name, content, kind in (("d.jsonl.gz", b"\n".join(good_lines(n_copies=40)), "jsonl"),
                              ("s.json.gz", squad, "squad")):
    damaged = bytearray(gzip.compress(content, mtime=0))
    damaged[200:260] = bytes(b ^ 0x55 for b in damaged[200:260])
    (tmp_path / name).write_bytes(damaged)
    with pytest.raises(DataError, match=rf"{re.escape(name)}: a corrupt or truncated gzip"):
      prepare_lib.prepare(config_for(f"{kind}:{tmp_path / name}", str(tmp_path / kind)))


def test_jsonl_files_as_they_come(tmp_path):
  """A byte-order mark, a glob that also matches a folder, a text measured as text (not as its
  escaped JSON), and a line far over the limit read past without holding it."""
  folder = tmp_path / "dump"
  (folder / "_temporary").mkdir(parents=True)
  cjk = "东京是日本的首都。" * 24                      # 648 bytes of text, ~1.3 KB escaped
  lines = good_lines() + [json.dumps({"title": "Tokyo", "text": cjk}).encode(),
                          json.dumps({"title": "Long", "text": "word " * 300}).encode(),
                          b'{"title": "Huge", "text": "' + b"x" * 80_000 + b'"}']
  with open(folder / "part-0.jsonl", "wb") as f:
    f.write(b"\xef\xbb\xbf" + b"\r\n".join(lines) + b"\r\n")
  stats = prepare_lib.prepare(config_for(f"jsonl:{folder}/*", str(tmp_path / "out"),
                                         max_doc_bytes=1000))
  assert stats["read"] == len(lines) and stats["documents"] == len(PROSE) + 1
  assert stats["skipped"] == {sources.TOO_LARGE: 2}   # 1,500 bytes of text; the 80 KB line


def test_worker_processes_give_the_in_process_output(tmp_path):
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(n_copies=4))
  one = config_for(f"jsonl:{path}", str(tmp_path / "one"), shard_documents=3)
  prepare_lib.prepare(one)
  two = config_for(f"jsonl:{path}", str(tmp_path / "two"), shard_documents=3, num_workers=2,
                   vocab=os.path.join(one.out_dir, "vocab.txt"))
  prepare_lib.prepare(two)
  _assert_same(_arrays(one.out_dir), _arrays(two.out_dir))


def test_long_sentences_are_cut_and_long_titles_truncated(tmp_path):
  words = " ".join(f"w{i}" for i in range(120))
  path = write_jsonl(tmp_path / "docs.jsonl", [json.dumps({
      "title": "A very long title " * 10, "text": f"{words}. Short one in 1999."}).encode()])
  stats = prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "out"), block_len=32,
                                         vocab_size=60))    # too small for whole "w57"s
  data = PreparedData(str(tmp_path / "out"))
  assert stats["titles_truncated"] == 1 and stats["sentences_cut"] == 1
  assert data.blocks.lengths.max() <= 32 and stats["blocks"] > 3
  assert (data.blocks.body_start <= 1 + (32 - 3) // 2 + 1).all()
  # The cut falls between words ("w57" is "w5 ##7" here): no block's body opens mid-word,
  # and the long sentence's pieces, read block after block, are the sentence's own.
  tokenizer = load_tokenizer(os.path.join(str(tmp_path / "out"), "vocab.txt"))
  bodies = [tokenizer.tokens(data.blocks.tokens[b, start:length - 1])
            for b, (start, length) in enumerate(zip(data.blocks.body_start, data.blocks.lengths))]
  sentence = tokenizer.tokens(tokenizer.encode_batch([words + "."])[0][0])
  assert any(t.startswith("##") for t in sentence)
  assert not any(body[0].startswith("##") for body in bodies)
  assert [t for body in bodies[:-1] for t in body] == sentence


def test_every_sentence_without_an_example_is_counted(tmp_path):
  """A sentence of only zero-width or control characters (a trailing left-to-right mark) gives
  no wordpiece and so no example: it is counted under examples_skipped like the others."""
  lines = good_lines() + [json.dumps({"title": "Marked", "text": "Alice Borin met Bob Kane in "
                                      "1990. \u200e"}).encode()]
  stats = prepare_lib.prepare(config_for(f"jsonl:{write_jsonl(tmp_path / 'd.jsonl', lines)}",
                                         str(tmp_path / "out")))
  assert stats["sentences"] == 11 and stats["examples_skipped"]["no wordpiece"] == 1
  assert stats["sentences"] == sum(stats["examples"].values()) + sum(
      stats["examples_skipped"].values())


def test_a_data_dir_without_a_block_is_refused_naming_data_dir(tmp_path):
  """Documents of only zero-width characters give no block (documents_without_blocks): a job
  opening such a dir is refused naming data.dir, not left to fail later (Open-QA's frozen
  index embedding 0 blocks raised a TypeError after the models were built)."""
  from realm_jax import workdir as workdir_lib
  from tests.helpers import tiny_config
  good = config_for(f"jsonl:{write_jsonl(tmp_path / 'g.jsonl', good_lines())}",
                    str(tmp_path / "good"))
  prepare_lib.prepare(good)
  lines = [json.dumps({"title": "\u200b", "text": "\u200b\u200c"}).encode()]
  stats = prepare_lib.prepare(config_for(f"jsonl:{write_jsonl(tmp_path / 'd.jsonl', lines)}",
                                         str(tmp_path / "out"),
                                         vocab=os.path.join(good.out_dir, "vocab.txt")))
  assert (stats["blocks"], stats["documents_without_blocks"]) == (0, 1)
  with pytest.raises(ConfigError, match=r"^config\.data\.dir: .*out holds no block"):
    workdir_lib.open_data(tiny_config("ict", data_dir=str(tmp_path / "out")))
  assert workdir_lib.open_data(tiny_config("ict", data_dir=good.out_dir)).blocks.num_blocks


def test_a_capital_a_non_ascii_space_and_a_period_are_split_as_with_a_space(tmp_path):
  """sentencex panics on a capital letter, a space other than ASCII's and a period ("plan
  A\u00a0."): such a text is split as with a plain space, and the job goes on (it stopped with
  the panic's traceback, or an unpicklable error from a worker)."""
  text = "Alice Borin chose plan A\u00a0. It worked in 1990."
  assert split_sentences(text) == [(0, 26), (27, 45)]
  assert split_sentences(text) == split_sentences(text.replace("\u00a0", " "))
  lines = good_lines() + [json.dumps({"title": "Plans", "text": text}).encode()]
  stats = prepare_lib.prepare(config_for(f"jsonl:{write_jsonl(tmp_path / 'd.jsonl', lines)}",
                                         str(tmp_path / "out")))
  assert stats["documents"] == 4 and stats["sentences"] == 11


def test_held_out_documents_become_the_eval_split(tmp_path):
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(n_copies=20))
  stats = prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "out"),
                                         eval_fraction=0.3))
  data = PreparedData(str(tmp_path / "out"))
  ev, tr = data.examples("eval"), data.examples("train")
  assert 0 < len(ev) and 0 < len(tr) and stats["examples"]["eval"] == len(ev)
  eval_docs = set(data.blocks.doc_ids[ev.block].tolist())
  assert not eval_docs & set(data.blocks.doc_ids[tr.block].tolist())
  for i in range(len(ev)):        # the evaluated span is one of the example's salient spans
    assert any((ev.target_span[i] == s).all() for s in ev.spans[i, :ev.num_spans[i]])


def test_one_text_under_two_titles_stays_in_one_split(tmp_path):
  """A text held out under one title is not trained on under another (a redirect's copy, a
  page saved twice): each document with the text takes the split of the first one. Titles
  are drawn until the content hash alone would put the copies in different splits."""
  text = "Kelmar is a town on the river Selva. It was founded in 1843."
  titles = [f"Kelmar {i}" for i in range(64)]
  by_hash = {t: sources._split_of(t, text, 0.5) for t in titles}
  first = titles[0]
  other = next(t for t in titles if by_hash[t] != by_hash[first])
  lines = [{"title": first, "text": text}, {"title": other, "text": "  " + text.replace(" ", "\n")},
           {"title": "Selva", "text": "The Selva flows into the sea."}]
  path = write_jsonl(tmp_path / "docs.jsonl", [json.dumps(x).encode() for x in lines])
  docs = list(sources.read_documents(config_for(f"jsonl:{path}", str(tmp_path / "out"),
                                                eval_fraction=0.5), sources.Skips(False)))
  assert [d.title for d in docs] == [first, other, "Selva"]
  assert [d.split for d in docs] == [by_hash[first], by_hash[first],
                                     sources._split_of("Selva", lines[2]["text"], 0.5)]


def test_a_text_with_composed_and_with_decomposed_accents_is_one_document(tmp_path):
  """NFC and NFD copies of one document read as the same wordpieces: the second is a repeat
  (not trained on while the first is held out), and both forms take one split."""
  import unicodedata
  text = "Beyonc\u00e9 Knowles sang at the Caf\u00e9 Olympia in 1954."
  nfd = lambda s: unicodedata.normalize("NFD", s)
  assert all(sources._split_of("Beyonc\u00e9", t, f) == sources._split_of(nfd("Beyonc\u00e9"),
                                                                        nfd(t), f)
             for t in (text, text.replace("1954", "1955")) for f in (0.3, 0.5, 0.7))
  lines = [{"title": "Beyonc\u00e9", "text": text},
           {"title": nfd("Beyonc\u00e9"), "text": nfd(text)}]
  path = write_jsonl(tmp_path / "docs.jsonl", [json.dumps(x).encode() for x in lines])
  skips = sources.Skips(False)
  docs = list(sources.read_documents(config_for(f"jsonl:{path}", str(tmp_path / "out"),
                                                eval_fraction=0.5), skips))
  assert [d.title for d in docs] == ["Beyonc\u00e9"] and skips.counts == {sources.DUPLICATE: 1}


def test_tfds_source_reads_a_mocked_dataset_and_explains_unprepared_ones(tmp_path,
                                                                         monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  temp = tmp_path / "temp"            # TFDS's temp folders go here: none may be left
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  import tensorflow_datasets.text.wikipedia  # noqa: F401  (registers the builder)
  name = "wikipedia/20230601.en"
  config = config_for(f"tfds:{name}", str(tmp_path / "missing"),
                      tfds_data_dir=str(tmp_path / "tfds"))
  with pytest.raises(ConfigError, match="is not prepared .*tfds build wikipedia"):
    prepare_lib.prepare(config)
  with tfds.testing.mock_data(num_examples=12):
    stats = prepare_lib.prepare(config_for(f"tfds:{name}:train", str(tmp_path / "mock"),
                                           tfds_data_dir=str(tmp_path / "tfds")))
  assert stats["read"] == 12
  assert stats["documents"] + sum(stats["skipped"].values()) == 12
  assert stats["blocks"] >= stats["documents"] > 0
  assert load_tokenizer(str(tmp_path / "mock" / "vocab.txt")).vocab_size > 5
  assert not os.listdir(temp)


@pytest.mark.parametrize("space", ["", " "])
def test_hf_ner_tagger_runs_inside_prepare(tmp_path, capsys, space):
  """(The tagger with a space before it, which the tagger check takes, was run in every
  worker process: a model loaded per worker.)"""
  from tests.test_hf_ner import ner_checkpoint
  # A model that never finds an entity: the salient spans are the date regex's alone.
  ner_dir, _, _ = ner_checkpoint(tmp_path / "ner", forced="O")
  path = write_jsonl(tmp_path / "docs.jsonl", good_lines())
  stats = prepare_lib.prepare(config_for(f"jsonl:{path}", str(tmp_path / "out"),
                                         tagger=f"{space}hf_ner:{ner_dir}", num_workers=2))
  assert "packed in this process" in capsys.readouterr().out
  assert stats["tagger"] == f"{space}hf_ner:{ner_dir}" and stats["examples"]["train"] > 0
  data = PreparedData(str(tmp_path / "out"))
  ex, tok = data.examples("train"), data.tokenizer
  masked = {tok.decode(ex.tokens[i, s:e]) for i in range(len(ex))
            for s, e in ex.spans[i, :ex.num_spans[i]]}
  assert "20 july 1969" in masked and "1867" in masked
  assert all(any(c.isdigit() for c in m) for m in masked), masked   # no names: dates only


def test_the_world_stats_count_the_questions_it_writes(world_dir):
  """stats.json said 0 questions for a world, whose questions come from the world itself."""
  with open(os.path.join(world_dir, "stats.json")) as f:
    stats = json.load(f)
  lines = {split: sum(1 for _ in open(os.path.join(world_dir, "qa", f"{split}.jsonl")))
           for split in ("train", "eval")}
  assert stats["questions_by_split"] == lines and min(lines.values()) > 0
  assert stats["questions"] == sum(lines.values())
