"""The bench scripts refuse what they cannot measure before they start: bench/gpu.sh an
unknown part or a machine without a GPU, in one line and exit code 2; and it keeps its parts
inside its deadline."""

import os
import subprocess

from tests.helpers import REPO

BENCH = os.path.join(REPO, "bench")


def fake_tools(tmp_path, gpu: bool = True) -> dict:
  """The environment of a bench/gpu.sh run on no GPU: an nvidia-smi that lists one (or fails)
  and a PYTHON that prints its arguments, failing bench/train_step.py."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + ("echo 'GPU 0: fake'\n" if gpu
                                                       else "exit 9\n"))
  (bin_dir / "python").write_text('#!/bin/sh\necho "python $*"\n'
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


def test_gpu_sh_keeps_its_background_parts_inside_the_deadline(tmp_path):
  """DEADLINE=50: the table (deadline - 60) and the memory benches (deadline - 40) have no time
  left, so they are skipped as a part is, never given a negative limit; trace_summary does not
  run after its train step failed, nor counts as a second failure."""
  result = gpu_sh(dict(fake_tools(tmp_path), DEADLINE="50"), str(tmp_path / "out"))
  out = result.stdout
  assert result.returncode == 1, out
  assert "invalid time interval" not in out + result.stderr
  for name in ("table", "memory_realm_base_bfloat16", "memory_ict_base_all"):
    assert f"== {name}: skipped" in out and not (tmp_path / "out" / f"{name}.log").exists()
  assert "== trace_summary: skipped (train_step_cudnn did not exit 0)" in out
  failed = out.strip().splitlines()[-1]
  assert failed.startswith("== parts that did not exit 0:") and "table(skipped)" in failed
  assert "train_step_cudnn " in failed + " " and "trace_summary" not in failed
