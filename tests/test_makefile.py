"""The Makefile's targets run by make on a copy of it, with stand-ins for Python and its venv
(nothing is installed): a venv an interrupted `python -m venv` left without pip, or whose
python is gone, is made again and a whole one kept; `make lint` reads every source folder;
`make interop-check` without HF_DIR says so before it installs; and the test extra allows
only the pytest-xdist that has the flags `make test` passes."""

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.helpers import REPO

WHOLE = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls"
"""
HALF = """#!/bin/sh
case "$*" in "-m pip"*) echo "$0: No module named pip" >&2; exit 1;; esac
"""
# `python3 -m venv [--clear] DIR` as venv does it: over a DIR whose bin/python is a link (to a
# python since removed) it fails unless cleared
VENV = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/made"
for dir; do :; done
if [ "$3" != --clear ] && [ -L "$dir/bin/python" ]; then
  echo "Error: [Errno 2] No such file or directory: '$dir/bin/python'" >&2; exit 1
fi
rm -rf "$dir" && mkdir -p "$dir/bin" && cp "$(dirname "$0")/whole" "$dir/bin/python"
"""


# a venv's python that records its arguments, one call a JSON line
ARGV = """#!/usr/bin/env python3
import json, os, sys
with open(os.path.join(os.path.dirname(sys.argv[0]), "..", "argv"), "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def make(cwd, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True,
                        text=True, timeout=60)


def _checkout_with_stand_ins(tmp_path) -> str:
  """The Makefile in `tmp_path` beside an empty setup.py, with stand-ins bin/python3 (makes a
  venv) and bin/whole (a venv's python that runs pip); returns the stand-in python."""
  shutil.copy(os.path.join(REPO, "Makefile"), tmp_path)
  (tmp_path / "setup.py").write_text("")
  python = tmp_path / "bin" / "python3"
  python.parent.mkdir()
  python.write_text(VENV)
  (tmp_path / "bin" / "whole").write_text(WHOLE)
  for tool in (python, tmp_path / "bin" / "whole"):
    tool.chmod(0o755)
  return python


@pytest.mark.parametrize("venv", ["without pip", "its python gone"])
def test_install_makes_a_broken_venv_again_and_keeps_a_whole_one(tmp_path, venv):
  """`without pip`: python -m venv stopped during its ensurepip (a Ctrl-C early in a fresh
  clone's make demo); `its python gone`: bin/python links to a python since removed (the
  system's upgraded). Either stopped every later install (No module named pip / No such
  file) until the venv was removed by hand."""
  python = _checkout_with_stand_ins(tmp_path)
  broken = tmp_path / ".venv" / "bin" / "python"
  broken.parent.mkdir(parents=True)
  if venv == "without pip":
    broken.write_text(HALF)
    broken.chmod(0o755)
  else:
    broken.symlink_to(tmp_path / "no-such-python")
  result = make(tmp_path, "install", f"PYTHON={python}")
  assert result.returncode == 0, result.stdout + result.stderr
  made = (tmp_path / "bin" / "made").read_text()
  assert len(made.splitlines()) == 1, made
  assert "-m pip install --quiet --no-compile -e .[test]" in (tmp_path / ".venv" /
                                                               "calls").read_text()
  os.utime(tmp_path / "setup.py", (1e10, 1e10))   # setup.py edited: the recipe runs again
  result = make(tmp_path, "install", f"PYTHON={python}")
  assert result.returncode == 0, result.stdout + result.stderr
  assert (tmp_path / "bin" / "made").read_text() == made   # the whole venv is not made again


@pytest.mark.parametrize("target, workdir", [("demo", "WORKDIR"), ("demo-squad", "SQUAD_WORKDIR"),
                                              ("demo-openqa", "SQUAD_WORKDIR"),
                                              ("demo-real", "REAL_WORKDIR")])
def test_the_demos_take_a_path_with_spaces_or_quotes_as_one_argument(tmp_path, target, workdir):
  """`make demo-squad SQUAD="my data/dev set.json"`: each path one argument of the demo (the
  recipes split it at its spaces: the demo was refused `data/dev`, an unknown argument)."""
  python = _checkout_with_stand_ins(tmp_path)
  assert make(tmp_path, "install", f"PYTHON={python}").returncode == 0
  (tmp_path / ".venv" / "bin" / "python").write_text(ARGV)
  run_dir, squad = "runs/the demo's run", "my data/dev set.json"
  result = make(tmp_path, target, f"PYTHON={python}", f"{workdir}={run_dir}", f"SQUAD={squad}")
  assert result.returncode == 0, result.stdout + result.stderr
  argv = json.loads((tmp_path / ".venv" / "argv").read_text().splitlines()[-1])
  assert argv[argv.index("--workdir") + 1] == run_dir, argv
  if target != "demo":   # (the generated world's demo reads no SQuAD file)
    assert argv[argv.index("--squad") + 1] == squad, argv


def test_lint_byte_compiles_every_folder_of_python_sources(tmp_path):
  """`make lint` (byte-compile everything) fails on a syntax error in any folder of the
  repository's Python sources: each folder of them in a copy, the error in one at a time."""
  shutil.copy(os.path.join(REPO, "Makefile"), tmp_path)
  sources = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
  folders = sorted({path.split(os.sep)[0] for path in sources if os.sep in path})
  top = [path for path in sources if os.sep not in path]   # setup.py
  assert {"realm_jax", "launch", "bench"} <= set(folders) and "setup.py" in top, sources
  for folder in folders:
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "fine.py").write_text("x = 1\n")
  for path in top:
    (tmp_path / path).write_text("x = 1\n")
  for i, broken in enumerate([os.path.join(folder, "broken.py") for folder in folders] + top):
    (tmp_path / broken).write_text("def (:\n")
    # (compileall skips a file whose .pyc has its mtime, in whole seconds)
    os.utime(tmp_path / broken, (1e9 + i, 1e9 + i))
    assert make(tmp_path, "lint", "PYTHON=python3").returncode != 0, broken
    (tmp_path / broken).write_text("x = 1\n")
  assert make(tmp_path, "lint", "PYTHON=python3").returncode == 0


def test_the_test_extra_has_the_xdist_that_make_test_runs():
  """make test passes --no-loadscope-reorder, which pytest-xdist has since 3.8.0: the test
  extra may not allow an older one (it allowed 3.5, whose pytest stops at the unknown flag;
  pip keeps an installed one that meets the floor)."""
  with open(os.path.join(REPO, "Makefile")) as f:
    assert "--no-loadscope-reorder" in f.read()
  with open(os.path.join(REPO, "setup.py")) as f:
    floor = re.search(r'"pytest-xdist>=([\d.]+)', f.read()).group(1)
  assert tuple(int(p) for p in floor.split(".")) >= (3, 8), floor


def test_interop_check_without_hf_dir_says_its_usage_before_installing(tmp_path):
  """`make interop-check` without HF_DIR: the usage line and exit code 2 before the interop
  env (PyTorch and transformers, GBs) is made, not after."""
  python = _checkout_with_stand_ins(tmp_path)
  result = make(tmp_path, "interop-check", f"PYTHON={python}")
  assert result.returncode == 2, result.stdout + result.stderr
  assert "usage: make interop-check HF_DIR=<HF checkpoint dir>" in result.stdout
  assert not (tmp_path / "bin" / "made").exists() and not (tmp_path / ".venv-interop").exists()
