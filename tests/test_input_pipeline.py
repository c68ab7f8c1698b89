"""The grain input pipeline: a restored iterator continues exactly where the saved one stopped,
processes build their shares of the one-process batches, every epoch is reshuffled, and
errors while building a batch reach the consumer."""

import json

import grain
import numpy as np
import pytest

from realm_jax.data import pipeline
from realm_jax.errors import ConfigError
from realm_jax.runtime import partitioning
from realm_jax.train import batches, openqa_inputs
from tests.helpers import tiny_config

STOP_AFTER, RESUMED = 7, 100
KEYS = {"realm": {"query_ids": np.int32, "mask_positions": np.int32, "mask_labels": np.int32,
                  "mask_weights": np.float32, "query_len": np.int32, "source_block": np.int32,
                  "query_row": np.int32, "span_index": np.int32},
        "ict": {"query_ids": np.int32, "block_ids": np.int32, "block_segments": np.int32}}


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def shard_rows(queries, start, stop):
  return np.array([queries.rows[i] for i in range(start, stop)])


@pytest.mark.parametrize("task", ["realm", "ict"])
def test_restored_iterator_yields_the_uninterrupted_batches(world_data, task):
  config = tiny_config(task)
  examples = world_data.examples("train")
  # The run crosses epoch boundaries, where the shuffle and the random draws change.
  assert (STOP_AFTER + RESUMED) * config.train.batch_size > 2 * len(examples)

  straight_iter = batches.QueryBatches(config, world_data, examples).iterator(prefetch=0)
  straight = take(straight_iter, STOP_AFTER + RESUMED)
  straight_iter.close()

  first = batches.QueryBatches(config, world_data, examples)
  it = first.iterator(prefetch=3)
  take(it, STOP_AFTER)
  # as the checkpoint keeps it:
  saved = json.loads(json.dumps(first.state(it.get_state(), STOP_AFTER)))
  it.close()
  assert saved["next_step"] == STOP_AFTER and "iterator" in saved

  second = batches.QueryBatches(config, world_data, examples)   # a fresh pipeline
  it = second.iterator(prefetch=2, saved=saved)
  resumed = take(it, RESUMED)
  it.close()

  for offset, (got, want) in enumerate(zip(resumed, straight[STOP_AFTER:])):
    assert {k: v.dtype for k, v in got.items()} == KEYS[task]
    for key in want:
      assert got[key].shape[0] == config.train.batch_size
      np.testing.assert_array_equal(got[key], want[key],
                                    err_msg=f"batch {STOP_AFTER + offset} {key}")
  # The stream moves: consecutive batches differ, and a fresh iterator starts elsewhere.
  assert not np.array_equal(straight[STOP_AFTER]["query_ids"], straight[0]["query_ids"])
  assert not np.array_equal(straight[1]["query_ids"], straight[0]["query_ids"])
  # Iteration and random access agree: the batch of step t is `queries(t)`.
  for step in (0, STOP_AFTER, STOP_AFTER + RESUMED - 1):
    np.testing.assert_array_equal(second(step)["query_ids"], straight[step]["query_ids"])


def test_batches_are_a_function_of_the_seed(world_data):
  examples = world_data.examples("train")
  a = batches.QueryBatches(tiny_config("realm"), world_data, examples)
  b = batches.QueryBatches(tiny_config("realm"), world_data, examples)
  other = batches.QueryBatches(tiny_config("realm", seed=1), world_data, examples)
  for step in (0, 5):
    for key, value in a(step).items():
      np.testing.assert_array_equal(b(step)[key], value)
  assert not np.array_equal(a(0)["query_ids"], other(0)["query_ids"])


@pytest.mark.parametrize("num_examples", [101, 64])
def test_the_stream_covers_every_epoch_once_reshuffled(num_examples):
  stream = pipeline.example_stream(num_examples, 5)
  epochs = [np.array([stream[i] for i in range(e * num_examples, (e + 1) * num_examples)])
            for e in range(3)]
  for rows in epochs:
    assert sorted(rows) == list(range(num_examples))
  assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


@pytest.mark.parametrize("task, count", [("ict", 2), ("realm", 2), ("realm", 4)])
def test_process_shares_make_the_single_process_batches(world_data, task, count):
  """Process p builds its slice of every global batch: together, in process order, they are the
  batches of a one-process run, so a run on P hosts trains on the same data."""
  config = tiny_config(task)
  examples = world_data.examples("train")
  single = batches.QueryBatches(config, world_data, examples)
  procs = [batches.QueryBatches(config, world_data, examples, (p,), count) for p in range(count)]
  iterators = [queries.iterator(prefetch=2) for queries in procs]
  steps = 2 * len(examples) // config.train.batch_size + 1   # across an epoch boundary
  for step in range(steps):
    shares = [next(it) for it in iterators]
    assert all(len(share["query_ids"]) == config.train.batch_size // count for share in shares)
    if step in (0, 1, steps - 1):
      for key, value in single(step).items():
        np.testing.assert_array_equal(np.concatenate([share[key] for share in shares]), value)
  for it in iterators:
    it.close()


def test_question_shares_make_the_single_process_batches():
  config = tiny_config("realm")
  single = openqa_inputs.QuestionBatches(config, 50)
  procs = [openqa_inputs.QuestionBatches(config, 50, (p,), 2) for p in range(2)]
  for step in (0, 3, 7):
    np.testing.assert_array_equal(
        np.concatenate([q(step)["rows"] for q in procs]), single(step)["rows"])


@pytest.mark.parametrize("count", [1, 2])
def test_a_process_batch_of_one_is_its_share_of_the_global_batch(world_data, count):
  """A per-process batch of one (batch size = process count) holds the examples the global
  batch holds on one process: the stream positions [t * B, (t + 1) * B) in process order."""
  config = tiny_config("realm", train__batch_size=count)
  examples = world_data.examples("train")
  procs = [batches.QueryBatches(config, world_data, examples, (p,), count) for p in range(count)]
  for step in (0, 3, len(examples)):   # (the last in a later epoch)
    rows = [int(q(step)["query_row"][0]) for q in procs]
    assert rows == [procs[0].rows[step * count + p] for p in range(count)]
  iterator = procs[-1].iterator(prefetch=2)
  assert [int(next(iterator)["query_row"][0]) for _ in range(2)] == [
      int(procs[-1](step)["query_row"][0]) for step in range(2)]
  saved = procs[-1].state(iterator.get_state(), 2)   # a checkpoint after step 1: resumed
  iterator.close()
  resumed = procs[-1].iterator(prefetch=2, saved=saved)
  assert [int(next(resumed)["query_row"][0]) for _ in range(3)] == [
      int(procs[-1](step)["query_row"][0]) for step in range(2, 5)]
  resumed.close()
  questions = [openqa_inputs.QuestionBatches(config, 50, (p,), count) for p in range(count)]
  single = openqa_inputs.QuestionBatches(tiny_config("realm", train__batch_size=count), 50)
  np.testing.assert_array_equal(np.concatenate([q(5)["rows"] for q in questions]),
                                single(5)["rows"])


def test_ict_removes_the_sentence_at_the_configured_rate(world_data):
  config = tiny_config("ict")
  examples, blocks = world_data.examples("train"), world_data.blocks
  queries = batches.QueryBatches(config, world_data, examples)
  b, steps, removed = queries.local_batch, 50, 0
  for step in range(steps):
    rows = shard_rows(queries, step * b, (step + 1) * b)
    full = np.asarray(blocks.tokens[examples.block[rows]])
    removed += (queries(step)["block_ids"] != full).any(axis=1).sum()
  rate = removed / (steps * b)
  assert abs(rate - config.data.ict_remove_prob) < 0.05, rate


def test_span_choices_are_redrawn_every_epoch(world_data):
  config = tiny_config("realm")
  examples = world_data.examples("train")
  queries = batches.QueryBatches(config, world_data, examples)
  n, b = len(examples), queries.local_batch
  steps = 3 * n // b
  masked = {}
  for step in range(steps):
    rows = shard_rows(queries, step * b, (step + 1) * b)
    starts = queries(step)["mask_positions"][:, 0]
    for row, start in zip(rows, starts):
      masked.setdefault(int(row), set()).add(int(start))
  several = [r for r in masked if examples.num_spans[r] > 1]
  assert several and sum(len(masked[r]) > 1 for r in several) > len(several) // 2


def test_bad_batch_sizes_and_missing_state_fail_clearly(world_data):
  examples = world_data.examples("train")
  with pytest.raises(ConfigError, match="train.batch_size"):
    batches.QueryBatches(tiny_config("realm", train__batch_size=18), world_data, examples, (0,), 4)
  queries = batches.QueryBatches(tiny_config("realm"), world_data, examples)
  with pytest.raises(ValueError, match="no input-pipeline state"):
    queries.iterator(prefetch=2, saved={"next_step": 4})
  with pytest.raises(ValueError, match=r"data shards \[2\]"):
    pipeline.process_batches(pipeline.example_stream(10, 0), 4, (2,), 2, list)
  with pytest.raises(ValueError, match=r"data shards \[1, 0\]"):
    pipeline.process_batches(pipeline.example_stream(10, 0), 4, (1, 0), 2, list)


def test_fewer_mask_slots_than_the_widest_span_are_refused(world_data):
  """data.max_masks below the widest salient span would mask such spans in part (their other
  wordpieces left for the model to copy): refused naming it; at the widest, spans are whole."""
  from realm_jax.config.validation import validate_against_data
  examples = world_data.examples("train")
  widest = examples.widest_span()
  widths = examples.spans[..., 1] - examples.spans[..., 0]
  assert widest == max(int(widths[r, :examples.num_spans[r]].max()) for r in range(len(examples)))
  assert examples.widest_span(chunk=7) == widest   # read in pieces, the same
  held_out = world_data.examples("eval")   # what an evaluation of its first 20 masks
  targets = held_out.target_span[:20, 1] - held_out.target_span[:20, 0]
  assert held_out.widest_span(20, targets=True, chunk=6) == targets.max() > 0
  with pytest.raises(ConfigError, match=rf"config\.data\.max_masks: {widest - 1} < {widest}, "
                     "the wordpieces of the widest salient span in .*: such a span would be "
                     "masked in part"):
    validate_against_data(tiny_config("realm", data__max_masks=widest - 1), widest_span=widest)
  config = tiny_config("realm", data__max_masks=widest)
  validate_against_data(config, widest_span=widest)
  batch = batches.QueryBatches(config, world_data, examples)(0)
  spans = examples.spans[batch["query_row"], batch["span_index"]]
  np.testing.assert_array_equal(batch["mask_weights"].sum(1), spans[:, 1] - spans[:, 0])


def test_sentences_longer_than_the_queries_are_refused_unless_ict_cuts_them():
  """Data whose sentences exceed data.query_len - 2 is refused at start-up naming
  data.long_queries, which ICT alone may set to 'cut' (REALM masks a span inside the query;
  Open-QA cuts its questions always); a value of neither kind is named."""
  from realm_jax.config.validation import validate, validate_against_data
  with pytest.raises(ConfigError, match=r"config\.data\.query_len: 10 < longest prepared sentence "
                     r"\+ 2 = 16; or data\.long_queries 'cut' cuts each query to its first "
                     "query_len - 2 wordpieces, as ORQA does"):
    validate_against_data(tiny_config("ict", data__query_len=10), max_sentence_len=14)
  cut = tiny_config("ict", data__query_len=10, data__long_queries="cut")
  validate(cut)
  validate_against_data(cut, max_sentence_len=14)
  with pytest.raises(ConfigError, match=r"config\.data\.query_len: 10 < longest prepared sentence "
                     r"\+ 2 = 16 \(data\.long_queries 'cut' is ICT's alone: REALM masks a "
                     "salient span inside the query"):
    validate_against_data(tiny_config("realm", data__query_len=10), max_sentence_len=14)
  with pytest.raises(ConfigError, match=r"config\.data\.long_queries: 'cut' cuts ICT's query "
                     r"sentences \(ORQA's\), not task 'realm''s: REALM masks a salient span"):
    validate(tiny_config("realm", data__long_queries="cut"))
  with pytest.raises(ConfigError, match=r"config\.data\.long_queries: 'trim' is not one of "
                     r"\('refuse', 'cut'\)"):
    validate(tiny_config("ict", data__long_queries="trim"))


def test_errors_while_building_a_batch_reach_the_consumer():
  def build(elements):
    if 30 in elements:
      raise RuntimeError("broken example 30")
    return np.asarray(elements)

  for depth in (0, 3):
    it = pipeline.prefetched(grain.MapDataset.range(100).batch(10, batch_fn=build), depth)
    assert [int(next(it)[0]) for _ in range(3)] == [0, 10, 20]
    with pytest.raises(RuntimeError, match="broken example 30"):
      next(it)
    it.close()


def test_the_batch_feed_builds_no_step_past_the_runs_end_and_gives_way_to_a_stop():
  """A batch past the last step may wait for an index that is never written (deterministic
  refresh, swap lag below the prefetch depth): none is built, so closing the feed does not
  wait on it. A consumer told to stop while its batch waits gets a FeedStopped."""
  import threading
  import time
  from realm_jax.train.feed import BatchFeed, FeedStopped
  never = threading.Event()

  class Queries:                       # the grain iterator's part: next() and get_state()
    def __init__(self):
      self.taken = 0

    def __next__(self):
      self.taken += 1
      return {}

    def get_state(self):
      return {"taken": self.taken}

  def assemble(step, queries):
    if step >= 3:
      never.wait(60)                   # an index that never comes
    return {"step": step}, {}
  feed = BatchFeed(Queries(), assemble, 0, depth=2, end=3)
  assert [feed.next()[0]["step"] for _ in range(3)] == [0, 1, 2]
  t0 = time.time()
  feed.close()
  assert time.time() - t0 < 5
  stuck = BatchFeed(Queries(), assemble, 3, depth=2, end=5)
  t0 = time.time()
  with pytest.raises(FeedStopped, match="the batch of step 4 was not ready after"):
    stuck.next(should_stop=lambda: time.time() - t0 > 1)
  never.set()
  stuck.close()


def test_async_versions_first_step_is_decided_once():
  """After the first version, the steps up to `depth` - 1 ahead are final; step `depth` is
  decided by the first advance, which may give it a newer version: a feed asking for it
  earlier waits instead of taking the first version (another host would not)."""
  import threading
  import types
  from realm_jax.train.feed import VersionSchedule
  version = lambda v: types.SimpleNamespace(version=v, step=10 * v)

  class Subscriber:
    have = {1: version(1)}

    def newest(self):
      return self.have[max(self.have)]

    def wait(self, pick, timeout, what, should_stop=None):
      return pick(self.have)

    def release(self, **kwargs):
      pass
  subscriber = Subscriber()
  config = types.SimpleNamespace(retrieval=types.SimpleNamespace(refresh="async",
                                                                 index_timeout=5))
  schedule = VersionSchedule(config, subscriber)
  schedule.start_async(0, 2)
  assert [schedule.for_step(t)[0].version for t in (0, 1)] == [1, 1]
  served = []
  feed = threading.Thread(target=lambda: served.append(schedule.for_step(2)[0].version))
  feed.start()
  feed.join(0.5)
  assert feed.is_alive() and not served       # step 2 is not decided yet
  subscriber.have[2] = version(2)
  schedule.advance_async(0, 2)
  feed.join(5)
  assert served == [2]


def test_the_first_async_version_is_what_every_host_exchanged(monkeypatch):
  """The wait for the first version ends in an exchange of what each host found, acted on
  alike: a host with an older version waits for the newest another has (the version served is
  that one, on every host); a host that got SIGTERM, or ran out of index_timeout, ends every
  host's wait (FeedStopped; IndexWaitTimeout with its reason), whatever this one found."""
  import types
  from realm_jax.errors import IndexWaitTimeout
  from realm_jax.runtime import multihost
  from realm_jax.train.feed import FeedStopped, VersionSchedule
  version = lambda v: types.SimpleNamespace(version=v, step=10 * v)

  class Subscriber:
    def __init__(self):
      self.have, self.waits = {1: version(1)}, []

    def wait(self, pick, timeout, what, should_stop=None):   # None: should_stop() said so
      self.waits.append((round(timeout), what))
      return pick(self.have)
  config = types.SimpleNamespace(retrieval=types.SimpleNamespace(refresh="async",
                                                                 index_timeout=5))

  def host_1_says(*answers):   # process 1's part of each exchange; this host is process 0
    sent, answers = [], list(answers)

    def every_process(name, value, timeout):
      sent.append(value)
      subscriber.have[2] = version(2)   # loaded here in the meantime
      return [value, answers.pop(0)]
    monkeypatch.setattr(multihost, "every_process", every_process)
    return sent
  subscriber = Subscriber()
  sent = host_1_says("2", "2")
  assert VersionSchedule(config, subscriber).start_async(0, 2, lambda: False).version == 2
  assert sent == ["1", "2"]
  # the second round waits for v2 within the rest of index_timeout, and says so
  assert subscriber.waits == [(5, "at all"), (5, "v2 or newer (another process has it; the "
                                                 "rest of the first wait's 5s)")]
  for says, raised, words in (
      ("stopped", FeedStopped, "not ready after .*s \\(the first index every process has\\)"),
      ("timed out: no index after 5s: v1 rejected", IndexWaitTimeout,
       "^no index after 5s: v1 rejected$")):
    subscriber = Subscriber()
    host_1_says(says)
    with pytest.raises(raised, match=words):
      VersionSchedule(config, subscriber).start_async(0, 2, lambda: False)
  subscriber = Subscriber()
  subscriber.have.clear()
  sent = host_1_says("1")
  with pytest.raises(FeedStopped, match="the batch of step 4 was not ready"):
    VersionSchedule(config, subscriber).start_async(3, 2, lambda: True)   # SIGTERM here
  assert sent == ["stopped"]


def test_a_first_async_wait_that_fails_on_one_host_fails_on_every_host(monkeypatch):
  """The wait for the first async version that ends in an error on one host (its subscriber
  failed: a version whose load ran out of device memory, say) ends in the exchange too, as a
  deterministic batch's wait does: that host tells the others, then raises its error, and they
  raise it too, instead of waiting in the exchange for a host that left."""
  import types
  from realm_jax.runtime import multihost
  from realm_jax.train.feed import VersionSchedule
  config = types.SimpleNamespace(retrieval=types.SimpleNamespace(refresh="async",
                                                                 index_timeout=5))
  failure = "the index subscriber failed: XlaRuntimeError('RESOURCE_EXHAUSTED')"

  class Subscriber:
    def __init__(self, error=None):
      self.error = error

    def wait(self, pick, timeout, what, should_stop=None):
      if self.error is not None:
        raise self.error
      return pick({1: types.SimpleNamespace(version=1, step=0)})
  sent = []

  def host_1_says(answer):
    def every_process(name, value, timeout):
      sent.append(value)
      return [value, answer]
    monkeypatch.setattr(multihost, "every_process", every_process)
  host_1_says("1")
  with pytest.raises(RuntimeError, match=r"^the index subscriber failed: XlaRuntime"):
    VersionSchedule(config, Subscriber(RuntimeError(failure))).start_async(0, 2, lambda: False)
  assert sent == [f"failed: RuntimeError: {failure}"]
  host_1_says(f"failed: RuntimeError: {failure}")
  with pytest.raises(RuntimeError, match=r"^process 1: RuntimeError: the index subscriber"):
    VersionSchedule(config, Subscriber()).start_async(0, 2, lambda: False)
  assert sent[-1] == "1"
  # a bucket that stopped answering: StorageUnreachable on every host (one line at the CLI)
  from realm_jax.errors import StorageUnreachable
  host_1_says("failed: StorageUnreachable: gs://b/w/index: listing the index versions failed")
  with pytest.raises(StorageUnreachable, match=r"^gs://b/w/index: listing the index versions "
                     r"failed$"):
    VersionSchedule(config, Subscriber()).start_async(0, 2, lambda: False)


class _NoQueries:
  """A query stream of empty examples (the batches are `assemble`'s)."""

  def __next__(self):
    return {}

  def get_state(self):
    return {}


def _exchange_with_host_1(monkeypatch, sent: list):
  """`host_1_says(answer)`: multihost.every_process as between this host (process 0), whose
  values go to `sent`, and process 1, which answers `answer`."""
  from realm_jax.runtime import multihost

  def host_1_says(answer):
    def every_process(name, value, timeout):
      sent.append(value)
      return [value, answer]
    monkeypatch.setattr(multihost, "every_process", every_process)
  return host_1_says


def test_a_wait_for_a_deterministic_or_an_evaluated_index_stops_on_every_host_alike(
    monkeypatch):
  """Deterministic refresh: the batch of the run's first step and of each swap may wait long
  for its version on every host, as may an evaluation for its index. Each host waits until
  it has it or a SIGTERM came to any host of the job, then the hosts exchange whether each
  stopped: one stop is FeedStopped on every host (one whose batch was ready does not go on
  to the step's collectives alone), none lets every host go on."""
  import threading
  import time
  import types
  from realm_jax.train.candidates import PublishedIndex
  from realm_jax.train.feed import BatchFeed, FeedStopped
  sent = []

  host_1_says = _exchange_with_host_1(monkeypatch, sent)
  config = types.SimpleNamespace(retrieval=types.SimpleNamespace(
      refresh="deterministic", refresh_every=3, swap_lag=2, index_timeout=5))
  source = types.SimpleNamespace(config=config)
  waits = lambda start: [t for t in range(start, 12)
                         if PublishedIndex.waits_for_index(source, t, start)]
  assert waits(0) == [0, 5, 8, 11] and waits(6) == [6, 8, 11]
  index_ready = threading.Event()


  def assemble(step, queries):
    if step == 3:
      index_ready.wait(60)             # the builder is late with this step's version
    return {"step": step}, {}
  feed = BatchFeed(_NoQueries(), assemble, 2, depth=1)
  host_1_says("on")
  assert feed.next_together(lambda: False, 5)[0] == {"step": 2} and sent == ["on"]
  t0 = time.time()
  with pytest.raises(FeedStopped, match=r"the batch of step 4 was not ready after .*\(its "
                     r"index, or its data\)$"):
    feed.next_together(lambda: time.time() - t0 > 0.5, 5)   # SIGTERM (to any host)
  assert sent[-1] == "stopped"
  index_ready.set()
  host_1_says("stopped")               # this host's batch is ready, host 1 got SIGTERM
  with pytest.raises(FeedStopped, match="step 4 .*, on another process"):
    feed.next_together(lambda: False, 5)
  assert sent[-1] == "on"
  feed.close()
  version = types.SimpleNamespace(version=4, step=9)
  source.subscriber = types.SimpleNamespace(wait_for_step=lambda step, timeout, stop: version)
  source.stop_waiting = lambda: False
  with pytest.raises(FeedStopped, match="the index of the evaluation at step 9 was not ready "
                     r"after .*s \(the index built from step 9, on another process\)$"):
    PublishedIndex._index_to_evaluate(source, 9, 9)   # ready here, host 1 got SIGTERM
  source.subscriber.wait_for_step = lambda step, timeout, stop: None   # SIGTERM seen here
  with pytest.raises(FeedStopped, match=r"\(the index built from step 9\)$"):
    PublishedIndex._index_to_evaluate(source, 9, 9)
  source.subscriber.wait_for_step = lambda step, timeout, stop: version
  host_1_says("on")
  assert PublishedIndex._index_to_evaluate(source, 9, 9) is version


def test_a_wait_for_an_index_that_fails_on_one_host_fails_on_every_host(monkeypatch):
  """A deterministic batch's or an evaluation's wait for its index that ends in an error on
  one host (its index timed out there, or will never be published) ends in the exchange too:
  every host raises it (the same class for an index error), instead of the others waiting in
  the exchange for a host that left, or going on alone into the step's collectives."""
  import types
  from realm_jax.errors import IndexNeverPublished, IndexWaitTimeout
  from realm_jax.runtime import multihost
  from realm_jax.train.candidates import PublishedIndex
  from realm_jax.train.feed import BatchFeed
  sent = []

  host_1_says = _exchange_with_host_1(monkeypatch, sent)


  def assemble(step, queries):
    if step == 3:
      raise IndexWaitTimeout("no published index built from step 3 after 5s")
    return {"step": step}, {}
  feed = BatchFeed(_NoQueries(), assemble, 2, depth=1)
  host_1_says("failed: IndexWaitTimeout: no published index built from step 0 after 5s")
  with pytest.raises(IndexWaitTimeout, match="^no published index built from step 0 after"):
    feed.next_together(lambda: False, 5)   # this host's batch is ready: it does not go on
  host_1_says("on")
  with pytest.raises(IndexWaitTimeout, match="built from step 3"):
    feed.next_together(lambda: False, 5)   # timed out here: the other host hears it
  assert sent == ["on", "failed: IndexWaitTimeout: no published index built from step 3 "
                  "after 5s"]
  feed.close()

  def never(step, timeout, stop):
    raise IndexNeverPublished(f"the index built from checkpoint step {step} will not be")
  source = types.SimpleNamespace(
      config=types.SimpleNamespace(retrieval=types.SimpleNamespace(index_timeout=5)),
      subscriber=types.SimpleNamespace(wait_for_step=never), stop_waiting=lambda: False)
  with pytest.raises(IndexNeverPublished, match="step 9 will not be"):
    PublishedIndex._index_to_evaluate(source, 9, 9)
  assert sent[-1].startswith("failed: IndexNeverPublished: the index built from checkpoint")

  def gone(name, value, timeout):
    raise RuntimeError("process 0 of 2: not every process sent its 'stopped waiting'")
  monkeypatch.setattr(multihost, "every_process", gone)   # the other host's job ended
  with pytest.raises(IndexNeverPublished, match="step 9 will not be"):
    PublishedIndex._index_to_evaluate(source, 9, 9)
  host_1_says("failed: RuntimeError: the index subscriber was closed")
  source.subscriber.wait_for_step = lambda step, timeout, stop: types.SimpleNamespace(step=9)
  with pytest.raises(RuntimeError, match="^process 1: RuntimeError: the index subscriber was "
                     "closed$"):
    PublishedIndex._index_to_evaluate(source, 9, 9)


def test_an_in_process_rebuild_stops_at_the_same_batch_on_every_host(monkeypatch):
  """Processes rebuilding their index in process embed the same batches in step. One process
  asks after every batch whether a SIGTERM came; several agree after every STOP_CHECK_BLOCKS
  blocks whether one came to any of them (its notice, seen by each at its own moment), so
  that all stop at the same batch (their step saved) instead of none until the next step, a
  whole rebuild later."""
  import types
  from realm_jax.runtime import multihost
  from realm_jax.train import candidates
  source = types.SimpleNamespace(stop_waiting=lambda: False, config=types.SimpleNamespace(
      retrieval=types.SimpleNamespace(embed_batch_size=16)))
  assert candidates.RebuiltIndex._rebuild_stops(source) is source.stop_waiting
  asked, host_1_stops = [], []
  monkeypatch.setattr(candidates.jax, "process_count", lambda: 2)
  monkeypatch.setattr(candidates, "STOP_CHECK_BLOCKS", 3 * 16)   # every 3rd batch
  monkeypatch.setattr(multihost, "on_every_process",   # process 1's flag: not host_1_stops
                      lambda flag: asked.append(flag) or (flag and not host_1_stops))
  stops = candidates.RebuiltIndex._rebuild_stops(source)
  assert [stops() for _ in range(6)] == [False] * 6 and asked == [True, True]
  host_1_stops.append(True)            # SIGTERM to process 1, not seen here yet
  assert [stops() for _ in range(3)] == [False, False, True]
  source.stop_waiting = lambda: True   # seen here, not yet there
  host_1_stops.clear()
  stops = candidates.RebuiltIndex._rebuild_stops(source)
  assert [stops() for _ in range(3)] == [False, False, True] and asked[-1] is False


def mesh_of(processes: int, shape: tuple[int, int]) -> np.ndarray:
  """The process of each device of `make_mesh(shape)` over `processes` processes of equal
  device counts (JAX lists devices in process order)."""
  devices = shape[0] * shape[1]
  return np.repeat(np.arange(processes), devices // processes).reshape(shape)


def layout_of(processes: int, shape: tuple[int, int], order: str) -> np.ndarray:
  """The process of each device of a [data, model] mesh whose devices are listed in process
  order (`make_mesh`'s default), reversed, round-robin by process, or in pairs round-robin
  (as `jax_sort_devices_by_process_index=False` or topology-ordered ids may give)."""
  ordered = mesh_of(processes, shape).reshape(-1)
  n = len(ordered)
  return {"ordered": ordered, "reversed": ordered[::-1],
          "interleaved": np.arange(n) % processes,
          "pairs": (np.arange(n) // 2) % processes}[order].reshape(shape)


@pytest.mark.parametrize("processes, shape, expected", [
    (1, (2, 4), {0: ((0, 1), 2)}),
    (2, (8, 1), {0: ((0, 1, 2, 3), 8), 1: ((4, 5, 6, 7), 8)}),   # the model axis within one
    (2, (2, 4), {0: ((0,), 2), 1: ((1,), 2)}),
    (2, (1, 8), {0: ((0,), 1), 1: ((0,), 1)}),   # the model axis spans both: the same rows
    (4, (2, 4), {0: ((0,), 2), 1: ((0,), 2), 2: ((1,), 2), 3: ((1,), 2)}),
    (8, (4, 2), {p: ((p // 2,), 4) for p in range(8)}),   # one process per device, model 2
])
def test_each_process_loads_the_data_shards_its_devices_hold(processes, shape, expected):
  assert partitioning.data_shares(mesh_of(processes, shape)) == expected


@pytest.mark.parametrize("order", ["ordered", "reversed", "interleaved", "pairs"])
@pytest.mark.parametrize("processes, shape", [
    (1, (2, 4)), (2, (8, 1)), (2, (2, 4)), (2, (4, 2)), (2, (1, 8)), (4, (2, 4)), (4, (4, 2)),
    (4, (8, 1)), (8, (4, 2)), (8, (1, 8))])
def test_every_device_gets_the_rows_a_one_process_run_gives_it(processes, shape, order):
  """Whatever the order of the devices: a process loads its data shards' rows, and
  `jax.make_array_from_process_local_data` hands its device of data shard i the i-th block
  of B / D rows among the shards the process's devices hold, in sorted order: the rows
  [i * B / D, (i + 1) * B / D) of the global batch, those a one-process run gives it."""
  layout = layout_of(processes, shape, order)
  shares = partitioning.data_shares(layout)
  batch, step, size = 16, 3, 16 // shape[0]
  stream = grain.MapDataset.range(10 ** 6)
  for p, (shards, count) in shares.items():
    loaded = pipeline.process_batches(stream, batch, shards, count, np.asarray)[step]
    held = sorted({i for (i, _), q in np.ndenumerate(layout) if q == p})   # as JAX maps
    for (i, _), q in np.ndenumerate(layout):
      if q == p:
        k = held.index(i)
        np.testing.assert_array_equal(loaded[k * size:(k + 1) * size],
                                      np.arange(size) + step * batch + i * size)


@pytest.mark.parametrize("layout", [
    [[0, 0], [0, 1], [1, 1]],           # shard 1 split between processes 0 and 1
    [[0, 1, 1], [1, 2, 2]],             # 3 processes: {0}, {0, 1}, {1}
    [[0, 0], [0, 0], [1, 1]],           # two shards against one
])
def test_data_shards_that_processes_share_in_part_are_refused(layout):
  """Layouts JAX cannot assemble from per-process rows (two processes holding overlapping,
  unequal shard sets, or unequal numbers of them) are a ConfigError naming mesh.shape, at
  start-up, not an error inside JAX at the first step."""
  with pytest.raises(ConfigError, match=r"config\.mesh\.shape: .* must hold the same data "
                     "shards or none in common"):
    partitioning.data_shares(np.array(layout))
