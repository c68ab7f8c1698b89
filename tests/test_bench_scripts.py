"""The bench scripts refuse what they cannot measure before they compile anything: bad counts,
unknown words, a missing file or GPU, each one line and exit code 2; and bench/gpu.sh keeps
its parts inside its deadline."""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

BENCH = os.path.join(REPO, "bench")


def bench_module(name: str):
  """bench/NAME.py imported by path, bench/ on sys.path as when it runs as a script."""
  if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
  spec = importlib.util.spec_from_file_location(f"_test_bench_{name}",
                                                os.path.join(BENCH, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def error_lines(result) -> list[str]:
  """stderr's lines but argparse's usage lines and the libraries' warnings."""
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  lines = [line for line in lines if "Warning" not in line and not line.startswith("usage:")
           and not line.startswith(" ")]
  return lines


@pytest.mark.parametrize("script, args, expected", [
    ("train_step.py", ["--only", "demo", "--steps", "0"], "argument --steps: 0 is not >= 1"),
    ("train_step.py", ["--only", "demo", "--steps", "-1"], "argument --steps: -1 is not >= 1"),
    ("train_step.py", ["--only", "demo", "--batch", "0"], "argument --batch: 0 is not >= 1"),
    ("profile_demo.py", ["--demo", "", "--steps", "0"], "argument --steps: 0 is not >= 1"),
    ("score_cache.py", ["--data", "x", "--steps", "0"], "argument --steps: 0 is not >= 1"),
    ("host_malloc.py", ["--case", "demo", "--steps", "0"], "argument --steps: 0 is not >= 1"),
    ("trace_summary.py", [".", "--steps", "0"], "argument --steps: 0 is not >= 1"),
    ("index_scale.py", ["--blocks", "1000", "--embed_batches", "0"],
     "argument --embed_batches: 0 is not >= 1"),
    ("index_scale.py", ["--blocks", "1000", "--queries", "10", "--batch", "32"],
     "--queries 10 must be >= --batch (32) and >= 32"),
    ("index.py", ["--batch", "0"], "argument --batch: 0 is not >= 1"),
    ("index.py", ["--queries", "0"], "argument --queries: 0 is not >= 1"),
    ("index.py", ["--queries", "10"], "--queries 10 must be >= --batch (32)"),
    ("checkpoint.py", ["--config", "configs/nowhere.py"],
     "--config configs/nowhere.py: no such file"),
    ("checkpoint.py", ["--config", "configs/demo_realm.py:bogus"],
     "--config configs/demo_realm.py:bogus: configs/demo_realm.py: unknown variant 'bogus'"),
    ("score_cache.py", ["--data", "/nonexistent/data"], "data dir '/nonexistent/data'"),
    # (no such --base: were the flags not checked first, it would stop there, not make a world)
    ("behaviour.py", ["--base", "no-such-commit", "--stages", "realm,bogus"],
     "--stages: unknown 'bogus'; one or more of realm, ict, mixed, distill"),
    ("behaviour.py", ["--base", "no-such-commit", "--steps", "2"], "--steps 2 must be >= 3"),
    # (read before jax and torch are imported: no interop env needed to be refused)
    ("peer_hf.py", ["--only", "bogus"], "argument --only: invalid choice: 'bogus'"),
    ("peer_hf.py", ["--steps", "0"], "argument --steps: 0 is not >= 1"),
])
def test_a_bench_refuses_what_it_cannot_measure_in_one_line(tmp_path, script, args, expected):
  """Before the compile: a count below 1 (a median of no steps), queries fewer than a batch (no
  batch would be timed), a missing config, variant or data dir, an unknown stage."""
  where = {"behaviour.py": ["--work", str(tmp_path / "work")],   # nothing made in the repo
           "index_scale.py": ["--cache", str(tmp_path / "cache"), "--out", ""],
           "index.py": ["--cache", str(tmp_path / "cache"), "--out", "", "--model_workdir", ""],
           "train_step.py": ["--out", ""]}.get(script, [])
  result = subprocess.run([sys.executable, os.path.join(BENCH, script), *args, *where],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
  lines = error_lines(result)
  assert len(lines) == 1 and expected in lines[0], result.stderr
  assert not os.path.exists(tmp_path / "work") and not os.path.exists(tmp_path / "cache")


def fake_tools(tmp_path, gpu: bool = True, jax_backend: str = "gpu") -> dict:
  """The environment of a bench/gpu.sh run on no GPU: an nvidia-smi that lists one (or fails)
  and a PYTHON whose JAX says `jax_backend` and that prints its arguments, failing
  bench/train_step.py."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + ("echo 'GPU 0: fake'\n" if gpu
                                                       else "exit 9\n"))
  (bin_dir / "python").write_text(f'#!/bin/sh\ncase "$*" in *default_backend*) echo '
                                  f'{jax_backend}; exit 0;; esac\necho "python $*"\n'
                                  'case "$*" in *train_step.py*) exit 1;; esac\n')
  for tool in bin_dir.iterdir():
    tool.chmod(0o755)
  return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
              PYTHON=str(bin_dir / "python"))


def gpu_sh(env: dict, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", os.path.join(BENCH, "gpu.sh"), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)


def test_gpu_sh_refuses_an_unknown_part_and_a_machine_without_a_gpu(tmp_path):
  env = fake_tools(tmp_path)
  result = gpu_sh(env, str(tmp_path / "out"), "step bogus")
  assert result.returncode == 2 and result.stderr.strip() == (
      "bench/gpu.sh: unknown part 'bogus' in PARTS (one or more of: step memory index real)")
  result = gpu_sh(fake_tools(tmp_path / "nogpu", gpu=False), str(tmp_path / "out"), "step")
  assert result.returncode == 2 and result.stderr.strip().startswith(
      "bench/gpu.sh: no NVIDIA GPU here"), result.stderr
  assert not os.path.exists(tmp_path / "out")


def test_gpu_sh_refuses_a_jax_without_its_gpu_backend(tmp_path):
  """nvidia-smi lists a GPU, but JAX has only its CPU backend (jax without the CUDA plugin):
  refused before any part, as no GPU is (the parts would compile realm_base on the CPU)."""
  result = gpu_sh(fake_tools(tmp_path, jax_backend="cpu"), str(tmp_path / "out"), "step")
  assert result.returncode == 2 and result.stderr.strip().startswith(
      "bench/gpu.sh: JAX finds no GPU here (its backend: cpu)"), result.stderr
  assert not os.path.exists(tmp_path / "out") and "== " not in result.stdout


def test_gpu_sh_keeps_its_background_parts_inside_the_deadline(tmp_path):
  """DEADLINE=50: the table (deadline - 60) and the memory benches (deadline - 40) have no time
  left, so they are skipped as a part is, never given a negative limit; trace_summary does not
  run after its train step failed, nor counts as a second failure. An earlier run's memory
  log in the same OUT is not printed as this run's."""
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "memory_realm_base_float32.log").write_text("an earlier run's figures\n")
  result = gpu_sh(dict(fake_tools(tmp_path), DEADLINE="50"), str(tmp_path / "out"))
  out = result.stdout
  assert "an earlier run's figures" not in out
  assert result.returncode == 1, out
  assert "invalid time interval" not in out + result.stderr
  for name in ("table", "memory_realm_base_bfloat16", "memory_ict_base_all"):
    assert f"== {name}: skipped" in out and not (tmp_path / "out" / f"{name}.log").exists()
  assert "== trace_summary: skipped (train_step_cudnn did not exit 0)" in out
  failed = out.strip().splitlines()[-1]
  assert failed.startswith("== parts that did not exit 0:") and "table(skipped)" in failed
  assert "train_step_cudnn " in failed + " " and "trace_summary" not in failed


def test_the_host_cpu_is_read_with_its_avx512_flag(tmp_path):
  report = bench_module("report")
  xeon = tmp_path / "xeon"
  xeon.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n"
                  "flags\t\t: fpu avx2 avx512f avx512dq\n\nprocessor\t: 1\n")
  epyc = tmp_path / "epyc"
  epyc.write_text("model name\t: AMD EPYC 7B12\nflags\t\t: fpu avx2 fma\n")
  assert report.host_cpu(str(xeon)) == {"cpu_model": "Intel(R) Xeon(R) CPU @ 2.20GHz",
                                        "avx512": True}
  assert report.host_cpu(str(epyc)) == {"cpu_model": "AMD EPYC 7B12", "avx512": False}
  assert report.host_cpu(str(tmp_path / "none"))["avx512"] is None
  assert isinstance(report.host_cpu()["cpu_model"], str)


def test_behaviour_names_a_failed_run_and_its_log(tmp_path):
  behaviour = bench_module("behaviour")
  log = tmp_path / "realm_head.log"
  with pytest.raises(behaviour.RunFailed) as failed:
    behaviour.run_code(REPO, "print('started'); raise SystemExit(3)\n", log=str(log),
                       what="stage realm (realm_head)")
  assert str(failed.value) == f"stage realm (realm_head) exited with code 3; its output is " \
                              f"in {log}"
  assert log.read_text() == "started\n"


def test_refresh_pads_a_class_without_steps_to_its_column(capsys):
  refresh = bench_module("refresh")
  empty = {"steps": 0, "median_ms": None, "p90_ms": None, "ratio_to_idle": None}
  full = {"steps": 40, "median_ms": 120.5, "p90_ms": 130.25, "ratio_to_idle": 1.0}
  record = {"mode": "async", "steps": 60, "refresh_every": 10,
            "classes": {"idle": full, "building": full, "swap": empty},
            "blocking_waits_summary": 0, "blocking_wait_seconds_summary": 0.0,
            "blocking_waits_counted": 0, "blocking_wait_seconds_counted": 0.0,
            "staleness_p50": 1, "staleness_p95": 2, "staleness_max": 3, "versions_used": 5,
            "versions_published": 6, "wall_s": 10.0, "trainer_wall_s": 9.0,
            "steps_wall_s": 8.0, "embed_s_mean": 1.0, "build_interval_s_mean": 1.5, "cpus": 2}
  refresh.print_table(record)
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith(("class", "idle", "swap"))]
  assert len({len(line) for line in rows}) == 1, rows
  assert [cell.strip() for cell in rows[-1].split("|")] == ["swap", "0", "-", "-", "-"]



def tower_xla_flops(config, tower: str, sequences: int) -> float:
  """XLA's count of a retriever tower's forward (`queries` or `blocks`) on `sequences` of the
  config's length, per sequence: its matmuls dominate it (the analytic counts' reference)."""
  import jax
  import numpy as np
  from realm_jax.models.realm import REALM
  from realm_jax.runtime import state as state_lib
  model = state_lib.build_model(config, config.model.vocab_size)
  if tower == "queries":
    method, inputs = REALM.embed_queries, lambda i: (i,)
    length = config.data.query_len
  else:
    method, inputs = REALM.embed_blocks, lambda i: (i, i)
    length = config.data.block_len
  ids = jax.ShapeDtypeStruct((sequences, length), np.int32)
  params = jax.eval_shape(lambda i: model.init(jax.random.PRNGKey(0), *inputs(i),
                                               method=method), ids)["params"]
  embed = jax.jit(lambda p, i: model.apply({"params": p}, *inputs(i), method=method))
  cost = embed.lower(params, ids).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]) / sequences


def test_the_analytic_step_count_follows_the_retriever_pooling():
  """A mean-pooling retriever (the `real` case's, from MiniLM) computes its last layer at
  every position and has no pooler: the step's analytic count grows by 3 x its towers' extra
  forward FLOPs over the [CLS]-pooling one's, as XLA counts them (it was left as for [CLS]
  alone: 23% short on `real`, whose rates on an accelerator are the analytic count's)."""
  train_step = bench_module("train_step")
  cls = train_step.case_config("demo", False, 4)
  mean = train_step.case_config("demo", False, 4, ["model.retriever.pooling=mean"])
  assert (cls.model.retriever.pooling, mean.model.retriever.pooling) == ("cls", "mean")
  b, k = cls.train.batch_size, train_step.candidates_read(cls)
  extra = {tower: tower_xla_flops(mean, tower, 4) - tower_xla_flops(cls, tower, 4)
           for tower in ("queries", "blocks")}
  expected = 3 * (b * extra["queries"] + b * k * extra["blocks"])
  analytic = train_step.analytic_flops(mean) - train_step.analytic_flops(cls)
  assert abs(analytic - expected) < 0.05 * expected, (analytic, expected)


def test_the_index_bench_counts_the_block_tower_it_runs():
  """bench/index.py's FLOPs per block (its embedding FLOP/s and their ratio to the matmul) are
  the tower's as XLA counts them: its last layer computes [CLS] alone (it counted every
  position of every layer: 1.7x the demo tower's work)."""
  index = bench_module("index")
  train_step = bench_module("train_step")
  config = train_step.case_config("demo", False, None)
  xla = tower_xla_flops(config, "blocks", 8)
  assert abs(index.block_flops(config) - xla) < 0.05 * xla, (index.block_flops(config), xla)


def test_the_prepare_bench_reads_a_squad_file_as_realm_prepare_does(tmp_path):
  """bench/prepare.py's paragraphs of a SQuAD file with a byte-order mark, or gzip'd, which
  realm-prepare reads: a JSONDecodeError or UnicodeDecodeError before."""
  import gzip
  import json
  paragraph = {"context": "Town A was founded in 1901.", "qas": [
      {"id": "q", "question": "When?", "answers": [{"text": "1901", "answer_start": 22}]}]}
  text = json.dumps({"data": [{"title": "T", "paragraphs": [paragraph]}]})
  (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + text.encode())
  (tmp_path / "squad.json.gz").write_bytes(gzip.compress(text.encode()))
  load = bench_module("prepare").load_paragraphs
  for name in ("bom.json", "squad.json.gz"):
    assert load(tmp_path / name) == [("Town A was founded in 1901.", [(22, 26)])]


def test_the_prepare_bench_times_realm_prepare_on_a_gzipped_squad_file(tmp_path):
  """bench/prepare.py's throughput section writes the paragraphs of the SQuAD file it was
  given, gzip'd or with a byte-order mark, as its agreement section reads them (it opened the
  file as plain JSON: a UnicodeDecodeError after the agreement table was printed)."""
  import gzip
  import json
  paragraph = {"context": "Town A was founded in 1901. Its mayor is Kelmar Borin.", "qas": [
      {"id": "q", "question": "When?", "answers": [{"text": "1901", "answer_start": 22}]}]}
  text = json.dumps({"data": [{"title": "T", "paragraphs": [paragraph]}]})
  (tmp_path / "squad.json.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + text.encode()))
  result = bench_module("prepare").prepare_throughput(tmp_path / "squad.json.gz", 2, 0)
  assert result["documents"] == 2 and result["blocks"] >= 2, result


def test_the_checkpoint_bench_record_names_its_bench_and_saves(tmp_path):
  """bench/checkpoint.py's JSON line says what it is and over how many saves its medians are
  taken, as its table does and as every other bench's line does (it had neither: a line
  appended to a shared file could not be told from another bench's, nor its medians read)."""
  import json
  out = tmp_path / "bench.jsonl"
  result = subprocess.run([sys.executable, os.path.join(BENCH, "checkpoint.py"), "--devices",
                           "1", "--saves", "3", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "(median of 2)" in result.stdout
  record = json.loads(out.read_text())
  assert (record["bench"], record["saves"], record["devices"]) == ("checkpoint", 3, 1), record
